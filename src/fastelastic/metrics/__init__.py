"""Metrics with torch's names: ``put_metric``, ``prof`` and pluggable handlers per group.

By default every data point is dropped (``NullMetricHandler``). To see the agent's metrics::

    from fastelastic import metrics

    metrics.configure(metrics.ConsoleMetricHandler(), group="torchelastic")

``fastelastic.metrics.prometheus`` exports them for Prometheus; the agent's health server serves
them at ``GET /metrics`` (needs ``pip install 'fastelastic[metrics]'``).
"""

from __future__ import annotations

from fastelastic.metrics.api import (
    ConsoleMetricHandler,
    MetricData,
    MetricHandler,
    MetricsConfig,
    MetricStream,
    NullMetricHandler,
    add_observer,
    configure,
    get_elapsed_time_ms,
    getStream,
    prof,
    profile,
    publish_metric,
    put_metric,
    remove_observer,
)

__all__ = [
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "MetricStream",
    "MetricsConfig",
    "NullMetricHandler",
    "add_observer",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
    "remove_observer",
]


def initialize_metrics(cfg: MetricsConfig | None = None) -> None:
    """Hook for metric backends that need set-up; the built-in handlers need none."""
    return
