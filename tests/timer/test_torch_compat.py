"""Wire compatibility with torch 2.13: torch's client with our server, ours with torch's server."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest
from timer_testlib import EventLog, require_torch

from fastelastic._native.watchdog import parse_request
from fastelastic.timer import FileTimerRequest, FileTimerServer

KILL = int(signal.SIGKILL)
TORCH_SERVER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_timer_server.py")

CASES = [
    (1234, "train.py#42", 1732870000.123456, KILL),
    (99, 'scope with "quotes", \\ and é / 日本', 1.5e9, 15),
    (4194304, "", -1, 0),
    (7, "x" * 3000, 0.0, 9),
]


@pytest.mark.parametrize("pid,scope,expiration,sig", CASES)
def test_request_lines_are_byte_identical_to_torch(pid, scope, expiration, sig):
    torch_timer = require_torch()
    theirs = torch_timer.FileTimerRequest(pid, scope, expiration, sig).to_json()
    ours = FileTimerRequest(pid, scope, expiration, sig).to_json()
    assert ours == theirs
    assert parse_request(theirs.encode()) == (pid, scope, float(expiration), sig)


@pytest.mark.timeout(120)
def test_torch_client_with_our_server(fifo_path, workers):
    require_torch()
    events = EventLog()
    srv = FileTimerServer(fifo_path, "r", max_interval=0.1, log_event=events)
    srv.start()
    try:
        ops = [["acquire", "gone", 0.2, KILL], ["release", "gone"], ["acquire", "late", 0.5, 0]]
        survivor = workers(fifo_path, ops, kind="torch")
        events.wait("timer expired", pid=survivor.pid, scope="late", timeout=30)
        assert survivor.alive()
        victim = workers(fifo_path, [["acquire", "hang", 0.3, KILL]], kind="torch")
        died = victim.wait_death()
        assert victim.proc.returncode == -signal.SIGKILL
        assert died >= victim.deadlines["hang"] - 0.005
        assert events.wait("kill worker process", pid=victim.pid).scope_id == "hang"
        assert events.count("malformed request") == 0
    finally:
        srv.stop()


class _TorchServer:
    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, TORCH_SERVER, path, "0.1"], stdout=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        while self.readline(90) != "ready":
            pass

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.strip())

    def readline(self, timeout: float) -> str:
        try:
            line = self._queue.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"torch's server said nothing in {timeout}s") from None
        self.lines.append(line)
        return line

    def wait_event(self, name: str, scope: str, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        prefix = f"event {name} "
        while True:
            line = self.readline(max(deadline - time.monotonic(), 0.0))
            if line.startswith(prefix):
                body = json.loads(line[len(prefix) :])
                if body and body["scope_id"] == scope:
                    return body

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc.stdout.close()


@pytest.mark.timeout(120)
def test_our_client_with_torch_server(fifo_path, workers):
    require_torch()
    server = _TorchServer(fifo_path)
    try:
        ops = [["acquire", "gone", 0.2, KILL], ["release", "gone"], ["acquire", "late", 0.5, 0]]
        survivor = workers(fifo_path, ops)
        body = server.wait_event("timer expired", "late")
        assert body["pid"] == survivor.pid and body["signal"] == 0
        assert survivor.alive()
        victim = workers(fifo_path, [["acquire", "hang", 0.3, KILL]])
        victim.wait_death(timeout=20)
        assert victim.proc.returncode == -signal.SIGKILL
        killed = server.wait_event("kill worker process", "hang")
        assert killed["pid"] == victim.pid
        # torch 2.13's server then SIGKILLs its own process; ours does not (see the notes)
        assert server.proc.wait(20) == -signal.SIGKILL
        assert not any("gone" in line for line in server.lines)
    finally:
        server.close()
