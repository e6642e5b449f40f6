"""Metric streams, handlers and the ``prof`` decorator (torch's ``elastic.metrics.api``)."""

from __future__ import annotations

import abc
import functools
import logging
import threading
import time
import warnings
from collections import namedtuple
from collections.abc import Callable
from typing import Any, TypeVar

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
    "prof",
    "profile",
    "publish_metric",
    "put_metric",
    "remove_observer",
]

MetricData = namedtuple("MetricData", ["timestamp", "group_name", "name", "value"])

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])


class MetricsConfig:
    """Free-form parameters for a metrics backend."""

    __slots__ = ["params"]

    def __init__(self, params: dict[str, str] | None = None):
        self.params: dict[str, str] = {} if params is None else params


class MetricHandler(abc.ABC):
    """Receives every data point of the metric groups it is configured for."""

    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None:
        """Handles one data point."""


class ConsoleMetricHandler(MetricHandler):
    """Prints each data point as ``[timestamp][group]: name=value``."""

    def emit(self, metric_data: MetricData) -> None:
        print(
            f"[{metric_data.timestamp}][{metric_data.group_name}]: "
            f"{metric_data.name}={metric_data.value}"
        )


class NullMetricHandler(MetricHandler):
    """Drops every data point (the default)."""

    def emit(self, metric_data: MetricData) -> None:
        return None


class MetricStream:
    """Data points of one metric group, sent to that group's handler."""

    def __init__(self, group_name: str, handler: MetricHandler):
        self.group_name = group_name
        self.handler = handler

    def add_value(self, metric_name: str, metric_value: int) -> None:
        """Emits one data point, stamped with the wall-clock time (a label, not a deadline).

        Observers (:func:`add_observer`, e.g. the Prometheus exporter) see it too.
        """
        data = MetricData(time.time(), self.group_name, metric_name, metric_value)
        self.handler.emit(data)
        for observer in _observers:
            if observer is not self.handler:
                try:
                    observer.emit(data)
                except Exception:  # an exporter's bug must not fail the agent
                    logger.exception("metric observer %r failed", observer)


_lock = threading.Lock()
# Ours: handlers that see every data point of every group, whatever handler a group has.
_observers: tuple[MetricHandler, ...] = ()
_metrics_map: dict[str, MetricHandler] = {}
_default_metrics_handler: MetricHandler = NullMetricHandler()


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Sends the metrics of ``group`` (every unconfigured group if None) to ``handler``.

    Raises:
        TypeError: ``handler`` is not a MetricHandler.
    """
    global _default_metrics_handler
    if not isinstance(handler, MetricHandler):
        raise TypeError(f"handler must be a MetricHandler, got {type(handler).__name__}")
    with _lock:
        if group is None:
            _default_metrics_handler = handler
        else:
            _metrics_map[group] = handler


def add_observer(handler: MetricHandler) -> None:
    """Ours: ``handler`` also receives every data point of every group (idempotent).

    The configured handlers are unchanged, so a user's ``configure()`` and the Prometheus
    exporter of the health server coexist.

    Raises:
        TypeError: ``handler`` is not a MetricHandler.
    """
    global _observers
    if not isinstance(handler, MetricHandler):
        raise TypeError(f"handler must be a MetricHandler, got {type(handler).__name__}")
    with _lock:
        if handler not in _observers:
            _observers = (*_observers, handler)


def remove_observer(handler: MetricHandler) -> None:
    """Ours: undoes :func:`add_observer` (no-op for a handler that is not observing)."""
    global _observers
    with _lock:
        _observers = tuple(h for h in _observers if h is not handler)


def getStream(group: str) -> MetricStream:
    """Returns the stream of ``group``, bound to its handler (or the default one)."""
    with _lock:
        handler = _metrics_map.get(group, _default_metrics_handler)
    return MetricStream(group, handler)


def _get_metric_name(fn: Callable[..., Any]) -> str:
    parts = fn.__qualname__.split(".")
    if len(parts) > 1:
        return fn.__qualname__
    module = fn.__module__
    return f"{module.split('.')[-1]}.{parts[0]}" if module else parts[0]


def prof(fn: F | None = None, group: str = "torchelastic") -> Any:
    """Decorator publishing ``<name>.success``/``.failure`` and ``<name>.duration.ms``.

    The name is the function's qualified name (``Class.method``), or ``module.function`` for a
    plain function. Usable bare (``@prof``) or with a group (``@prof(group="agent")``).
    """

    def wrap(f: F) -> F:
        key = _get_metric_name(f)

        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                result = f(*args, **kwargs)
            except Exception:
                put_metric(f"{key}.failure", 1, group)
                raise
            finally:
                put_metric(f"{key}.duration.ms", int((time.monotonic() - start) * 1000), group)
            put_metric(f"{key}.success", 1, group)
            return result

        return wrapper  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


def profile(group: str | None = None) -> Callable[[F], F]:
    """Deprecated: use :func:`prof`. Publishes success/failure/duration under ``group``."""
    warnings.warn("Deprecated, use `@prof` instead", FutureWarning, stacklevel=2)
    metric_group = group if group is not None else "torchelastic"

    def wrap(func: F) -> F:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            try:
                result = func(*args, **kwargs)
            except Exception:
                put_metric(f"{func.__name__}.failure", 1, metric_group)
                raise
            finally:
                elapsed = int((time.monotonic() - start) * 1000)
                put_metric(f"{func.__name__}.duration.ms", elapsed, metric_group)
            put_metric(f"{func.__name__}.success", 1, metric_group)
            return result

        return wrapper  # type: ignore[return-value]

    return wrap


def put_metric(metric_name: str, metric_value: int, metric_group: str = "torchelastic") -> None:
    """Publishes one data point of ``metric_name`` in ``metric_group``."""
    getStream(metric_group).add_value(metric_name, metric_value)


def publish_metric(metric_group: str, metric_name: str, metric_value: int) -> None:
    """Deprecated: use :func:`put_metric`."""
    warnings.warn("Deprecated, use `put_metric` instead", FutureWarning, stacklevel=2)
    getStream(metric_group).add_value(metric_name, metric_value)


def get_elapsed_time_ms(start_time_in_seconds: float) -> int:
    """Milliseconds elapsed since ``start_time_in_seconds`` (a ``time.time()`` reading)."""
    return int((time.time() - start_time_in_seconds) * 1000)
