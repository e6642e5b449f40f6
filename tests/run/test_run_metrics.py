"""GET /metrics of a real fastrun job, parsed with prometheus_client's own parser."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from run_testlib import base_env, free_port, launcher_cmd

parser = pytest.importorskip(
    "prometheus_client.parser",
    reason="!!! prometheus_client missing (pip install '.[metrics]'): /metrics untested",
)

WORKER = Path(__file__).resolve().parent / "metrics_worker.py"


def scrape(port: int) -> tuple[str, dict[tuple[str, tuple], float]]:
    """Returns the content type and {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        ctype, text = r.headers["Content-Type"], r.read().decode()
    samples = {}
    for family in parser.text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return ctype, samples


def test_fastrun_job_exports_restarts_states_rendezvous_and_watchdog_kills(tmp_path):
    port = free_port()
    env = base_env(
        TORCHELASTIC_HEALTH_CHECK_PORT=str(port),
        FASTELASTIC_HEALTH_CHECK_ADDR="127.0.0.1",
        TORCHELASTIC_ENABLE_FILE_TIMER="1",
    )
    proc = subprocess.Popen(
        [*launcher_cmd("fastrun"), "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
         "--monitor-interval", "0.1", str(WORKER), str(tmp_path)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    role = (("role", "default"),)
    want = {
        ("torchelastic_workers_watchdog_kills_total", role): 1.0,
        ("torchelastic_restarts_total", ()): 1.0,
        ("torchelastic_workers_remaining_restarts", role): 0.0,
        ("torchelastic_workers_state", (("role", "default"), ("state", "healthy"))): 1.0,
        ("torchelastic_workers_state", (("role", "default"), ("state", "failed"))): 0.0,
        ("fastelastic_agent_healthy", ()): 1.0,
        ("fastelastic_agent_restart_count", ()): 1.0,
        ("fastelastic_agent_state", (("state", "HEALTHY"),)): 1.0,
    }
    try:
        deadline = time.monotonic() + 60
        samples: dict = {}
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            ready = all((tmp_path / f"ready{i}").exists() for i in range(2))
            try:
                ctype, samples = scrape(port)
            except (urllib.error.URLError, ConnectionError):
                samples = {}
            if ready and all(samples.get(k) == v for k, v in want.items()):
                break
            assert time.monotonic() < deadline, (
                f"ready={ready}; missing or wrong: "
                f"{ {k: samples.get(k) for k, v in want.items() if samples.get(k) != v} }"
            )
            time.sleep(0.05)
        assert ctype.startswith("text/plain") and "version=" in ctype
        rdzv = (("function", "SimpleElasticAgent._rendezvous"),)
        assert samples[("torchelastic_duration_seconds_count", rdzv)] == 2.0  # first + restart
        assert 0 < samples[("torchelastic_duration_seconds_sum", rdzv)] < 60
        inf = (("function", "SimpleElasticAgent._rendezvous"), ("le", "+Inf"))
        assert samples[("torchelastic_duration_seconds_bucket", inf)] == 2.0
        ok = (("function", "SimpleElasticAgent._rendezvous"), ("result", "success"))
        assert samples[("torchelastic_calls_total", ok)] == 2.0
        failed = (("role", "default"), ("state", "failed"))
        assert samples[("torchelastic_workers_state_observations_total", failed)] >= 1.0
        workers = {k[1]: v for k, v in samples.items() if k[0] == "fastelastic_agent_workers"}
        assert sum(workers.values()) == 2.0, workers
        assert not any("EXITED" in str(k) for k in workers), workers
        assert samples[("process_cpu_seconds_total", ())] > 0
    finally:
        (tmp_path / "done").touch()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
    assert proc.returncode == 0, err[-3000:]
