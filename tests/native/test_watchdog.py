"""The native watchdog through its Python API: parser vs json, fds, EINTR, allow-list mechanics."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastelastic._native.watchdog import (
    ADMIT_BAD_PID,
    ADMIT_GONE,
    ADMIT_OK,
    ADMIT_REFUSED,
    EV_EXPIRED,
    EV_KILLED,
    FifoWatchdog,
    parse_request,
)


def _reference(line: bytes):
    """Slow, obviously correct reading of a request line (what torch's server does)."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise TypeError("not an object")
    pid, scope, exp, sig = obj["pid"], obj["scope_id"], obj["expiration_time"], obj["signal"]
    if type(pid) is not int or type(sig) is not int or not isinstance(scope, str):
        raise ValueError("types")
    if isinstance(exp, bool) or not isinstance(exp, (int, float)) or not math.isfinite(exp):
        raise ValueError("expiration")
    return pid, scope, float(exp), sig


@settings(max_examples=300, deadline=None)
@given(
    pid=st.integers(0, 2**31 - 1),
    scope=st.text(max_size=60),
    exp=st.one_of(st.floats(-1e12, 1e12, allow_nan=False), st.integers(-(10**12), 10**12)),
    sig=st.integers(-64, 64),
    extra=st.dictionaries(
        st.sampled_from(["version", "x", "note"]),
        st.one_of(st.integers(), st.text(max_size=5), st.none(), st.booleans()),
    ),
    ensure_ascii=st.booleans(),
)
def test_parser_agrees_with_json(pid, scope, exp, sig, extra, ensure_ascii):
    obj = dict(extra, pid=pid, scope_id=scope, expiration_time=exp, signal=sig)
    line = json.dumps(obj, ensure_ascii=ensure_ascii).encode("utf-8", "surrogatepass")
    ref = _reference(line)
    got = parse_request(line)
    assert got[0] == ref[0] and got[1] == ref[1] and got[3] == ref[3]
    assert got[2] == pytest.approx(ref[2], rel=1e-15, abs=1e-9)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_parser_never_accepts_what_json_rejects(data):
    try:
        got = parse_request(data)
    except ValueError:
        return
    assert _reference(data)[0] == got[0]


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def fifo():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "f")
        os.mkfifo(path, 0o600)
        yield path


def _leak_one(path: str) -> None:
    FifoWatchdog(path)  # never closed: its __dealloc__ closes the fds and warns
    gc.collect()


def test_no_fd_leak_and_unclosed_warning(fifo):
    before = _fds()
    for _ in range(20):
        wd = FifoWatchdog(fifo, 0.01)
        wd.register(os.getpid(), "x", time.time() + 100, 9)  # refused: own pid
        wd.poll_once(None)
        wd.close()
        wd.close()  # idempotent
    gc.collect()
    assert _fds() == before
    with pytest.warns(ResourceWarning):
        _leak_one(fifo)
    assert _fds() == before


def test_admission_results(fifo):
    wd = FifoWatchdog(fifo, allow_descendants=False)
    try:
        assert wd.register(os.getpid(), "s", time.time() + 100, 9) == ADMIT_BAD_PID
        assert wd.register(0, "s", time.time() + 100, 9) == ADMIT_BAD_PID
        child = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        try:
            assert wd.register(child.pid, "s", time.time() + 100, 9) == ADMIT_REFUSED
            wd.set_allowed([child.pid])
            assert wd.register(child.pid, "s", time.time() + 100, 9) == ADMIT_OK
            assert len(wd) == 1
            wd.set_allowed([])  # leaves the list and is not admitted as a descendant here
            assert len(wd) == 0
        finally:
            child.stdin.close()
            child.wait(10)
        assert wd.register(child.pid, "s", time.time() + 100, 9) == ADMIT_GONE
    finally:
        wd.close()


def test_run_in_main_thread_is_interruptible(fifo):
    """EINTR: a signal handler that raises must end run() (pyzmq's retry discipline)."""
    wd = FifoWatchdog(fifo, 10.0)

    class Interrupted(Exception):
        pass

    def handler(signum, frame):
        raise Interrupted

    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(Interrupted):
            wd.run(lambda batch: None)
        assert not wd.running
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        wd.close()


def test_close_while_running_is_refused_and_stop_is_prompt(fifo):
    wd = FifoWatchdog(fifo, 10.0)
    started = threading.Event()
    batches: list = []

    def cb(batch):
        batches.extend(batch)

    t = threading.Thread(target=lambda: (started.set(), wd.run(cb)))
    t.start()
    started.wait(5)
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert wd.register(child.pid, "k", time.time() + 0.1, 9) == ADMIT_OK
        assert child.wait(10) == -9
    finally:
        child.stdin.close()
    assert wd.running
    with pytest.raises(RuntimeError):
        wd.close()
    t0 = time.monotonic()
    wd.stop()
    t.join(5)
    assert (
        not t.is_alive() and time.monotonic() - t0 < 1.0
    )  # heartbeat is 1 s: woken, not timed out
    wd.close()
    kinds = [b[0] for b in batches]
    assert EV_EXPIRED in kinds and EV_KILLED in kinds
    killed = next(b for b in batches if b[0] == EV_KILLED)
    assert killed[5] == 0 and killed[7] >= killed[6]  # err 0, fired at or after the deadline
    assert killed[7] - killed[6] < 250_000_000, "fired at a sweep, not at the deadline"


def _fifo_permitted() -> bool:
    """Whether this process may put a thread on SCHED_FIFO (tried on a throwaway thread)."""
    result: list[bool] = []

    def probe():
        try:
            os.sched_setscheduler(
                0, os.SCHED_FIFO, os.sched_param(os.sched_get_priority_min(os.SCHED_FIFO))
            )
            result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return result[0]


def test_realtime_loop_runs_python_at_normal_priority(fifo):
    """realtime: the loop thread is SCHED_FIFO when permitted, but never while in Python."""
    permitted = _fifo_permitted()
    wd = FifoWatchdog(fifo, 0.05)
    seen: list[tuple[int, bool]] = []
    done = threading.Event()

    def cb(batch):
        seen.append((os.sched_getscheduler(0), wd.realtime))
        done.set()

    t = threading.Thread(target=wd.run, args=(cb, True))
    t.start()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert wd.register(child.pid, "rt", time.time() + 0.05, 9) == ADMIT_OK
        assert child.wait(10) == -9
        assert done.wait(10)
    finally:
        child.stdin.close()
        wd.stop()
        t.join(5)
        wd.close()
    policy, realtime = seen[0]
    assert realtime is permitted
    assert policy == os.SCHED_OTHER  # the callback (Python) never runs at real-time priority


def _thread_policy(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[38])  # field 41: policy


def _wait_policy(tid: int, policy: int, limit: float = 5.0) -> bool:
    deadline = time.monotonic() + limit
    while _thread_policy(tid) != policy:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)  # bounded poll of a kernel state that has no change notification
    return True


def test_realtime_only_near_a_deadline(fifo):
    if not _fifo_permitted():
        pytest.skip("!!! SCHED_FIFO not permitted here: the realtime window was not tested")
    wd = FifoWatchdog(fifo, 0.05)
    t = threading.Thread(target=wd.run, args=(lambda batch: None, True))
    t.start()
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        assert wd.register(child.pid, "far", time.time() + 30, 9) == ADMIT_OK
        assert _wait_policy(t.native_id, os.SCHED_OTHER)  # 30 s away: normal priority
        assert wd.register(child.pid, "near", time.time() + 0.8, 9) == ADMIT_OK
        assert _wait_policy(t.native_id, os.SCHED_FIFO)  # within the window before it
        assert child.wait(10) == -9
        assert _wait_policy(t.native_id, os.SCHED_OTHER)  # nothing pending: back to normal
    finally:
        child.stdin.close()
        wd.stop()
        t.join(5)
        wd.close()
