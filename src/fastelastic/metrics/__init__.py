"""Metrics with torch's names: ``put_metric``, ``prof`` and pluggable handlers per group.

By default every data point is dropped (``NullMetricHandler``). To see the agent's metrics::

    from fastelastic import metrics

    metrics.configure(metrics.ConsoleMetricHandler(), group="torchelastic")
"""

from __future__ import annotations

from fastelastic.metrics.api import (
    ConsoleMetricHandler,
    MetricData,
    MetricHandler,
    MetricsConfig,
    MetricStream,
    NullMetricHandler,
    configure,
    get_elapsed_time_ms,
    getStream,
    prof,
    profile,
    publish_metric,
    put_metric,
)

__all__ = [
    "ConsoleMetricHandler",
    "MetricData",
    "MetricHandler",
    "MetricStream",
    "MetricsConfig",
    "NullMetricHandler",
    "configure",
    "getStream",
    "get_elapsed_time_ms",
    "initialize_metrics",
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
]


def initialize_metrics(cfg: MetricsConfig | None = None) -> None:
    """Hook for metric backends that need set-up; the built-in handlers need none."""
    return
