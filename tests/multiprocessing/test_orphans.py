"""A SIGKILLed agent leaves no worker and no grandchild behind (real processes, real SIGKILL)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
from mphelpers import is_alive, read_line, wait_gone

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["binary", "fork-thread", "spawn"])
def test_sigkilled_agent_leaves_nothing_behind(mode, tmp_path):
    with open(tmp_path / "agent.err", "wb") as err:
        agent = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "orphan_agent.py"), str(tmp_path), mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            cwd=HERE,
        )
    try:
        out = agent.stdout.fileno()
        pids: list[int] = []
        lines: list[str] = []
        deadline = time.monotonic() + 30
        while len(pids) < 4:
            try:
                line = read_line(out, max(0.1, deadline - time.monotonic())).decode()
            except (TimeoutError, EOFError) as e:
                raise AssertionError(f"{lines} {(tmp_path / 'agent.err').read_text()}") from e
            lines.append(line)
            for worker, grandchild in re.findall(r"\[orphan\d\]:(\d+) (\d+)", line):
                pids += [int(worker), int(grandchild)]
        assert all(is_alive(p) for p in pids), pids
        agent.send_signal(signal.SIGKILL)
        assert agent.wait(10) == -signal.SIGKILL
        survivors = [p for p in pids if not wait_gone(p, 10)]
        assert survivors == []
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        agent.stdin.close()
        agent.stdout.close()
