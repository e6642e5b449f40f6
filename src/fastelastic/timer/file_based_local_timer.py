"""Named-pipe timers (torch's wire format): ``FileTimerClient`` and native ``FileTimerServer``."""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import shutil
import signal as _signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable

from fastelastic._native.watchdog import (
    ADMIT_OK,
    EV_DEFERRED,
    EV_EXITED,
    EV_EXPIRED,
    EV_KILLED,
    EV_MALFORMED,
    EV_REFUSED,
    FifoWatchdog,
)
from fastelastic.timer.api import TimerClient, TimerRequest
from fastelastic.timer.debug_info_logging import log_debug_info_for_expired_timers
from fastelastic.timer.stacks import dump_stacks

__all__ = ["FileTimerClient", "FileTimerRequest", "FileTimerServer", "default_timer_file"]

logger = logging.getLogger(__name__)

_OPEN_RETRIES = 10  # as torch's client: the server may not be up yet
_OPEN_RETRY_DELAY = 0.1
_WRITE_TIMEOUT = 5.0  # a full pipe (server stalled) fails the request after this long
_REFUSAL_REASONS = {
    1: "not ours to signal (not allow-listed, not our descendant, or another user's)",
    2: "no such process",
    3: "invalid pid",
}
_private_dirs: set[str] = set()


class FileTimerRequest(TimerRequest):
    """A timer request as it travels through the pipe: one JSON object per line.

    A negative ``expiration_time`` is a release. ``signal`` is what the server sends the
    worker on expiry (``<= 0``: do not signal).

    Args:
        worker_pid: the worker's pid.
        scope_id: names the timer within the worker.
        expiration_time: wall-clock expiry in seconds, or negative to release.
        signal: signal number sent on expiry.
    """

    __slots__ = ["signal", "version"]

    def __init__(
        self, worker_pid: int, scope_id: str, expiration_time: float, signal: int = 0
    ) -> None:
        super().__init__(worker_id=worker_pid, scope_id=scope_id, expiration_time=expiration_time)
        self.version = 1
        self.signal = signal

    @property
    def worker_pid(self) -> int:
        """The worker's pid."""
        return self.worker_id

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FileTimerRequest):
            return (
                super().__eq__(other)
                and self.version == other.version
                and self.signal == other.signal
            )
        return False

    def to_json(self) -> str:
        """Returns the line body exactly as torch's client writes it (same keys, same order)."""
        return json.dumps(
            {
                "version": self.version,
                "pid": self.worker_pid,
                "scope_id": self.scope_id,
                "expiration_time": self.expiration_time,
                "signal": int(self.signal),
            }
        )


class FileTimerClient(TimerClient):
    """Sends timer requests to a ``FileTimerServer`` (ours or torch's) through its FIFO.

    Each request opens the FIFO non-blocking, writes one line of at most ``PIPE_BUF`` bytes in
    a single ``write`` (atomic, so concurrent workers never interleave) and closes it.

    Args:
        file_path: the FIFO the server created (``TORCHELASTIC_TIMER_FILE``).
        signal: the signal the server sends on expiry; ``<= 0`` only reports the expiry.
    """

    def __init__(self, file_path: str, signal: int = _signal.SIGKILL) -> None:
        super().__init__()
        self._file_path = file_path
        self.signal = signal

    def _open(self) -> int:
        # The server may not be up yet (ENXIO: no reader; ENOENT: no FIFO): retry briefly, as
        # torch's client does, then give up with torch's exception type.
        attempt = 0
        while True:
            try:
                return os.open(self._file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            except OSError as e:
                attempt += 1
                if attempt >= _OPEN_RETRIES:
                    raise BrokenPipeError(
                        "Could not send the FileTimerRequest because FileTimerServer is not "
                        f"available at {self._file_path!r}: {e}"
                    ) from e
            time.sleep(_OPEN_RETRY_DELAY)

    def _send_request(self, request: FileTimerRequest) -> None:
        line = (request.to_json() + "\n").encode()
        if len(line) > select.PIPE_BUF:
            raise RuntimeError(
                f"FileTimerRequest larger than {select.PIPE_BUF} bytes is not supported: "
                f"{line[:200]!r}"
            )
        fd = self._open()
        try:
            deadline = time.monotonic() + _WRITE_TIMEOUT
            while True:
                try:
                    os.write(fd, line)  # <= PIPE_BUF: all or nothing
                    return
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise BrokenPipeError(
                            f"timer pipe {self._file_path!r} stayed full for {_WRITE_TIMEOUT} s"
                        ) from None
                    poller = select.poll()
                    poller.register(fd, select.POLLOUT)
                    poller.poll(left * 1000)
        finally:
            os.close(fd)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        """Asks the server to signal this process at ``expiration_time`` (wall clock)."""
        self._send_request(FileTimerRequest(os.getpid(), scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        """Cancels this process's timer ``scope_id``."""
        self._send_request(FileTimerRequest(os.getpid(), scope_id, -1, 0))


def default_timer_file() -> str:
    """Returns a FIFO path inside a new private (0700) directory; ``stop()`` removes both."""
    d = tempfile.mkdtemp(prefix="fastelastic-timer-")
    _private_dirs.add(d)
    return os.path.join(d, "watchdog_timer")


def _make_fifo(path: str) -> None:
    if os.path.lexists(path):
        os.remove(path)
    os.mkfifo(path, 0o600)
    os.chmod(path, 0o600)  # mode exactly 0600 whatever the umask


class FileTimerServer:
    """Watchdog for ``FileTimerClient``s on this host; same API as torch's, native loop.

    A native thread (no GIL) waits on the FIFO, a CLOCK_MONOTONIC timerfd armed at the
    earliest deadline and one pidfd per worker. A request is registered when its line arrives;
    at the deadline the worker is signalled through its pidfd right away, then this object
    logs it and calls ``log_event``. ``max_interval`` is kept for compatibility: it only paces
    the heartbeat behind ``get_last_progress_time`` (at most 1 s), never the kill latency.

    As torch's, a server constructed directly signals the pid its client names if that process
    runs as this server's user (``allow_same_user``), wherever it was started; the agent's own
    server (``allow_same_user=False``) signals only pids on the allow-list (``set_allowed_pids``)
    or descendants of this process. Either way each pid is pinned by a pidfd opened at its first
    request and signalled only through it, so a recycled pid is never hit; this process's own pid
    is never signalled. Other requests are refused and reported (event ``"request refused"``).
    Malformed lines are skipped (``"malformed request"``). A worker that exits loses its timers.
    Unlike torch's, this server does not SIGKILL its own process after reaping a worker.

    Args:
        file_path: FIFO to create (mode 0600); an existing file there is replaced.
        run_id: the job's run id, used in log lines.
        max_interval: heartbeat period bound, seconds (see above).
        daemon: run the watchdog thread as a daemon.
        log_event: ``(name, request_or_None)`` callback, called from the watchdog thread.
        allowed_pids: initial allow-list.
        allow_descendants: also accept any process that descends from this one.
        allow_same_user: also accept any process of this user (torch's behaviour).
        dump_stacks: before a kill, dump the worker's Python stacks (py-spy, else faulthandler
            via ``SIGUSR2`` if the worker called ``enable_stack_dump``); delays that kill.
        realtime: from 200 ms before the earliest deadline until it has fired, run the native
            loop at the lowest ``SCHED_FIFO`` priority when the process may (else normal
            priority, logged at INFO), so a loaded host does not delay the kill. Python (this
            object's policy, ``log_event``) always runs at normal priority.
    """

    def __init__(
        self,
        file_path: str,
        run_id: str,
        max_interval: float = 10,
        daemon: bool = True,
        log_event: Callable[[str, FileTimerRequest | None], None] | None = None,
        *,
        allowed_pids: Iterable[int] | None = None,
        allow_descendants: bool = True,
        allow_same_user: bool = True,
        dump_stacks: bool = False,
        realtime: bool = True,
    ) -> None:
        self._file_path = file_path
        self._run_id = run_id
        self._max_interval = max_interval
        self._daemon = daemon
        self._log_event = log_event if log_event is not None else (lambda name, request: None)
        self._dump_stacks = dump_stacks
        self._realtime = realtime
        self._watchdog_thread: threading.Thread | None = None
        self._is_client_started = False
        self._wd_closed = False
        self._final_progress_ns = 0
        self._lock = threading.Lock()
        self._allowed: set[int] = set(allowed_pids or ())
        _make_fifo(file_path)
        self._wd = FifoWatchdog(
            file_path, float(max_interval), allow_descendants, dump_stacks, allow_same_user
        )
        if self._allowed:
            self._wd.set_allowed(self._allowed)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Starts the native watchdog thread (non-blocking)."""
        logger.info(
            "Starting %s... max_interval=%s, daemon=%s, file_path=%s",
            type(self).__name__,
            self._max_interval,
            self._daemon,
            self._file_path,
        )
        self._watchdog_thread = threading.Thread(
            target=self._run, daemon=self._daemon, name="FileTimerServer"
        )
        self._watchdog_thread.start()
        self._is_client_started = True
        self._emit("watchdog started", None)

    def _run(self) -> None:
        self._wd.run(self._on_events, self._realtime)

    def stop(self) -> None:
        """Stops the thread, closes the pipe and removes it (and its private directory)."""
        logger.info("Stopping %s", type(self).__name__)
        self._finish(drain=False)
        self._emit("watchdog stopped", None)

    def run_once(self) -> None:
        """Processes every pending request, fires what is due, then stops (for tests)."""
        if self._watchdog_thread is None and not self._wd_closed:
            self._wd.poll_once(self._on_events)
        self._finish(drain=True)

    def _finish(self, drain: bool) -> None:
        thread, self._watchdog_thread = self._watchdog_thread, None
        if not self._wd_closed:
            self._wd.stop(drain)
            if thread is not None:
                thread.join(max(float(self._max_interval), 1.0) + 5.0)
                if thread.is_alive():
                    logger.error("FileTimerServer thread did not stop; leaving its fds open")
                    return
            self._final_progress_ns = self._wd.last_progress_ns
            self._wd.close()
            self._wd_closed = True
        for path in (self._file_path,):
            if os.path.lexists(path):
                os.remove(path)
        parent = os.path.dirname(self._file_path)
        if parent in _private_dirs:
            _private_dirs.discard(parent)
            shutil.rmtree(parent, ignore_errors=True)

    # ------------------------------------------------------------------ allow-list

    def set_allowed_pids(self, pids: Iterable[int]) -> None:
        """Replaces the allow-list: the pids (workers) this server may signal.

        Pids that leave the list lose their timers unless they descend from this process
        (and ``allow_descendants`` is on).
        """
        with self._lock:
            self._allowed = {int(p) for p in pids}
            self._wd.set_allowed(self._allowed)

    def allow_pid(self, pid: int) -> None:
        """Adds one pid to the allow-list."""
        with self._lock:
            self._allowed.add(int(pid))
            self._wd.set_allowed(self._allowed)

    def disallow_pid(self, pid: int) -> None:
        """Removes one pid from the allow-list (see ``set_allowed_pids``)."""
        with self._lock:
            self._allowed.discard(int(pid))
            self._wd.set_allowed(self._allowed)

    @property
    def allowed_pids(self) -> frozenset[int]:
        """The current allow-list."""
        with self._lock:
            return frozenset(self._allowed)

    # ------------------------------------------------------------------ torch's table API

    def register_timers(self, timer_requests: list[FileTimerRequest]) -> None:
        """Registers acquires and applies releases (negative expiration), as if from the pipe."""
        for request in timer_requests:
            r = self._wd.register(
                int(request.worker_pid),
                request.scope_id,
                float(request.expiration_time),
                int(request.signal),
            )
            if r != ADMIT_OK:
                self._refused(request, r)

    def clear_timers(self, worker_pids: set[int]) -> None:
        """Drops every timer of the given pids (timers of exited workers go by themselves)."""
        self._wd.clear_pids(worker_pids)

    def get_expired_timers(self, deadline: float) -> dict[int, list[FileTimerRequest]]:
        """Returns, per pid, the pending timers whose wall-clock expiration is ``<= deadline``."""
        expired: dict[int, list[FileTimerRequest]] = {}
        for pid, scope, expiration, sig, _ in self._wd.snapshot():
            if expiration <= deadline:
                expired.setdefault(pid, []).append(FileTimerRequest(pid, scope, expiration, sig))
        return expired

    def get_last_progress_time(self) -> int:
        """Wall-clock second of the watchdog loop's last iteration (now, before ``start``).

        The loop iterates at least every ``min(max_interval, 1)`` seconds while it runs, so a
        value older than that means the watchdog thread is stuck or gone.
        """
        if not self._is_client_started:
            return int(time.time())
        last = self._final_progress_ns if self._wd_closed else self._wd.last_progress_ns
        age = (time.monotonic_ns() - last) / 1e9
        return int(time.time() - max(age, 0.0))

    @property
    def _request_count(self) -> int:
        return self._wd.request_count

    @property
    def file_path(self) -> str:
        """The FIFO path (what workers get as ``TORCHELASTIC_TIMER_FILE``)."""
        return self._file_path

    @staticmethod
    def is_process_running(pid: int) -> bool:
        """Tells whether ``pid`` exists and may be signalled by us."""
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False

    # ------------------------------------------------------------------ policy

    def _emit(self, name: str, request: FileTimerRequest | None) -> None:
        try:
            self._log_event(name, request)
        except Exception:
            logger.exception("log_event(%r) failed", name)

    def _refused(self, request: FileTimerRequest, code: int) -> None:
        logger.warning(
            "Refused timer request for pid=%s scope=%r: %s; it will never be signalled",
            request.worker_pid,
            request.scope_id,
            _REFUSAL_REASONS.get(code, code),
        )
        self._emit("request refused", request)

    def _on_events(self, batch: list[tuple]) -> None:
        expired: dict[int, list[str]] = {}
        for kind, pid, scope, expiration, sig, err, deadline_ns, fired_ns, detail in batch:
            request = FileTimerRequest(pid, scope, expiration, sig)
            if kind == EV_EXPIRED:
                expired.setdefault(pid, []).append(request.to_json())
                self._emit("timer expired", request)
            elif kind == EV_KILLED:
                late_ms = (fired_ns - deadline_ns) / 1e6
                if err in (0, errno.ESRCH):
                    logger.info(
                        "Reaped worker pid=%s (scope=%r) with signal=%s, %.3f ms after deadline%s",
                        pid,
                        scope,
                        sig,
                        late_ms,
                        " (it had already exited)" if err else "",
                    )
                    self._emit("kill worker process", request)
                else:
                    logger.error(
                        "Error reaping worker pid=%s with signal=%s: %s", pid, sig, os.strerror(err)
                    )
            elif kind == EV_DEFERRED:
                threading.Thread(target=self._dump_then_reap, args=(request,), daemon=True).start()
            elif kind == EV_REFUSED:
                self._refused(request, err)
            elif kind == EV_MALFORMED:
                logger.warning("Skipped a malformed timer request (%s): %r", detail, scope)
                self._emit("malformed request", None)
            elif kind == EV_EXITED:
                logger.info("Worker pid=%s exited with %d pending timer(s); cleared them", pid, err)
                self._emit("worker exited", None)
        if expired:
            log_debug_info_for_expired_timers(self._run_id, expired)

    def _dump_then_reap(self, request: FileTimerRequest) -> None:
        pid = request.worker_pid
        try:
            dump_stacks(pid, lambda p, s: self._wd.reap(p, s, False))
        except Exception:
            logger.exception("Stack dump of pid=%s failed; killing it anyway", pid)
        err = self._wd.reap(pid, request.signal)
        if err in (0, errno.ESRCH):
            logger.info(
                "Reaped worker pid=%s with signal=%s after dumping its stacks", pid, request.signal
            )
            self._emit("kill worker process", request)
        else:
            logger.error("Error reaping worker pid=%s: %s", pid, os.strerror(err))
