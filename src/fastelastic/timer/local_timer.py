"""In-process timers: ``LocalTimerClient``/``LocalTimerServer`` over a multiprocessing queue."""

from __future__ import annotations

import heapq
import logging
import multiprocessing as mp
import os
import signal
import time
from queue import Empty
from typing import Any

from fastelastic.timer.api import RequestQueue, TimerClient, TimerRequest, TimerServer

__all__ = ["LocalTimerClient", "LocalTimerServer", "MultiprocessingRequestQueue"]

logger = logging.getLogger(__name__)


class LocalTimerClient(TimerClient):
    """Client of ``LocalTimerServer``; identifies the worker by its pid.

    Args:
        mp_queue: the ``multiprocessing`` queue the server reads.
    """

    def __init__(self, mp_queue: Any) -> None:
        super().__init__()
        self._mp_queue = mp_queue

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Queues an acquire request for this process."""
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        """Queues a release request for this process."""
        self._mp_queue.put(TimerRequest(os.getpid(), scope_id, -1))


class MultiprocessingRequestQueue(RequestQueue):
    """A ``RequestQueue`` on top of a ``multiprocessing.Queue``.

    Args:
        mp_queue: the queue.
    """

    def __init__(self, mp_queue: mp.Queue) -> None:
        super().__init__()
        self._mp_queue = mp_queue

    def size(self) -> int:
        """Returns the approximate queue length."""
        return self._mp_queue.qsize()

    def get(self, size: int, timeout: float) -> list[TimerRequest]:
        """Returns up to ``size`` requests, waiting at most ``timeout`` seconds in total."""
        requests: list[TimerRequest] = []
        deadline = time.monotonic() + timeout
        for _ in range(size):
            wait = deadline - time.monotonic()
            try:
                if wait > 0:
                    requests.append(self._mp_queue.get(block=True, timeout=wait))
                else:
                    requests.append(self._mp_queue.get_nowait())
            except Empty:
                break
        return requests


class LocalTimerServer(TimerServer):
    """Server for ``LocalTimerClient``s: reaps (SIGKILLs) workers whose timers expire.

    Deadlines are kept on the monotonic clock (converted from the wall-clock expiration on
    arrival) and the loop wakes at the earliest one, so ``max_interval`` only bounds how long
    it waits for requests when no timer is pending.

    Args:
        mp_queue: the queue clients write to.
        max_interval: longest wait for a request, in seconds.
        daemon: run the watchdog thread as a daemon.
    """

    def __init__(self, mp_queue: mp.Queue, max_interval: float = 60, daemon: bool = True) -> None:
        super().__init__(MultiprocessingRequestQueue(mp_queue), max_interval, daemon)
        self._timers: dict[tuple[Any, str], TimerRequest] = {}
        self._deadlines: dict[tuple[Any, str], float] = {}
        self._heap: list[tuple[float, Any, str]] = []

    def register_timers(self, timer_requests: list[TimerRequest]) -> None:
        """Registers acquires and applies releases (negative expiration)."""
        for request in timer_requests:
            key = (request.worker_id, request.scope_id)
            if request.expiration_time < 0:
                self._timers.pop(key, None)
                self._deadlines.pop(key, None)
                continue
            deadline = time.monotonic() + (request.expiration_time - time.time())
            self._timers[key] = request
            self._deadlines[key] = deadline
            heapq.heappush(self._heap, (deadline, request.worker_id, request.scope_id))

    def clear_timers(self, worker_ids: set[Any]) -> None:
        """Drops every timer of the given workers."""
        for key in [k for k in self._timers if k[0] in worker_ids]:
            del self._timers[key]
            del self._deadlines[key]

    def get_expired_timers(self, deadline: float) -> dict[Any, list[TimerRequest]]:
        """Returns, per worker, the timers whose wall-clock expiration is ``<= deadline``."""
        expired: dict[Any, list[TimerRequest]] = {}
        for request in self._timers.values():
            if request.expiration_time <= deadline:
                expired.setdefault(request.worker_id, []).append(request)
        return expired

    def _next_deadline(self) -> float | None:
        while self._heap:
            deadline, worker_id, scope_id = self._heap[0]
            if self._deadlines.get((worker_id, scope_id)) == deadline:
                return deadline
            heapq.heappop(self._heap)  # stale: released or re-acquired
        return None

    def _due_timers(self) -> dict[Any, list[TimerRequest]]:
        now = time.monotonic()
        due: dict[Any, list[TimerRequest]] = {}
        for key, deadline in self._deadlines.items():
            if deadline <= now:
                due.setdefault(key[0], []).append(self._timers[key])
        return due

    def _reap_worker(self, worker_id: int) -> bool:
        try:
            os.kill(worker_id, signal.SIGKILL)
            return True
        except ProcessLookupError:
            logger.info("Process with pid=%s does not exist. Skipping", worker_id)
            return True
        except Exception:
            logger.exception("Error terminating pid=%s", worker_id)
        return False
