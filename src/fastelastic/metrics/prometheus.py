"""Prometheus export of the metrics published with ``put_metric`` (torch's names).

``PrometheusMetricHandler`` is a ``MetricHandler`` (configure it like any other) and a
``prometheus_client`` collector. It turns torch's dotted metric names into labelled families,
``<group>`` being the metric group (``torchelastic`` for the agent's)::

    workers.<role>.remaining_restarts     -> <group>_workers_remaining_restarts{role}     gauge
    workers.<role>.flakiness              -> <group>_workers_flakiness{role}              gauge
    workers.<role>.<worker state>         -> <group>_workers_state{role,state}            gauge, 1
                                             for the last state seen, 0 for the others;
                                             <group>_workers_state_observations_total     counter
    workers.<role>.<other>                -> <group>_workers_<other>_total{role}          counter
                                             (run_total, run_success_no_retries, ...,
                                             watchdog_kills)
    <function>.duration.ms (``@prof``)    -> <group>_duration_seconds{function}           histogram
                                             (rendezvous: function="SimpleElasticAgent._rendezvous")
    <function>.success / .failure         -> <group>_calls_total{function,result}         counter
    *._restart_workers.success/.failure   -> <group>_restarts_total                       counter
    anything else                         -> <group>_metric{name}                         gauge

Recording needs nothing beyond the standard library; exposition (``collect``,
``generate_latest``) needs ``prometheus_client`` (``pip install 'fastelastic[metrics]'``).
The number of series is bounded (``max_series``); data points beyond it are counted in
``fastelastic_metrics_dropped_total``, never stored.
"""

from __future__ import annotations

import bisect
import re
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

from fastelastic.metrics.api import MetricData, MetricHandler, add_observer

__all__ = [
    "DEFAULT_BUCKETS",
    "AgentStatusCollector",
    "PrometheusMetricHandler",
    "PrometheusUnavailableError",
    "available",
    "exporter",
    "generate_latest",
    "process_collector",
]

# Seconds; rendezvous and worker starts span milliseconds to minutes.
DEFAULT_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0, 300.0, 600.0,
)  # fmt: skip
# torch's WorkerState names, lowercased as the agent publishes them (the metrics package does not
# import the agent).
_WORKER_STATES = ("unknown", "init", "healthy", "unhealthy", "stopped", "succeeded", "failed")
_GAUGE_KEYS = {
    "remaining_restarts": "Restarts the agent may still do (torch's max_restarts budget).",
    "flakiness": "Percentage of the restart budget used by the last run (100 when it failed).",
}
_NOT_NAME = re.compile(r"[^a-zA-Z0-9_]")
INSTALL_HINT = (
    "prometheus_client is not installed: pip install 'fastelastic[metrics]' "
    "(or pip install prometheus_client) to export metrics"
)


class PrometheusUnavailableError(RuntimeError):
    """``prometheus_client`` is not installed, so metrics cannot be exposed."""


def available() -> bool:
    """True if ``prometheus_client`` can be imported."""
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        return False
    return True


def _prom() -> Any:
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as e:
        raise PrometheusUnavailableError(INSTALL_HINT) from e
    return prometheus_client


def _family_prefix(group: str) -> str:
    name = _NOT_NAME.sub("_", group) or "metrics"
    return "_" + name if name[0].isdigit() else name


class _Family:
    __slots__ = ("help", "kind", "labelnames", "samples")

    def __init__(self, kind: str, help_text: str, labelnames: tuple[str, ...]) -> None:
        self.kind = kind  # "gauge" | "counter" | "histogram"
        self.help = help_text
        self.labelnames = labelnames
        # labels -> value (gauge, counter) or [bucket counts..., +Inf count, sum] (histogram)
        self.samples: dict[tuple[str, ...], Any] = {}


class PrometheusMetricHandler(MetricHandler):
    """Keeps the latest value or running total of every metric, for Prometheus to scrape.

    Args:
        max_series: most label combinations kept over all families; further data points of
            new series are dropped and counted.
        buckets: histogram upper bounds in seconds for ``*.duration.ms`` metrics.
    """

    def __init__(self, max_series: int = 5000, buckets: Sequence[float] = DEFAULT_BUCKETS):
        if max_series < 1:
            raise ValueError(f"max_series must be at least 1, got {max_series}")
        bounds = sorted(float(b) for b in buckets)
        if not bounds or any(b != b or b == float("inf") for b in bounds):
            raise ValueError(f"buckets must be finite numbers, got {buckets!r}")
        self._max_series = max_series
        self._buckets = tuple(bounds)
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}
        self._series = 0
        self._dropped = 0

    # ------------------------------------------------------------------ recording

    def emit(self, metric_data: MetricData) -> None:
        """Records one data point (see the module docstring for the mapping)."""
        try:
            value = float(metric_data.value)
        except (TypeError, ValueError):
            with self._lock:
                self._dropped += 1
            return
        prefix = _family_prefix(str(metric_data.group_name))
        name = str(metric_data.name)
        with self._lock:
            self._record(prefix, name, value)

    def _record(self, prefix: str, name: str, value: float) -> None:
        if name.endswith(".duration.ms"):
            fn = name[: -len(".duration.ms")]
            self._observe(
                f"{prefix}_duration_seconds",
                "Duration of the agent's profiled functions (torch's <function>.duration.ms).",
                ("function",),
                (fn,),
                value / 1000.0,
            )
            return
        for result in ("success", "failure"):
            if name.endswith("." + result):
                fn = name[: -len(result) - 1]
                self._add(
                    f"{prefix}_calls",
                    "Calls of the agent's profiled functions by result.",
                    ("function", "result"),
                    (fn, result),
                    value,
                )
                if fn.endswith("._restart_workers"):
                    self._add(
                        f"{prefix}_restarts",
                        "Worker group restarts (after failures and membership changes).",
                        (),
                        (),
                        value,
                    )
                return
        parts = name.split(".")
        if len(parts) >= 3 and parts[0] == "workers":
            role, key = ".".join(parts[1:-1]), parts[-1]
            if key in _GAUGE_KEYS:
                self._set(f"{prefix}_workers_{key}", _GAUGE_KEYS[key], ("role",), (role,), value)
            elif key in _WORKER_STATES:
                for state in _WORKER_STATES:
                    self._set(
                        f"{prefix}_workers_state",
                        "1 for the worker group's last observed state, 0 for the others.",
                        ("role", "state"),
                        (role, state),
                        1.0 if state == key else 0.0,
                    )
                self._add(
                    f"{prefix}_workers_state_observations",
                    "Monitor passes that observed the worker group in each state.",
                    ("role", "state"),
                    (role, key),
                    value,
                )
            else:
                self._add(
                    f"{prefix}_workers_{_NOT_NAME.sub('_', key)}",
                    f"torch's workers.<role>.{key} metric, summed.",
                    ("role",),
                    (role,),
                    value,
                )
            return
        self._set(f"{prefix}_metric", "Other metrics: the last value.", ("name",), (name,), value)

    def _slot(
        self, family: str, kind: str, help_text: str, labelnames: tuple[str, ...],
        labels: tuple[str, ...], initial: Any,
    ) -> _Family | None:  # fmt: skip
        fam = self._families.get(family)
        if fam is None:
            fam = self._families[family] = _Family(kind, help_text, labelnames)
        elif fam.kind != kind or fam.labelnames != labelnames:
            self._dropped += 1  # a name that maps onto an existing family of another shape
            return None
        if labels not in fam.samples:
            if self._series >= self._max_series:
                self._dropped += 1
                return None
            self._series += 1
            fam.samples[labels] = initial
        return fam

    def _set(self, family: str, help_text: str, labelnames: tuple[str, ...],
             labels: tuple[str, ...], value: float) -> None:  # fmt: skip
        fam = self._slot(family, "gauge", help_text, labelnames, labels, 0.0)
        if fam is not None:
            fam.samples[labels] = value

    def _add(self, family: str, help_text: str, labelnames: tuple[str, ...],
             labels: tuple[str, ...], value: float) -> None:  # fmt: skip
        fam = self._slot(family, "counter", help_text, labelnames, labels, 0.0)
        if fam is not None and value > 0:  # a counter never goes down
            fam.samples[labels] += value

    def _observe(self, family: str, help_text: str, labelnames: tuple[str, ...],
                 labels: tuple[str, ...], seconds: float) -> None:  # fmt: skip
        n = len(self._buckets)
        fam = self._slot(family, "histogram", help_text, labelnames, labels, None)
        if fam is None:
            return
        hist = fam.samples[labels]
        if hist is None:
            hist = fam.samples[labels] = [0] * (n + 1) + [0.0]
        hist[bisect.bisect_left(self._buckets, seconds)] += 1  # per-bucket, made cumulative later
        hist[n + 1] += seconds

    # ------------------------------------------------------------------ exposition

    def describe(self) -> Iterable[Any]:
        """Nothing up front: the families appear as metrics are published."""
        return []

    def collect(self) -> Iterator[Any]:
        """Yields ``prometheus_client`` metric families (the collector protocol).

        Raises:
            PrometheusUnavailableError: ``prometheus_client`` is not installed.
        """
        core = _prom().core
        with self._lock:
            snapshot = [
                (name, fam.kind, fam.help, fam.labelnames, list(fam.samples.items()))
                for name, fam in self._families.items()
            ]
            dropped = self._dropped
        bounds = [*(repr(b) for b in self._buckets), "+Inf"]
        for name, kind, help_text, labelnames, samples in snapshot:
            if kind == "gauge":
                out = core.GaugeMetricFamily(name, help_text, labels=labelnames)
                for labels, value in samples:
                    out.add_metric(labels, value)
            elif kind == "counter":
                out = core.CounterMetricFamily(name, help_text, labels=labelnames)
                for labels, value in samples:
                    out.add_metric(labels, value)
            else:
                out = core.HistogramMetricFamily(name, help_text, labels=labelnames)
                for labels, hist in samples:
                    cumulative, buckets = 0, []
                    for bound, count in zip(bounds, hist[:-1], strict=True):
                        cumulative += count
                        buckets.append((bound, cumulative))
                    out.add_metric(labels, buckets, sum_value=hist[-1])
            yield out
        out = core.CounterMetricFamily(
            "fastelastic_metrics_dropped",
            "Data points not exported (series limit reached, non-numeric, or name clash).",
        )
        out.add_metric([], dropped)
        yield out


def generate_latest(*collectors: Any, accept: str = "") -> tuple[str, bytes]:
    """Renders ``collectors`` (e.g. a handler) for an HTTP answer.

    Args:
        accept: the request's ``Accept`` header: the text exposition format (version 0.0.4)
            unless it asks for OpenMetrics, as ``prometheus_client``'s own server negotiates.

    Returns:
        ``(content_type, body)``.

    Raises:
        PrometheusUnavailableError: ``prometheus_client`` is not installed.
    """
    prom = _prom()
    from prometheus_client.exposition import choose_encoder

    registry = prom.CollectorRegistry(auto_describe=False)
    for c in collectors:
        registry.register(c)
    encoder, content_type = choose_encoder(accept)
    return content_type, encoder(registry)


# torch's WorkerState values, as the health status reports the group's state.
_GROUP_STATES = tuple(s.upper() for s in _WORKER_STATES)


class AgentStatusCollector:
    """Collector of the agent's live status, read at scrape time (``fastelastic_agent_*``).

    Args:
        status: returns ``(http_status, body)`` as the health server's ``status()`` does.
    """

    def __init__(self, status: Callable[[], tuple[int, dict[str, Any]]]) -> None:
        self._status = status

    def describe(self) -> Iterable[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        core = _prom().core
        _, body = self._status()
        g = core.GaugeMetricFamily
        yield g("fastelastic_agent_healthy", "1 while GET /health answers 200.",
                value=1.0 if body.get("healthy") else 0.0)  # fmt: skip
        yield g("fastelastic_agent_seconds_since_progress",
                "Seconds since the agent (or its watchdog) last saw progress.",
                value=float(body.get("seconds_since_progress", 0)))  # fmt: skip
        for key, text in (
            ("restart_count", "Worker group restarts after failures (torch's restart_count)."),
            ("max_restarts", "The worker group's restart budget (--max-restarts)."),
        ):
            if isinstance(body.get(key), int):
                yield g(f"fastelastic_agent_{key}", text, value=float(body[key]))
        state = body.get("state")
        if isinstance(state, str):
            out = g("fastelastic_agent_state", "1 for the worker group's current state.",
                    labels=("state",))  # fmt: skip
            for s in dict.fromkeys((*_GROUP_STATES, state)):
                out.add_metric((s,), 1.0 if s == state else 0.0)
            yield out
        workers = body.get("workers")
        if isinstance(workers, list):
            counts: dict[str, int] = {}
            for w in workers:
                if isinstance(w, dict):
                    s = str(w.get("state", "UNKNOWN"))
                    counts[s] = counts.get(s, 0) + 1
            out = g("fastelastic_agent_workers", "Local worker processes by state.",
                    labels=("state",))  # fmt: skip
            for s, n in sorted(counts.items()):
                out.add_metric((s,), float(n))
            yield out
            yield from _progress_families(g, workers)


def _progress_families(g: Any, workers: list[Any]) -> Iterator[Any]:
    """Per-rank progress (``--hang-timeout``): optimizer steps, seconds since the last one."""
    ranked = [w for w in workers if isinstance(w, dict) and isinstance(w.get("steps"), int)]
    if not ranked:
        return
    steps = g("fastelastic_agent_worker_steps", "Optimizer steps of each local rank "
              "(--hang-timeout).", labels=("global_rank",))  # fmt: skip
    idle = g("fastelastic_agent_worker_seconds_since_progress", "Seconds since each local "
             "rank's last progress (--hang-timeout; absent before the first).",
             labels=("global_rank",))  # fmt: skip
    for w in ranked:
        rank = (str(w.get("global_rank")),)
        steps.add_metric(rank, float(w["steps"]))
        if isinstance(w.get("since_progress_s"), (int, float)):
            idle.add_metric(rank, float(w["since_progress_s"]))
    yield steps
    yield idle


def process_collector() -> Any:
    """``prometheus_client``'s collector of this process's CPU, memory and fds."""
    return _prom().ProcessCollector(registry=None)


_exporter_lock = threading.Lock()
_exporter: PrometheusMetricHandler | None = None


def exporter() -> PrometheusMetricHandler:
    """The process-wide handler the agent's ``/metrics`` serves, observing every metric group.

    Created and attached with :func:`fastelastic.metrics.add_observer` on first call, so the
    groups' configured handlers (``metrics.configure``) keep receiving their data points too.
    """
    global _exporter
    with _exporter_lock:
        if _exporter is None:
            _exporter = PrometheusMetricHandler()
            add_observer(_exporter)
        return _exporter
