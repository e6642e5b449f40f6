"""Jobs started by tests, ended with their whole process tree whatever ends the test.

:func:`start_job` starts a command (a launcher, usually) in its own session and registers it;
the autouse fixture of ``tests/conftest.py`` calls :func:`end_started_jobs` after every test,
so a job still running when its test returns, fails or times out (pytest-timeout raises in the
test, and the teardown runs) is stopped with everything it started: the launcher, its zygote,
guardian and workers, each worker's own process group. Started from the main thread, the job
also gets SIGKILL as its parent-death signal, so it dies with pytest itself (the timeout's
``thread`` method ends pytest with ``os._exit``); its agent's guardian and zygote then end the
workers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

_started: list[subprocess.Popen] = []
_lock = threading.Lock()

# exec's the command with SIGKILL as the parent-death signal (kept across execve)
_PDEATHSIG = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(1, 9, 0, 0, 0); "
              "os.getppid() == int(sys.argv[1]) or os._exit(137); "
              "os.execvp(sys.argv[2], sys.argv[2:])")


def start_job(cmd: list[str], **popen: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **popen)`` in a new session, ended by the next
    :func:`end_started_jobs` if it is still running then."""
    argv = list(cmd)
    if threading.current_thread() is threading.main_thread():
        # the signal follows the thread that forked: only the main thread lives as long as we do
        argv = [sys.executable, "-I", "-S", "-c", _PDEATHSIG, str(os.getpid()), *argv]
    proc = subprocess.Popen(argv, start_new_session=True, **popen)
    with _lock:
        _started.append(proc)
    return proc


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def _tree(pid: int) -> list[int]:
    kids, out, todo = _children(), [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def end_job(proc: subprocess.Popen, timeout: float = 30) -> None:
    """SIGKILLs ``proc`` and every process it started (each one's process group too), then
    reaps ``proc``. The tree is stopped first (SIGSTOP), so nothing forks while it is read."""
    if proc.poll() is None:
        pids: list[int] = []
        for _ in range(5):  # bounded: a stopped tree cannot grow
            found = _tree(proc.pid)
            if set(found) <= set(pids):
                break
            for pid in found:
                try:
                    os.kill(pid, signal.SIGSTOP)
                except OSError:
                    pass
            pids = list(dict.fromkeys(pids + found))
        mine = os.getpgid(0)
        groups = set()
        for pid in pids:
            try:
                groups.add(os.getpgid(pid))
            except OSError:
                pass
        for pgid in groups - {mine}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:
        proc.communicate(timeout=timeout)  # reaps it and closes its pipes
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def end_started_jobs() -> list[str]:
    """Ends every job :func:`start_job` started that still runs; returns their commands."""
    with _lock:
        procs = list(_started)
        _started.clear()
    ended = []
    for proc in procs:
        if proc.poll() is None:
            ended.append(" ".join(map(str, proc.args))[-300:])
            end_job(proc)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return ended


def live_tree(proc: subprocess.Popen) -> list[int]:
    """Pids of ``proc``'s process tree that are alive (not zombies), for assertions."""
    alive = []
    for pid in _tree(proc.pid):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state not in ("Z", "X"):
            alive.append(pid)
    return alive


def wait_until(pred: Any, timeout: float, period: float = 0.05) -> bool:
    """Polls ``pred()`` until it is true or ``timeout`` passes (bounded polling for tests)."""
    deadline = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(period)
