"""LocalElasticAgent with TORCHELASTIC_ENABLE_FILE_TIMER=1: a hung worker is killed at its
deadline by our watchdog and the agent restarts the group, which then succeeds."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(json.loads(record.getMessage()))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_agent_restarts_group_after_watchdog_kill(tmp_path, monkeypatch):
    try:
        from fastelastic import events
        from fastelastic.agent.server import WorkerSpec, WorkerState
        from fastelastic.agent.server.local_elastic_agent import LocalElasticAgent
        from fastelastic.multiprocessing import DefaultLogsSpecs
        from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler
    except ImportError as e:
        pytest.skip(
            f"!!! LocalElasticAgent is not importable ({e}); agent restart test did not run"
        )
    for name in (
        "TORCH_ELASTIC_WORKER_IDENTICAL",
        "FASTELASTIC_WORKER_IDENTICAL",
        "TORCHELASTIC_HEALTH_CHECK_PORT",
        "TORCHELASTIC_TIMER_FILE",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    marker = tmp_path / "first-attempt-pid"
    sink = _Collect()
    events.register_handler("timer-test-watchdog", sink, replace=True)
    try:
        rdzv = get_rendezvous_handler(
            RendezvousParameters(
                backend="static",
                endpoint=f"127.0.0.1:{_free_port()}",
                run_id="timer-agent-test",
                min_nodes=1,
                max_nodes=1,
                rank=0,
                timeout=60,
            )
        )
        spec = WorkerSpec(
            role="trainer",
            local_world_size=1,
            rdzv_handler=rdzv,
            entrypoint=sys.executable,
            args=(os.path.join(HERE, "timer_agent_worker.py"), str(marker)),
            max_restarts=1,
            event_log_handler="timer-test-watchdog",
        )
        agent = LocalElasticAgent(
            spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), exit_barrier_timeout=10
        )
        start = time.monotonic()
        result = agent.run()
        elapsed = time.monotonic() - start
    finally:
        events.unregister_handler("timer-test-watchdog")
    assert result.state == WorkerState.SUCCEEDED, result
    assert agent.restart_count == 1
    assert elapsed < 30, f"took {elapsed:.1f}s"
    hung_pid = marker.read_text()
    kills = [
        json.loads(r["metadata"]["metadata"])
        for r in sink.records
        if r["name"] == "kill worker process"
    ]
    assert [(k["worker_pid"], k["scope_id"], k["signal"]) for k in kills] == [
        (hung_pid, "hung-collective", str(int(signal.SIGKILL)))
    ]
