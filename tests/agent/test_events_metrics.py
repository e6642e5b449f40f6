"""Events and metrics: torch's names and JSON layout, named handlers, metric groups."""

from __future__ import annotations

import json
import logging

import pytest

from fastelastic import events, metrics


class Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


class CollectMetrics(metrics.MetricHandler):
    def __init__(self):
        self.data: list[metrics.MetricData] = []

    def emit(self, metric_data):
        self.data.append(metric_data)


def test_event_json_matches_torch_and_round_trips():
    ev = events.Event("n", events.EventSource.WORKER, 12, {"a": 1, "b": None, "c": "x"})
    assert events.Event.deserialize(ev.serialize()) == ev
    assert events.Event.deserialize(ev) is ev
    torch_events = pytest.importorskip(
        "torch.distributed.elastic.events", reason="torch 2.13 needed to compare the JSON layout"
    )
    theirs = torch_events.Event(
        "n", torch_events.EventSource.WORKER, 12, {"a": 1, "b": None, "c": "x"}
    )
    assert ev.serialize() == theirs.serialize()
    rd = events.RdzvEvent("n", "run", "msg", "host", 7, events.NodeState.RUNNING, rank=3)
    assert events.RdzvEvent.deserialize(rd.serialize()) == rd
    their_rd = torch_events.RdzvEvent(
        "n", "run", "msg", "host", 7, torch_events.NodeState.RUNNING, rank=3
    )
    assert rd.serialize() == their_rd.serialize()


@pytest.mark.parametrize("bad", ["{", "[]", '{"name": "x"}', '{"name": "x", "source": "NOPE"}'])
def test_event_deserialize_rejects_garbage(bad):
    with pytest.raises(ValueError):
        events.Event.deserialize(bad)
    with pytest.raises(TypeError):
        events.Event.deserialize(42)  # type: ignore[arg-type]


def test_named_handler_registration():
    sink = Collect()
    with pytest.raises(KeyError, match="known"):
        events.get_logging_handler("test-sink")
    events.register_handler("test-sink", sink)
    try:
        assert events.get_logging_handler("test-sink") is sink
        events.record(events.Event("one", events.EventSource.AGENT), "test-sink")
        with pytest.raises(ValueError, match="already registered"):
            events.register_handler("test-sink", Collect())
        other = Collect()
        events.register_handler("test-sink", other, replace=True)
        events.record(events.Event("two", events.EventSource.AGENT), "test-sink")
    finally:
        events.unregister_handler("test-sink")
    assert [json.loads(x)["name"] for x in sink.lines] == ["one"]
    assert [json.loads(x)["name"] for x in other.lines] == ["two"]
    with pytest.raises(KeyError):
        events.record(events.Event("three", events.EventSource.AGENT), "test-sink")
    with pytest.raises(ValueError):
        events.unregister_handler("console")
    with pytest.raises(TypeError):
        events.register_handler("x", object())  # type: ignore[arg-type]


def test_rdzv_events_only_when_someone_listens():
    sink = Collect()
    events.construct_and_record_rdzv_event("run", "ignored", events.NodeState.INIT)
    original = events.get_logging_handler("dynamic_rendezvous")
    events.register_handler("dynamic_rendezvous", sink, replace=True)
    try:
        events.construct_and_record_rdzv_event("run", "hello", events.NodeState.RUNNING, rank=2)
    finally:
        events.register_handler("dynamic_rendezvous", original, replace=True)
    assert len(sink.lines) == 1
    got = events.RdzvEvent.deserialize(sink.lines[0])
    assert got.message == "hello" and got.rank == 2 and got.node_state == events.NodeState.RUNNING
    assert got.name.endswith(":test_rdzv_events_only_when_someone_listens")


def test_prof_and_put_metric_names_match_torch():
    sink = CollectMetrics()
    metrics.configure(sink, group="fe-test")

    class Thing:
        @metrics.prof(group="fe-test")
        def work(self, x):
            if x < 0:
                raise ValueError("negative")
            return x * 2

    assert Thing().work(2) == 4
    with pytest.raises(ValueError):
        Thing().work(-1)
    metrics.put_metric("custom", 5, "fe-test")
    names = [d.name for d in sink.data]
    assert names == [
        "test_prof_and_put_metric_names_match_torch.<locals>.Thing.work.duration.ms",
        "test_prof_and_put_metric_names_match_torch.<locals>.Thing.work.success",
        "test_prof_and_put_metric_names_match_torch.<locals>.Thing.work.failure",
        "test_prof_and_put_metric_names_match_torch.<locals>.Thing.work.duration.ms",
        "custom",
    ]
    assert all(d.group_name == "fe-test" for d in sink.data) and sink.data[-1].value == 5
    with pytest.raises(TypeError):
        metrics.configure(object())  # type: ignore[arg-type]


def test_agent_metrics_are_emitted(tmp_path):
    """A real agent run reports torch's per-role metrics to the configured group."""
    import sys

    from fastelastic.agent.server import WorkerSpec
    from fastelastic.agent.server.local_elastic_agent import LocalElasticAgent
    from fastelastic.multiprocessing import DefaultLogsSpecs
    from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler

    sink = CollectMetrics()
    metrics.configure(sink, group="torchelastic")
    try:
        handler = get_rendezvous_handler(
            RendezvousParameters(
                backend="static",
                endpoint="127.0.0.1:0",
                run_id="m",
                min_nodes=1,
                max_nodes=1,
                rank=0,
            )
        )
        spec = WorkerSpec(
            role="mrole",
            local_world_size=1,
            rdzv_handler=handler,
            entrypoint=sys.executable,
            args=("-c", "pass"),
        )
        result = LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path))).run()
    finally:
        metrics.configure(metrics.NullMetricHandler(), group="torchelastic")
    assert not result.is_failed()
    got = {d.name: d.value for d in sink.data}
    assert got["workers.mrole.run_total"] == 1
    assert got["workers.mrole.run_success_no_retries"] == 1
    assert got["workers.mrole.flakiness"] == 0
    assert "LocalElasticAgent._start_workers.success" in got
