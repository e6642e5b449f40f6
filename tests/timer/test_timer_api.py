"""``configure``/``expires`` and the in-process LocalTimerServer/LocalTimerClient pair."""

from __future__ import annotations

import multiprocessing as mp
import os
import select
import signal
import time

import pytest

from fastelastic import timer
from fastelastic.timer import LocalTimerClient, LocalTimerServer, TimerClient


class _Recorder(TimerClient):
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id))


def test_expires_without_client_raises(monkeypatch):
    monkeypatch.setattr(timer.api, "_timer_client", None)
    with pytest.raises(RuntimeError, match="Configure timer client"), timer.expires(after=1):
        pass


def test_expires_default_scope_is_the_with_statement(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(timer.api, "_timer_client", None)
    timer.configure(rec)
    before = time.time()
    with timer.expires(after=5):
        line = __import__("inspect").currentframe().f_lineno - 1
    assert rec.calls[0][0] == "acquire"
    assert rec.calls[0][1] == f"{__file__}#{line}"
    assert before + 5 <= rec.calls[0][2] <= time.time() + 5
    assert rec.calls[1] == ("release", rec.calls[0][1])


def test_expires_releases_on_exception():
    rec = _Recorder()
    with pytest.raises(KeyError), timer.expires(after=1, scope="s", client=rec):
        raise KeyError("x")
    assert [c[0] for c in rec.calls] == ["acquire", "release"]


def _hang_under_timer(q, after):
    timer.configure(LocalTimerClient(q))
    with timer.expires(after=after, scope="hang"):
        signal.pause()


def _finish_under_timer(q, done):
    timer.configure(LocalTimerClient(q))
    with timer.expires(after=0.3, scope="quick"):
        pass
    done.set()
    signal.pause()


@pytest.mark.timeout(60)
def test_local_timer_server_kills_at_deadline():
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    server = LocalTimerServer(q, max_interval=2)  # latency must not depend on it
    server.start()
    try:
        done = ctx.Event()
        survivor = ctx.Process(target=_finish_under_timer, args=(q, done))
        survivor.start()
        assert done.wait(30)
        start = time.monotonic()
        victim = ctx.Process(target=_hang_under_timer, args=(q, 0.3))
        victim.start()
        pidfd = os.pidfd_open(victim.pid)
        try:
            assert select.select([pidfd], [], [], 10)[0], "victim not killed"
        finally:
            os.close(pidfd)
        assert time.monotonic() - start < 3.0, "fired at the next sweep, not the deadline"
        victim.join(5)
        assert victim.exitcode == -signal.SIGKILL
        assert survivor.is_alive()
        survivor.kill()
        survivor.join(5)
    finally:
        server.stop()


def test_local_timer_server_table_api():
    server = LocalTimerServer(mp.get_context("fork").Queue(), max_interval=1)
    now = time.time()
    server.register_timers(
        [
            timer.TimerRequest(1, "a", now + 10),
            timer.TimerRequest(1, "b", now + 20),
            timer.TimerRequest(2, "a", now + 5),
        ]
    )
    assert {k: [r.scope_id for r in v] for k, v in server.get_expired_timers(now + 15).items()} == {
        1: ["a"],
        2: ["a"],
    }
    server.register_timers([timer.TimerRequest(1, "a", -1)])
    server.clear_timers({2})
    assert {k: [r.scope_id for r in v] for k, v in server.get_expired_timers(now + 30).items()} == {
        1: ["b"]
    }
