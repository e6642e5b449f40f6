"""Rendezvous timeout configuration (:class:`RendezvousTimeout`) and its ``rdzv_conf`` parsing."""

from __future__ import annotations

from datetime import timedelta
from typing import ClassVar

from .api import RendezvousParameters

__all__ = ["RendezvousTimeout", "timeout_from_params"]


class RendezvousTimeout:
    """Hold the timeout configuration of a rendezvous.

    Args:
        join: The time within which the rendezvous is expected to complete (default 600 s).
        last_call: An additional wait after ``min_nodes`` have joined before the rendezvous
            completes (default 30 s).
        close: The time within which the rendezvous is expected to close after
            :py:meth:`RendezvousHandler.set_closed` or :py:meth:`RendezvousHandler.shutdown`
            (default 30 s).
        heartbeat: The time within which a keep-alive heartbeat is expected to complete
            (default 5 s).

    Raises:
        ValueError: A timeout is zero or negative.
    """

    _ZERO = timedelta(0)
    _DEFAULT_TIMEOUTS: ClassVar[dict[str, timedelta]] = {
        "join": timedelta(seconds=600),
        "last_call": timedelta(seconds=30),
        "close": timedelta(seconds=30),
        "heartbeat": timedelta(seconds=5),
    }

    _join: timedelta
    _last_call: timedelta
    _close: timedelta
    _heartbeat: timedelta

    def __init__(
        self,
        join: timedelta | None = None,
        last_call: timedelta | None = None,
        close: timedelta | None = None,
        heartbeat: timedelta | None = None,
    ) -> None:
        for name, value in (
            ("join", join), ("last_call", last_call), ("close", close), ("heartbeat", heartbeat)
        ):
            if value is None:
                value = self._DEFAULT_TIMEOUTS[name]
            if value <= self._ZERO:
                raise ValueError(f"The {name} timeout ({value}) must be positive.")
            setattr(self, "_" + name, value)

    @property
    def join(self) -> timedelta:
        """Get the join timeout."""
        return self._join

    @property
    def last_call(self) -> timedelta:
        """Get the last call timeout."""
        return self._last_call

    @property
    def close(self) -> timedelta:
        """Get the close timeout."""
        return self._close

    @property
    def heartbeat(self) -> timedelta:
        """Get the keep-alive heartbeat timeout."""
        return self._heartbeat

    def __repr__(self) -> str:
        return (
            f"RendezvousTimeout(join={self._join}, last_call={self._last_call}, "
            f"close={self._close}, heartbeat={self._heartbeat})"
        )


def _get_timeout(params: RendezvousParameters, key: str) -> timedelta | None:
    seconds = params.get_as_int(key + "_timeout")
    return None if seconds is None else timedelta(seconds=seconds)


def timeout_from_params(params: RendezvousParameters) -> RendezvousTimeout:
    """Builds a :class:`RendezvousTimeout` from ``join_timeout``, ``last_call_timeout``,
    ``close_timeout`` and ``heartbeat`` (all seconds) in ``rdzv_conf``.

    ``last_call_timeout`` may be 0 here (complete as soon as ``min_nodes`` joined); it is
    mapped to the smallest positive timeout, which the handlers treat as "no last call".

    Raises:
        ValueError: A value is not an integer or is negative.
    """
    last_call = _get_timeout(params, "last_call")
    if last_call is not None and last_call == timedelta(0):
        last_call = timedelta(microseconds=1)
    heartbeat = params.get_as_int("heartbeat")
    if heartbeat is None:
        heartbeat = params.get_as_int("heartbeat_timeout")
    return RendezvousTimeout(
        _get_timeout(params, "join"),
        last_call,
        _get_timeout(params, "close"),
        None if heartbeat is None else timedelta(seconds=heartbeat),
    )


def store_times_from_params(params: RendezvousParameters, interval: float,
                            attempts: int) -> tuple[timedelta, float, int]:
    """``read_timeout`` (store operations, default 60 s), ``keep_alive_interval`` (default
    ``interval``) and ``keep_alive_max_attempt`` (default ``attempts``) from ``rdzv_conf``.

    Raises:
        ValueError: A malformed value.
    """
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    if read_timeout <= timedelta(0):
        raise ValueError("The read timeout must be positive.")
    try:
        keep_alive_interval = float(params.get("keep_alive_interval", interval))
    except (TypeError, ValueError) as e:
        raise ValueError("The rendezvous configuration option 'keep_alive_interval' must be a "
                         "number of seconds.") from e
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", attempts)
    if keep_alive_max_attempt is None:
        raise ValueError("keep_alive_max_attempt must not be None.")
    return read_timeout, keep_alive_interval, keep_alive_max_attempt
