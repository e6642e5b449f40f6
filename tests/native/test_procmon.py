"""Tests of the native pidfd monitor (fastelastic._native.procmon.PidfdMonitor)."""

from __future__ import annotations

import gc
import os
import select
import signal
import subprocess
import threading
import time
import warnings

import pytest

from fastelastic._native.procmon import PidfdMonitor, debug_counters

pytestmark = pytest.mark.timeout(30)


def _gated_child(exit_code: int = 0) -> tuple[subprocess.Popen, int]:
    """A child that exits with ``exit_code`` when we write to the returned fd."""
    r, w = os.pipe()
    proc = subprocess.Popen(["sh", "-c", f"read x; exit {exit_code}"], stdin=r)
    os.close(r)
    return proc, w


def _fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_exit_is_seen_immediately():
    proc, gate = _gated_child(5)
    with PidfdMonitor() as mon:
        mon.add(proc.pid)
        assert mon.wait(0) == []
        got: list = []
        waiter = threading.Thread(target=lambda: got.append((mon.wait(10), time.monotonic())))
        waiter.start()
        t0 = time.monotonic()
        os.write(gate, b"go\n")
        waiter.join(10)
        os.close(gate)
        exits, t1 = got[0]
        assert exits == [(proc.pid, 5)]
        # bounded: far below the 10 s timeout; sh needs a moment to read and exit
        assert t1 - t0 < 1.0
        assert len(mon) == 0 and proc.pid not in mon
    # reaped by the monitor (reap=True is the default)
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    proc.returncode = 5


def test_signal_status_and_send_signal():
    proc = subprocess.Popen(["sleep", "60"])
    with PidfdMonitor() as mon:
        mon.add(proc.pid)
        mon.send_signal(proc.pid, signal.SIGKILL)
        assert mon.wait(10) == [(proc.pid, -signal.SIGKILL)]
    proc.returncode = -9


def test_no_reap_leaves_the_zombie_to_its_owner():
    proc, gate = _gated_child(3)
    with PidfdMonitor() as mon:
        mon.add(proc.pid, reap=False)
        os.write(gate, b"x\n")
        os.close(gate)
        assert mon.wait(10) == [(proc.pid, 3)]
    assert proc.wait(5) == 3  # the zombie was still there for Popen to reap


def test_non_child_reports_none_status():
    # the grandchild is not our child: its exit is seen, its status belongs to its parent
    r, w = os.pipe()
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & echo $!; wait"], stdout=w)
    os.close(w)
    line = b""
    while not line.endswith(b"\n"):
        assert select.select([r], [], [], 10)[0], "no grandchild pid"
        line += os.read(r, 64)
    os.close(r)
    grandchild = int(line)
    with PidfdMonitor() as mon:
        mon.add(grandchild)
        os.kill(grandchild, signal.SIGKILL)
        assert mon.wait(10) == [(grandchild, None)]
    assert parent.wait(10) == 0


def test_several_exits_and_timeout():
    procs = [subprocess.Popen(["true"]) for _ in range(5)]
    with PidfdMonitor() as mon:
        for p in procs:
            mon.add(p.pid)
        seen = {}
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            seen.update(mon.wait(deadline - time.monotonic()))
        assert seen == {p.pid: 0 for p in procs}
        t0 = time.monotonic()
        assert mon.wait(0.05) == []
        assert time.monotonic() - t0 >= 0.045
    for p in procs:
        p.returncode = 0


def test_wakeup_from_another_thread():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        with PidfdMonitor() as mon:
            mon.add(proc.pid)
            started = threading.Event()
            out: list = []

            def waiter():
                started.set()
                out.append(mon.wait(20))

            t = threading.Thread(target=waiter)
            t.start()
            assert started.wait(5)
            t0 = time.monotonic()
            mon.wakeup()
            t.join(5)
            assert not t.is_alive() and out == [[]]
            assert time.monotonic() - t0 < 5
            # fileno() is pollable: readable after a wake-up, drained by wait()
            mon.wakeup()
            assert select.select([mon.fileno()], [], [], 5)[0]
            assert mon.wait(0) == []
            assert not select.select([mon.fileno()], [], [], 0)[0]
            assert proc.pid in mon.pids()
    finally:
        proc.kill()
        proc.wait()


def test_eintr_retries_and_python_handler_exceptions_propagate():
    proc = subprocess.Popen(["sleep", "60"])
    fired = []
    old = signal.signal(signal.SIGALRM, lambda s, f: fired.append(s))
    try:
        with PidfdMonitor() as mon:
            mon.add(proc.pid)
            signal.setitimer(signal.ITIMER_REAL, 0.02, 0.02)
            t0 = time.monotonic()
            assert mon.wait(0.3) == []  # interrupted many times, still waits the full time
            signal.setitimer(signal.ITIMER_REAL, 0)
            assert time.monotonic() - t0 >= 0.29
            assert len(fired) >= 3

            class Boom(Exception):
                pass

            def raiser(s, f):
                raise Boom()

            signal.signal(signal.SIGALRM, raiser)
            signal.setitimer(signal.ITIMER_REAL, 0.05)
            with pytest.raises(Boom):
                mon.wait(10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        proc.kill()
        proc.wait()


def test_bad_input_and_closed_errors():
    proc = subprocess.Popen(["true"])
    proc.wait()
    mon = PidfdMonitor()
    with pytest.raises(ProcessLookupError):
        mon.add(proc.pid)  # already reaped
    with pytest.raises(ValueError):
        mon.add(0)
    live = subprocess.Popen(["sleep", "60"])
    try:
        mon.add(live.pid)
        with pytest.raises(ValueError):
            mon.add(live.pid)
        with pytest.raises(KeyError):
            mon.send_signal(12345678, signal.SIGTERM)
        mon.remove(live.pid)
        mon.remove(live.pid)  # no-op
        assert len(mon) == 0
    finally:
        live.kill()
        live.wait()
    mon.close()
    mon.close()
    assert mon.closed
    with pytest.raises(ValueError):
        mon.wait(0)
    with pytest.raises(ValueError):
        mon.fileno()
    mon.wakeup()  # harmless after close


def test_no_fd_leak_and_dealloc_warning():
    counters = debug_counters()  # None in release builds
    gc.collect()  # objects of earlier tests must not close their fds mid-test
    before = _fds()
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    mon = PidfdMonitor()
    for p in procs:
        mon.add(p.pid)
    assert len(_fds() - before) >= 5  # epoll + eventfd + 3 pidfds
    mon.close()
    for p in procs:
        p.kill()
        p.wait()
    assert _fds() - before == set()
    leaked = PidfdMonitor()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        del leaked
        gc.collect()
    assert any(issubclass(x.category, ResourceWarning) for x in w)
    assert _fds() - before == set()
    if counters is not None:  # FASTELASTIC_DEBUG=1 build: every fd opened here was closed
        opened, closed = debug_counters()
        assert opened - counters[0] == closed - counters[1] == 7  # 2 monitors x 2 + 3 pidfds


def test_forked_child_does_not_close_parent_fds():
    proc, gate = _gated_child(0)
    with PidfdMonitor() as mon:
        mon.add(proc.pid)
        pid = os.fork()
        if pid == 0:
            # the epoll instance is shared with the parent: a DEL from here would blind it
            mon.close()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        os.write(gate, b"x\n")
        os.close(gate)
        assert mon.wait(10) == [(proc.pid, 0)]
    proc.returncode = 0


def test_close_from_another_thread_releases_a_blocked_wait():
    proc = subprocess.Popen(["sleep", "60"])
    try:
        mon = PidfdMonitor()
        mon.add(proc.pid)
        started = threading.Event()
        out: list = []

        def waiter():
            started.set()
            try:
                out.append(mon.wait())  # no timeout: only close() can end it
            except (OSError, ValueError) as e:
                out.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        assert started.wait(5)
        mon.close()
        t.join(5)
        assert not t.is_alive() and len(out) == 1
    finally:
        proc.kill()
        proc.wait()
