"""A FileTimerServer hosted apart from the workers' parent (as torch's docs allow).

Constructed directly, ours signals the pid its client names when that process runs as our user,
as torch's does; the agent's server (``allow_same_user=False``) keeps to its own descendants.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
from timer_testlib import NO_SUCH_PID, require_torch

KILL = int(signal.SIGKILL)
SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "timer_server.py")


class ServerProcess:
    """timer_server.py in its own process: the test's workers are its siblings, not children."""

    def __init__(self, path: str, impl: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, SERVER, path, impl],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.events: list[tuple[str, dict | None]] = []
        while (line := self._line(60)) != "ready":
            assert line.startswith("event "), f"timer server said {line!r}"

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put("")  # EOF

    def _line(self, timeout: float) -> str:
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(
                f"timer server said nothing within {timeout}s; events: {self.events}"
            ) from None

    def wait(self, name: str, pid: int, timeout: float = 30.0) -> dict:
        """Waits for event ``name`` about ``pid``; returns its request."""
        deadline = time.monotonic() + timeout
        while True:
            for n, r in self.events:
                if n == name and r is not None and r["pid"] == pid:
                    return r
            left = deadline - time.monotonic()
            assert left > 0, f"no {name!r} event for pid {pid} in {timeout}s: {self.events}"
            line = self._line(left)
            assert line, f"timer server exited; events: {self.events}"
            n, body = json.loads(line.split(" ", 1)[1])
            self.events.append((n, body))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if not self.proc.stdin.closed:
            self.proc.stdin.close()


@pytest.fixture
def servers():
    started: list[ServerProcess] = []

    def start(path: str, impl: str) -> ServerProcess:
        s = ServerProcess(path, impl)
        started.append(s)
        return s

    yield start
    for s in started:
        s.close()


def _not_descendant(pid: int, of: int) -> bool:
    while pid > 1:
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rpartition(")")[2].split()[1])
        if pid == of:
            return False
    return True


@pytest.mark.parametrize(
    "impl,client",
    [
        ("ours", "ours"),
        pytest.param("ours", "torch", marks=pytest.mark.torch),
        pytest.param("torch", "torch", marks=pytest.mark.torch),  # the reference behaviour
    ],
)
def test_direct_server_kills_a_same_user_worker_it_did_not_start(
    fifo_path, workers, servers, impl, client
):
    if "torch" in (impl, client):
        require_torch()
    srv = servers(fifo_path, impl)
    w = workers(fifo_path, [["acquire", "hang", 0.3, KILL]], kind=client)
    assert _not_descendant(w.pid, srv.proc.pid)
    died = w.wait_death()
    assert w.proc.returncode == -signal.SIGKILL
    assert died >= w.deadlines["hang"] - 0.005
    assert srv.wait("kill worker process", w.pid)["scope_id"] == "hang"


def _write_request(path: str, pid: int, scope: str, expiration: float, sig: int) -> None:
    line = json.dumps(
        {"version": 1, "pid": pid, "scope_id": scope, "expiration_time": expiration, "signal": sig}
    )
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def test_agent_server_keeps_to_its_descendants(fifo_path, workers, servers):
    srv = servers(fifo_path, "ours-agent")
    w = workers(fifo_path, [["acquire", "hang", 0.2, KILL]])
    # refused when it arrived, so never armed: the worker outlives its deadline
    assert srv.wait("request refused", w.pid)["scope_id"] == "hang"
    assert w.alive()


@pytest.mark.skipif(os.geteuid() != 0, reason="!!! needs root to start a process as another user")
def test_direct_server_refuses_another_users_process(fifo_path, workers, servers):
    srv = servers(fifo_path, "ours")
    other = subprocess.Popen(["sleep", "300"], user=65534, group=65534, cwd="/")
    pidfd = os.pidfd_open(other.pid)
    try:
        # torch's server would SIGKILL any pid root may signal; ours only its own user's
        _write_request(fifo_path, other.pid, "x", time.time() - 1, KILL)
        assert srv.wait("request refused", other.pid)["scope_id"] == "x"
        # positive control through the same pipe: our user's worker is killed
        mine = workers(fifo_path, [["acquire", "y", 0.1, KILL]])
        mine.wait_death()
        assert srv.wait("kill worker process", mine.pid)["scope_id"] == "y"
        assert not select.select([pidfd], [], [], 0)[0], "the other user's process was killed"
    finally:
        os.close(pidfd)
        other.kill()
        other.wait(10)


def test_gone_pid_is_refused(fifo_path, servers):
    srv = servers(fifo_path, "ours")
    _write_request(fifo_path, NO_SUCH_PID, "g", 0, KILL)
    assert srv.wait("request refused", NO_SUCH_PID)["scope_id"] == "g"
