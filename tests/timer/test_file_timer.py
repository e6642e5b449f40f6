"""FileTimerServer against real worker processes: kills at the deadline, and only our workers."""

from __future__ import annotations

import json
import os
import signal
import stat
import time

import pytest
from timer_testlib import EventLog, fifo_barrier

from fastelastic.timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    default_timer_file,
)

KILL = int(signal.SIGKILL)


@pytest.fixture
def events():
    return EventLog()


@pytest.fixture
def server(fifo_path, events):
    srv = FileTimerServer(fifo_path, "run-1", max_interval=0.1, log_event=events)
    srv.start()
    yield srv
    srv.stop()


def test_fifo_is_private_and_removed_on_stop(events):
    path = default_timer_file()
    srv = FileTimerServer(path, "r", log_event=events)
    st = os.stat(path)
    assert stat.S_ISFIFO(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    srv.start()
    srv.stop()
    assert not os.path.exists(path) and not os.path.exists(os.path.dirname(path))
    assert [n for n, _ in events.events] == ["watchdog started", "watchdog stopped"]


def test_expiry_kills_holder_at_its_deadline(server, fifo_path, events, workers):
    w = workers(fifo_path, [["acquire", "step", 0.4, KILL]])
    died = w.wait_death()
    assert w.proc.returncode == -signal.SIGKILL
    late = died - w.deadlines["step"]
    assert late > -0.005, f"killed {-late * 1000:.1f} ms before the deadline"
    # bound loose enough for a loaded 2-core CI box; torch's default sweep is 10 s
    assert late < 1.0, f"killed {late * 1000:.1f} ms after the deadline"
    killed = events.wait("kill worker process", pid=w.pid)
    assert killed.scope_id == "step" and killed.signal == KILL
    assert events.wait("timer expired", pid=w.pid).scope_id == "step"
    assert server.get_expired_timers(time.time() + 1e6) == {}


def test_release_prevents_kill(server, fifo_path, events, workers):
    # "late" only reports (signal 0): once it expired, the released "step" deadline is long past
    w = workers(
        fifo_path,
        [["acquire", "step", 0.2, KILL], ["release", "step"], ["acquire", "late", 0.6, 0]],
    )
    events.wait("timer expired", pid=w.pid, scope="late")
    assert w.alive()
    assert [r.scope_id for r in events.of("timer expired")] == ["late"]
    assert events.of("kill worker process") == []


def test_many_scopes_per_worker(server, fifo_path, events, workers):
    ops = [["acquire", f"s{i}", 30.0, KILL] for i in range(50)]
    ops += [["release", f"s{i}"] for i in range(50)]
    ops += [
        ["acquire", "b", 0.5, KILL],
        ["acquire", "a", 0.3, KILL],
        ["acquire", "keep", 30.0, KILL],
    ]
    w = workers(fifo_path, ops)
    died = w.wait_death()
    assert died >= w.deadlines["a"] - 0.005
    assert events.wait("kill worker process", pid=w.pid).scope_id == "a"
    assert [r.scope_id for r in events.of("timer expired")] == ["a"]
    # the worker's other timers went with it
    assert server.get_expired_timers(time.time() + 1e6) == {}


def test_two_workers_each_killed_at_own_deadline(server, fifo_path, events, workers):
    w1 = workers(fifo_path, [["acquire", "x", 0.3, KILL]])
    w2 = workers(fifo_path, [["acquire", "x", 1.2, KILL]])
    d1 = w1.wait_death()
    assert w2.alive()
    d2 = w2.wait_death()
    assert d1 < w2.deadlines["x"] <= d2 + 0.005


def test_foreign_pid_is_refused_and_not_signalled(fifo_path, events, workers):
    srv = FileTimerServer(
        fifo_path,
        "r",
        max_interval=0.1,
        log_event=events,
        allow_descendants=False,
        allow_same_user=False,
    )
    srv.start()
    try:
        foreign = workers(fifo_path, [["acquire", "f", 0.2, int(signal.SIGUSR1)]])
        refused = events.wait("request refused", pid=foreign.pid)
        assert refused.scope_id == "f"
        # a request naming our parent process (not ours to signal, harmless signal anyway)
        srv.register_timers([FileTimerRequest(os.getppid(), "p", time.time(), int(signal.SIGURG))])
        events.wait("request refused", pid=os.getppid())
        # positive control on the allow-list, deadline well after the foreign one
        allowed = workers(fifo_path, [])
        srv.allow_pid(allowed.pid)
        srv.register_timers([FileTimerRequest(allowed.pid, "ok", time.time() + 0.5, KILL)])
        allowed.wait_death()
        events.wait("kill worker process", pid=allowed.pid)  # reported after the kill
        assert foreign.alive()
        assert foreign.signals_seen() == []
        assert [r.worker_pid for r in events.of("kill worker process")] == [allowed.pid]
    finally:
        srv.stop()


def test_descendants_are_accepted_without_allow_list(server, fifo_path, events, workers):
    assert server.allowed_pids == frozenset()
    w = workers(fifo_path, [["acquire", "d", 0.2, KILL]])
    w.wait_death()
    assert events.of("request refused") == []


def test_own_pid_is_never_signalled(server, events):
    server.register_timers([FileTimerRequest(os.getpid(), "self", time.time() - 1, KILL)])
    assert events.wait("request refused", pid=os.getpid()).scope_id == "self"


def _raw_write(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def test_garbage_partial_and_oversized_lines_are_skipped(server, fifo_path, events, workers):
    _raw_write(fifo_path, b"garbage\n")
    _raw_write(fifo_path, b'{"version": 1, "pid": 12, "scope_id": "x"\n')
    _raw_write(fifo_path, b"\x00\xff\xfe{]]]\n\n")
    _raw_write(
        fifo_path,
        b'{"version": 1, "pid": "12", "scope_id": "x", "expiration_time": 1, "signal": 9}\n',
    )
    _raw_write(fifo_path, b"x" * 3000)  # one oversized line in two non-atomic writes
    _raw_write(fifo_path, b"y" * 3000 + b"\n")
    _raw_write(fifo_path, b'{"version": 1, "pid": ')  # a writer that stops mid-line
    events.wait_count("malformed request", 6)  # the binary line splits in two at its "{"
    w = workers(fifo_path, [["acquire", "after-garbage", 0.3, KILL]])
    w.wait_death()
    assert events.wait("kill worker process", pid=w.pid).scope_id == "after-garbage"
    assert events.count("malformed request") == 7  # the mid-line fragment is dropped too


def test_fragment_glued_to_a_good_line_is_salvaged(server, fifo_path, events, workers):
    holder = workers(fifo_path, [])
    good = FileTimerRequest(holder.pid, "glued", time.time() + 0.3, KILL).to_json()
    _raw_write(fifo_path, b'{"version": 1, "pid": 7, "sco' + good.encode() + b"\n")
    holder.wait_death()
    assert events.wait("kill worker process", pid=holder.pid).scope_id == "glued"
    assert events.count("malformed request") == 1


def test_writers_opening_and_closing_and_a_stalled_writer(server, fifo_path, events, workers):
    for _ in range(300):
        os.close(os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK))
    stalled = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)  # never writes, never closes
    try:
        w = workers(fifo_path, [["acquire", "s", 0.3, KILL]])
        w.wait_death()
        events.wait("kill worker process", pid=w.pid)
        progress = server.get_last_progress_time()
        assert abs(progress - time.time()) <= 2
    finally:
        os.close(stalled)
    assert events.count("malformed request") == 0


def test_exited_worker_clears_its_timers(server, fifo_path, events, workers):
    w = workers(fifo_path, [["acquire", "a", 60.0, KILL], ["acquire", "b", 60.0, KILL]])
    fifo_barrier(fifo_path, events)  # both timers are registered before the worker exits
    assert len(server.get_expired_timers(time.time() + 1e6)[w.pid]) == 2
    w.close()
    events.wait("worker exited")
    assert server.get_expired_timers(time.time() + 1e6) == {}


def test_table_api(server, fifo_path, workers):
    w = workers(fifo_path, [])
    far = time.time() + 1000
    server.register_timers(
        [FileTimerRequest(w.pid, "t1", far, KILL), FileTimerRequest(w.pid, "t2", far + 1, KILL)]
    )
    expired = server.get_expired_timers(far + 0.5)
    assert list(expired) == [w.pid] and [r.scope_id for r in expired[w.pid]] == ["t1"]
    assert len(server.get_expired_timers(far + 2)[w.pid]) == 2
    server.register_timers([FileTimerRequest(w.pid, "t1", -1)])
    assert [r.scope_id for r in server.get_expired_timers(far + 2)[w.pid]] == ["t2"]
    server.clear_timers({w.pid})
    assert server.get_expired_timers(far + 2) == {}
    assert server._request_count == 3
    assert w.alive()


def test_run_once_processes_pending_requests(fifo_path, events, workers):
    srv = FileTimerServer(fifo_path, "r", log_event=events)
    w = workers(fifo_path, [["acquire", "due", -1.0, KILL]])  # already expired when sent
    srv.run_once()  # never started: one synchronous pass
    w.wait_death()
    assert events.wait("kill worker process", pid=w.pid).scope_id == "due"
    assert not os.path.exists(fifo_path)


def test_client_without_server_raises_broken_pipe(fifo_path):
    os.mkfifo(fifo_path, 0o600)  # a FIFO nobody reads
    client = FileTimerClient(fifo_path)
    with pytest.raises(BrokenPipeError):
        client.acquire("x", time.time() + 10)


def test_client_rejects_oversized_request(server, fifo_path):
    with pytest.raises(RuntimeError, match="larger than"):
        FileTimerClient(fifo_path).acquire("s" * 5000, time.time() + 10)


def test_log_event_failure_does_not_stop_the_server(fifo_path, workers):
    seen = EventLog()

    def flaky(name, request):
        seen(name, request)
        raise ValueError("boom")

    srv = FileTimerServer(fifo_path, "r", max_interval=0.1, log_event=flaky)
    srv.start()
    try:
        w1 = workers(fifo_path, [["acquire", "a", 0.2, KILL]])
        w1.wait_death()
        w2 = workers(fifo_path, [["acquire", "b", 0.2, KILL]])
        w2.wait_death()
        seen.wait("kill worker process", pid=w2.pid)
    finally:
        srv.stop()


def test_wire_line_is_one_json_object(fifo_path):
    r = FileTimerRequest(123, "scope é", 1732870000.25, KILL)
    line = r.to_json()
    assert json.loads(line) == {
        "version": 1,
        "pid": 123,
        "scope_id": "scope é",
        "expiration_time": 1732870000.25,
        "signal": 9,
    }
    assert "\n" not in line


def test_dump_stacks_via_faulthandler_before_the_kill(
    fifo_path, events, workers, tmp_path, monkeypatch
):
    from fastelastic.timer import stacks

    monkeypatch.setattr(stacks.shutil, "which", lambda name: None)  # the no-py-spy path
    srv = FileTimerServer(fifo_path, "r", max_interval=0.1, log_event=events, dump_stacks=True)
    srv.start()
    try:
        with open(tmp_path / "worker.err", "w+") as err:
            w = workers(fifo_path, [["stackdump"], ["acquire", "stuck", 0.3, KILL]], stderr=err)
            w.wait_death()
            assert w.proc.returncode == -signal.SIGKILL
            assert events.wait("kill worker process", pid=w.pid).scope_id == "stuck"
            err.seek(0)
            log = err.read()
        assert "Current thread" in log or "Thread 0x" in log, log  # faulthandler's all-threads dump
        assert "timer_worker.py" in log, log
    finally:
        srv.stop()


def test_last_progress_time_tracks_the_loop(fifo_path, events, workers):
    srv = FileTimerServer(fifo_path, "r", max_interval=0.05, log_event=events)
    before = time.time()
    assert int(before) <= srv.get_last_progress_time() <= time.time()  # not started: now
    srv.start()
    try:
        w = workers(fifo_path, [["acquire", "p", 0.2, KILL]])
        w.wait_death()
        events.wait("kill worker process", pid=w.pid)  # the loop iterated after the kill
        assert srv.get_last_progress_time() >= int(
            w.deadlines["p"] - time.monotonic() + time.time()
        )
    finally:
        srv.stop()
