"""The Prometheus handler and GET /metrics of the health server, over real HTTP."""

from __future__ import annotations

import http.client
import sys
import time

import pytest

from fastelastic import metrics
from fastelastic.agent.server.health_check_server import HealthCheckServer
from fastelastic.metrics import MetricData, MetricHandler
from fastelastic.metrics.prometheus import PrometheusMetricHandler

parser = pytest.importorskip(
    "prometheus_client.parser",
    reason="!!! prometheus_client missing (pip install '.[metrics]'): /metrics untested",
)


def fetch(port: int, path: str = "/metrics", accept: str | None = None) -> tuple[int, str, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers={"Accept": accept} if accept else {})
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


def parse(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def point(name: str, value, group: str = "torchelastic") -> MetricData:
    return MetricData(time.time(), group, name, value)


@pytest.fixture
def server():
    handler = PrometheusMetricHandler(max_series=40)
    status = {"state": "HEALTHY", "restart_count": 2, "max_restarts": 3,
              "workers": [{"state": "SLEEPING"}, {"state": "SLEEPING"}, {"state": "EXITED"}]}
    srv = HealthCheckServer(lambda: int(time.time()), 0, 30, host="127.0.0.1",
                            status_callback=lambda: dict(status), metrics_handler=handler)
    srv.start()
    yield srv, handler, status
    srv.stop()


def test_torch_metric_names_become_labelled_families(server):
    srv, h, status = server
    for name, value in [
        ("workers.trainer.remaining_restarts", 3),
        ("workers.trainer.remaining_restarts", 2),  # a gauge: the last value
        ("workers.trainer.healthy", 1),
        ("workers.trainer.healthy", 1),
        ("workers.trainer.unhealthy", 1),  # the state gauge moves; observations add up
        ("workers.trainer.flakiness", 40),
        ("workers.trainer.run_total", 1),
        ("workers.trainer.run_success_with_retries", 1),
        ("workers.trainer.run_failed_no_retries", 0),
        ("workers.trainer.watchdog_kills", 1),
        ("workers.trainer.watchdog_kills", 1),
        ("SimpleElasticAgent._rendezvous.duration.ms", 3),
        ("SimpleElasticAgent._rendezvous.duration.ms", 1500),
        ("SimpleElasticAgent._rendezvous.success", 1),
        ("SimpleElasticAgent._restart_workers.success", 1),
        ("SimpleElasticAgent._restart_workers.failure", 1),
        ("custom.thing", 7),
    ]:
        h.emit(point(name, value))
    h.emit(point("custom.thing", "not a number"))
    code, ctype, text = fetch(srv.port)
    assert code == 200 and ctype.startswith("text/plain; version=0.0.4"), (code, ctype)
    s = parse(text)
    r = (("role", "trainer"),)
    assert s[("torchelastic_workers_remaining_restarts", r)] == 2
    assert s[("torchelastic_workers_state", (*r, ("state", "unhealthy")))] == 1
    assert s[("torchelastic_workers_state", (*r, ("state", "healthy")))] == 0
    assert s[("torchelastic_workers_state_observations_total", (*r, ("state", "healthy")))] == 2
    assert s[("torchelastic_workers_flakiness", r)] == 40
    assert s[("torchelastic_workers_run_total", r)] == 1
    assert s[("torchelastic_workers_run_success_with_retries_total", r)] == 1
    assert s[("torchelastic_workers_run_failed_no_retries_total", r)] == 0  # present, zero
    assert s[("torchelastic_workers_watchdog_kills_total", r)] == 2
    f = (("function", "SimpleElasticAgent._rendezvous"),)
    assert s[("torchelastic_duration_seconds_count", f)] == 2
    assert s[("torchelastic_duration_seconds_sum", f)] == pytest.approx(1.503)
    assert s[("torchelastic_duration_seconds_bucket", (*f, ("le", "0.005")))] == 1
    assert s[("torchelastic_duration_seconds_bucket", (*f, ("le", "1.0")))] == 1
    assert s[("torchelastic_duration_seconds_bucket", (*f, ("le", "2.5")))] == 2
    assert s[("torchelastic_calls_total", (*f, ("result", "success")))] == 1
    assert s[("torchelastic_restarts_total", ())] == 2
    assert s[("torchelastic_metric", (("name", "custom.thing"),))] == 7
    assert s[("fastelastic_metrics_dropped_total", ())] == 1  # the non-numeric point
    # the live status, read at scrape time
    assert s[("fastelastic_agent_healthy", ())] == 1
    assert s[("fastelastic_agent_restart_count", ())] == 2
    assert s[("fastelastic_agent_max_restarts", ())] == 3
    assert s[("fastelastic_agent_state", (("state", "HEALTHY"),))] == 1
    assert s[("fastelastic_agent_state", (("state", "FAILED"),))] == 0
    assert s[("fastelastic_agent_workers", (("state", "SLEEPING"),))] == 2
    assert s[("fastelastic_agent_workers", (("state", "EXITED"),))] == 1
    status["state"] = "FAILED"
    s = parse(fetch(srv.port)[2])
    assert s[("fastelastic_agent_healthy", ())] == 0
    assert s[("fastelastic_agent_state", (("state", "FAILED"),))] == 1


def test_openmetrics_when_the_scraper_asks_for_it(server):
    srv, h, _ = server
    h.emit(point("workers.trainer.watchdog_kills", 1))
    accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"
    code, ctype, text = fetch(srv.port, accept=accept)
    assert code == 200 and ctype.startswith("application/openmetrics-text"), ctype
    assert text.endswith("# EOF\n")
    from prometheus_client.openmetrics import parser as om

    fams = {f.name: f for f in om.text_string_to_metric_families(text)}
    kills = fams["torchelastic_workers_watchdog_kills"]
    assert kills.type == "counter"
    assert [(s.labels, s.value) for s in kills.samples if s.name.endswith("_total")] == [
        ({"role": "trainer"}, 1.0)
    ]


def test_series_are_bounded_and_overflow_is_counted(server):
    srv, h, _ = server
    for i in range(100):
        h.emit(point(f"other.m{i}", i))
    s = parse(fetch(srv.port)[2])
    kept = [k for k in s if k[0] == "torchelastic_metric"]
    assert len(kept) == 40
    assert s[("fastelastic_metrics_dropped_total", ())] == 60
    h.emit(point("other.m0", 99))  # an existing series still updates
    assert parse(fetch(srv.port)[2])[("torchelastic_metric", (("name", "other.m0"),))] == 99


class _Recorder(MetricHandler):
    def __init__(self) -> None:
        self.names: list[str] = []

    def emit(self, metric_data: MetricData) -> None:
        self.names.append(metric_data.name)


def test_observer_sees_put_metric_and_the_configured_handler_still_does():
    rec, h = _Recorder(), PrometheusMetricHandler()
    metrics.configure(rec, group="prom-test")
    metrics.add_observer(h)
    metrics.add_observer(h)  # idempotent: no double counting
    try:
        metrics.put_metric("workers.r.watchdog_kills", 1, "prom-test")
    finally:
        metrics.remove_observer(h)
    metrics.put_metric("workers.r.watchdog_kills", 1, "prom-test")  # no longer observed
    assert rec.names == ["workers.r.watchdog_kills"] * 2
    from fastelastic.metrics.prometheus import generate_latest

    s = parse(generate_latest(h)[1].decode())
    assert s[("prom_test_workers_watchdog_kills_total", (("role", "r"),))] == 1
    with pytest.raises(TypeError):
        metrics.add_observer(object())  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PrometheusMetricHandler(max_series=0)


def test_without_prometheus_client_metrics_says_how_to_get_it(monkeypatch):
    for name in [m for m in sys.modules if m.startswith("prometheus_client")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed: import fails
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    srv = HealthCheckServer(lambda: int(time.time()), 0, 30, host="127.0.0.1")
    srv.start()
    try:
        code, ctype, text = fetch(srv.port)
        assert code == 501 and ctype.startswith("text/plain")
        assert "prometheus_client is not installed" in text and "fastelastic[metrics]" in text
        assert fetch(srv.port, "/health")[0] == 200  # the probe is unaffected
    finally:
        srv.stop()


def test_hang_check_progress_and_verdicts(server):
    """With --hang-timeout: each rank's steps and seconds since progress, and the verdicts."""
    srv, h, status = server
    status["workers"] = [
        {"state": "SLEEPING", "global_rank": 4, "steps": 12, "since_progress_s": 0.5},
        {"state": "SLEEPING", "global_rank": 5, "steps": 0, "since_progress_s": None},
    ]
    h.emit(point("workers.trainer.hang_verdicts", 1))
    s = parse(fetch(srv.port)[2])
    assert s[("fastelastic_agent_worker_steps", (("global_rank", "4"),))] == 12
    assert s[("fastelastic_agent_worker_steps", (("global_rank", "5"),))] == 0
    assert s[("fastelastic_agent_worker_seconds_since_progress", (("global_rank", "4"),))] == 0.5
    assert ("fastelastic_agent_worker_seconds_since_progress", (("global_rank", "5"),)) not in s
    assert s[("torchelastic_workers_hang_verdicts_total", (("role", "trainer"),))] == 1
    status["workers"] = [{"state": "SLEEPING"}]  # the check off: no such families
    s = parse(fetch(srv.port)[2])
    assert not any(k[0].startswith("fastelastic_agent_worker_") for k in s)
