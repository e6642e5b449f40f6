"""The timer contract shared by every client and server: requests, base classes, ``expires``."""

from __future__ import annotations

import abc
import logging
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["RequestQueue", "TimerClient", "TimerRequest", "TimerServer", "configure", "expires"]

logger = logging.getLogger(__name__)


class TimerRequest:
    """A countdown timer acquisition or release, sent from a ``TimerClient`` to a ``TimerServer``.

    A negative ``expiration_time`` means "release". ``expiration_time`` is wall-clock seconds
    (``time.time()`` based) because that is what crosses process boundaries in torch's protocol;
    servers convert it to a monotonic deadline on arrival.

    Args:
        worker_id: whatever identifies the worker to the server (a pid for local servers).
        scope_id: names the timer within the worker.
        expiration_time: wall-clock expiry in seconds, or negative to release.
    """

    __slots__ = ["expiration_time", "scope_id", "worker_id"]

    def __init__(self, worker_id: Any, scope_id: str, expiration_time: float) -> None:
        self.worker_id = worker_id
        self.scope_id = scope_id
        self.expiration_time = expiration_time

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TimerRequest):
            return (
                self.worker_id == other.worker_id
                and self.scope_id == other.scope_id
                and self.expiration_time == other.expiration_time
            )
        return False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(worker_id={self.worker_id!r}, scope_id={self.scope_id!r}, "
            f"expiration_time={self.expiration_time!r})"
        )


class TimerClient(abc.ABC):
    """Acquires and releases countdown timers by talking to a ``TimerServer``."""

    @abc.abstractmethod
    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Acquires a timer for this worker that expires at ``expiration_time`` (wall clock).

        Args:
            scope_id: names the timer within the worker.
            expiration_time: wall-clock expiry in seconds.
        """

    @abc.abstractmethod
    def release(self, scope_id: str) -> None:
        """Releases this worker's timer ``scope_id``; it no longer counts down.

        Args:
            scope_id: the timer to release.
        """


class RequestQueue(abc.ABC):
    """Consumer end of the queue that carries timer requests to a server."""

    @abc.abstractmethod
    def size(self) -> int:
        """Returns how many requests are queued right now (a lower bound for ``get``)."""

    @abc.abstractmethod
    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Returns up to ``size`` requests, blocking no more than ``timeout`` seconds."""


class TimerServer(abc.ABC):
    """Watches the timers registered through a ``RequestQueue`` and reaps expired workers.

    Unlike torch's, the loop waits for requests only until the next deadline (or
    ``max_interval``, whichever comes first), so a timer fires at its deadline when the
    subclass reports deadlines through ``_next_deadline``.

    Args:
        request_queue: the consumer queue.
        max_interval: longest wait for a request, in seconds.
        daemon: run the watchdog thread as a daemon.
    """

    def __init__(
        self, request_queue: RequestQueue, max_interval: float, daemon: bool = True
    ) -> None:
        super().__init__()
        self._request_queue = request_queue
        self._max_interval = max_interval
        self._daemon = daemon
        self._watchdog_thread: threading.Thread | None = None
        self._stop_signaled = False

    @abc.abstractmethod
    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Registers acquire requests and applies release requests (negative expiration)."""

    @abc.abstractmethod
    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Drops every timer of the given workers."""

    @abc.abstractmethod
    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """Returns, per worker, the timers whose ``expiration_time`` is ``<= deadline``."""

    @abc.abstractmethod
    def _reap_worker(self, worker_id: Any) -> bool:
        """Reaps one worker; returns True on success (its timers are then cleared)."""

    def _next_deadline(self) -> float | None:
        """Monotonic time of the earliest pending deadline, if the subclass tracks one."""
        return None

    def _due_timers(self) -> dict[Any, list[TimerRequest]]:
        """The timers to reap now. The wire contract is wall-clock, so the default asks
        ``get_expired_timers`` with the current wall time; monotonic subclasses override."""
        return self.get_expired_timers(time.time())

    def _reap_worker_no_throw(self, worker_id: Any) -> bool:
        try:
            return self._reap_worker(worker_id)
        except Exception:
            logger.exception(
                "Uncaught exception from _reap_worker(); treating the worker as reaped"
            )
            return True

    def _watchdog_loop(self) -> None:
        while not self._stop_signaled:
            try:
                self._run_watchdog()
            except Exception:
                logger.exception("Error running watchdog")

    def _run_watchdog(self) -> None:
        wait = self._max_interval
        nxt = self._next_deadline()
        if nxt is not None:
            wait = max(0.0, min(wait, nxt - time.monotonic()))
        batch_size = max(1, self._request_queue.size())
        self.register_timers(self._request_queue.get(batch_size, wait))
        reaped = set()
        for worker_id, expired in self._due_timers().items():
            scopes = [r.scope_id for r in expired]
            logger.info("Reaping worker_id=[%s]. Expired timers: %s", worker_id, scopes)
            if self._reap_worker_no_throw(worker_id):
                logger.info("Successfully reaped worker=[%s]", worker_id)
                reaped.add(worker_id)
            else:
                logger.error("Error reaping worker=[%s]. Will retry on next watchdog.", worker_id)
        self.clear_timers(reaped)

    def start(self) -> None:
        """Starts the watchdog thread (non-blocking)."""
        logger.info(
            "Starting %s... max_interval=%s, daemon=%s",
            type(self).__name__,
            self._max_interval,
            self._daemon,
        )
        self._stop_signaled = False
        self._watchdog_thread = threading.Thread(
            target=self._watchdog_loop, daemon=self._daemon, name=type(self).__name__
        )
        self._watchdog_thread.start()

    def stop(self) -> None:
        """Signals the watchdog thread to stop and joins it (up to ``max_interval``)."""
        logger.info("Stopping %s", type(self).__name__)
        self._stop_signaled = True
        if self._watchdog_thread is not None:
            self._watchdog_thread.join(max(self._max_interval, 0.0) + 1.0)
            self._watchdog_thread = None


_timer_client: TimerClient | None = None


def configure(timer_client: TimerClient) -> None:
    """Sets the timer client ``expires`` uses when it is given none.

    Args:
        timer_client: the client, e.g. ``FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"])``.
    """
    global _timer_client
    _timer_client = timer_client
    logger.info("Timer client configured to: %s", type(timer_client).__name__)


@contextmanager
def expires(
    after: float, scope: str | None = None, client: TimerClient | None = None
) -> Iterator[None]:
    """Acquires a countdown timer that expires ``after`` seconds from now for the wrapped block.

    If the block does not finish in time the worker becomes eligible to be reaped (usually
    killed) by the server its client talks to. The timer is released when the block exits.

    Args:
        after: seconds until expiry.
        scope: timer name; defaults to ``"<caller file>#<line>"`` of the ``with`` statement.
        client: the client to use; defaults to the one set by ``configure``.

    Raises:
        RuntimeError: no client given and none configured.

    Example::

        fastelastic.timer.configure(FileTimerClient(path))
        with fastelastic.timer.expires(after=30):
            dist.all_reduce(t)
    """
    if client is None:
        if _timer_client is None:
            raise RuntimeError("Configure timer client before using countdown timers.")
        client = _timer_client
    if scope is None:
        # frame 0 is this generator, 1 is contextlib's __enter__, 2 holds the `with`
        caller = sys._getframe(2)
        scope = f"{caller.f_code.co_filename}#{caller.f_lineno}"
    client.acquire(scope, time.time() + after)
    try:
        yield
    finally:
        client.release(scope)
