"""Helpers for the timer tests: real worker subprocesses, pidfd death waits, an event recorder."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import pytest

NO_SUCH_PID = 2**30  # above the kernel's PID_MAX_LIMIT (2**22)
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timer_worker.py")


class EventLog:
    """A ``log_event`` callback that records ``(name, request)`` and lets tests wait on them."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self._cv = threading.Condition()

    def __call__(self, name: str, request: Any) -> None:
        with self._cv:
            self.events.append((name, request))
            self._cv.notify_all()

    def wait(
        self, name: str, pid: int | None = None, scope: str | None = None, timeout: float = 30.0
    ) -> Any:
        def match() -> Any:
            for n, r in self.events:
                if n != name:
                    continue
                if pid is not None and (r is None or r.worker_pid != pid):
                    continue
                if scope is not None and (r is None or r.scope_id != scope):
                    continue
                return (n, r)
            return None

        with self._cv:
            found = self._cv.wait_for(match, timeout)
        assert found, (
            f"no {name!r} event (pid={pid}, scope={scope}) within {timeout}s: {self.events}"
        )
        return found[1]

    def wait_count(self, name: str, count: int, timeout: float = 30.0) -> None:
        with self._cv:
            ok = self._cv.wait_for(lambda: self.count(name) >= count, timeout)
        assert ok, f"expected {count} {name!r} events within {timeout}s: {self.events}"

    def count(self, name: str) -> int:
        return sum(1 for n, _ in self.events if n == name)

    def of(self, name: str) -> list[Any]:
        return [r for n, r in self.events if n == name]


def fifo_barrier(path: str, events: EventLog, timeout: float = 30.0) -> None:
    """Returns once the server has processed every line written to ``path`` before this call.

    The FIFO keeps order, so a sentinel request naming a pid no process can have (above any
    ``pid_max``; signal 0 anyway) is refused only after all earlier lines were read.
    """
    scope = f"barrier-{time.monotonic_ns()}"
    line = json.dumps(
        {
            "version": 1,
            "pid": NO_SUCH_PID,
            "scope_id": scope,
            "expiration_time": time.time() + 3600,
            "signal": 0,
        }
    )
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)
    events.wait("request refused", scope=scope, timeout=timeout)


class Worker:
    """A timer_worker.py subprocess; it runs its ops, says ready and waits for stdin to close."""

    def __init__(
        self,
        path: str,
        ops: list[list[Any]],
        kind: str = "ours",
        timeout: float = 60.0,
        stderr: Any = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, WORKER, path, kind, json.dumps(ops)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        self.pid = self.proc.pid
        self.pidfd = os.pidfd_open(self.pid)
        line = self._readline(timeout)
        assert line.startswith("ready "), f"worker said {line!r}"
        self.deadlines: dict[str, float] = json.loads(line[6:])["deadlines"]

    def _readline(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        assert ready, f"worker {self.pid} said nothing within {timeout}s"
        return self.proc.stdout.readline()

    def wait_death(self, timeout: float = 30.0) -> float:
        """Waits for the process to die; returns the monotonic time its death was seen."""
        ready, _, _ = select.select([self.pidfd], [], [], timeout)
        assert ready, f"worker {self.pid} still alive after {timeout}s"
        t = time.monotonic()
        self.proc.wait(5)
        return t

    def alive(self) -> bool:
        return not select.select([self.pidfd], [], [], 0)[0]

    def signals_seen(self) -> list[str]:
        """Lines the worker printed so far (non-blocking)."""
        out = []
        while select.select([self.proc.stdout], [], [], 0)[0]:
            line = self.proc.stdout.readline()
            if not line:
                break
            out.append(line.strip())
        return out

    def close(self) -> None:
        if self.pidfd < 0:
            return
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc.stdout.close()
        self.proc.stdin.close()
        os.close(self.pidfd)
        self.pidfd = -1


@pytest.fixture
def fifo_path():
    with tempfile.TemporaryDirectory(prefix="fe-timer-test-") as d:
        os.chmod(d, 0o700)
        yield os.path.join(d, "watchdog")


@pytest.fixture
def workers():
    started: list[Worker] = []

    def start(path: str, ops: list[list[Any]], kind: str = "ours", stderr: Any = None) -> Worker:
        w = Worker(path, ops, kind, stderr=stderr)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


def require_torch() -> Any:
    try:
        import torch.distributed.elastic.timer as torch_timer
    except ImportError as e:
        pytest.skip(
            f"!!! torch 2.13 is not importable ({e}); the torch wire-compatibility test did not run"
        )
    return torch_timer
