"""Preemption is a leave: a signalled agent tells the rendezvous before it stops its workers,
and never closes the rendezvous for the other nodes (real agent process, real signals)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import types

import pytest

from fastelastic.agent.server import SimpleElasticAgent, WorkerSpec
from fastelastic.agent.server._runloop import AgentState

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(cond, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while not cond():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def _run(tmp_path, sig: signal.Signals, *extra: str) -> tuple[int, str, list[str]]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.path.join(REPO, "src")
    p = subprocess.Popen([sys.executable, os.path.join(HERE, "leave_main.py"), str(tmp_path),
                          str(_free_port()), *extra], env=env, cwd=HERE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        started = _wait(lambda: p.poll() is not None
                        or all((tmp_path / f"pid{i}").exists() for i in range(2)), 60)
        assert started and p.poll() is None, f"workers never started: {p.communicate()}"
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
    log = tmp_path / "rdzv.log"
    return p.returncode, err, log.read_text().splitlines() if log.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_leaves_before_the_workers_stop_and_keeps_the_rendezvous_open(tmp_path, sig):
    rc, err, lines = _run(tmp_path, sig)
    assert rc != 0, err[-3000:]
    # leave() ran once, while no worker had been signalled yet; shutdown() (which closes the
    # rendezvous for every node) never ran
    assert lines == ["leave signalled=-"], (lines, err[-3000:])
    for i in range(2):  # then the workers got the signal
        assert (tmp_path / f"sig{i}").read_text() == sig.name, err[-3000:]
    assert "leaves" in err, err[-3000:]


@pytest.mark.timeout(120)
def test_a_handler_without_leave_is_stopped_as_before(tmp_path):
    rc, err, lines = _run(tmp_path, signal.SIGTERM, "--no-leave")
    assert rc != 0, err[-3000:]
    assert lines == [], (lines, err[-3000:])
    for i in range(2):
        assert (tmp_path / f"sig{i}").read_text() == "SIGTERM", err[-3000:]


class _Agent(SimpleElasticAgent):
    def _start_workers(self, worker_group):  # pragma: no cover - never started here
        raise AssertionError

    def _stop_workers(self, worker_group):  # pragma: no cover
        raise AssertionError

    def _monitor_workers(self, worker_group):  # pragma: no cover
        raise AssertionError

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        pass


@pytest.mark.parametrize("path,leaves", [
    ([AgentState.RENDEZVOUS], True),
    ([AgentState.RENDEZVOUS, AgentState.RUNNING], True),
    ([AgentState.RENDEZVOUS, AgentState.RUNNING, AgentState.STOPPING], True),
    # finished: its peers were told it is done; a leave would restart them for nothing
    ([AgentState.RENDEZVOUS, AgentState.RUNNING, AgentState.EXIT_BARRIER], False),
    ([AgentState.RENDEZVOUS, AgentState.RUNNING, AgentState.FAILED], False),
    ([], False),  # never joined
])
def test_only_a_member_leaves(path, leaves):
    calls = []
    handler = types.SimpleNamespace(leave=lambda: calls.append("leave"))
    agent = _Agent(WorkerSpec(role="r", local_world_size=1, rdzv_handler=handler,
                              entrypoint="x"))
    for state in path:
        agent._set_state(state)
    agent._leave()
    assert calls == (["leave"] if leaves else [])
    assert (agent._agent_state is AgentState.LEAVING) == leaves
