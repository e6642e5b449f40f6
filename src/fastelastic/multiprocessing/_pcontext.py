"""Owns PContext, the base of the process contexts, and RunProcsResult.

Every worker runs in its own process group and is watched through a pidfd by one
:class:`~fastelastic._native.procmon.PidfdMonitor`, so ``wait`` returns the moment a worker
exits instead of sleeping ``period``. Stopping signals whole groups (grandchildren too) and ends
with SIGKILL; a guardian process kills the groups if the agent itself dies. Each worker's
stderr always passes through the output pump, which keeps its tail for the failure report.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, TextIO

from fastelastic._native.procmon import PidfdMonitor
from fastelastic.errors import SignalException
from fastelastic.multiprocessing._guardian import guardian
from fastelastic.multiprocessing._pump import OutputPump, StdioRouter
from fastelastic.multiprocessing.errors import _NOT_AVAILABLE, EXITCODE_UNKNOWN, ProcessFailure
from fastelastic.multiprocessing.logs import LogsSpecs

__all__ = ["PContext", "RunProcsResult"]

logger = logging.getLogger(__name__)

SIGNALS_TO_HANDLE_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
# After SIGKILL a process exits at once unless it is in uninterruptible sleep; wait this long
# (TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT when set and positive) before reporting it.
UNINTERRUPTIBLE_STATE_TIMEOUT_ENV = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"
_KILL_GRACE_S = 5.0


def _kill_grace() -> float:
    try:
        value = float(os.environ.get(UNINTERRUPTIBLE_STATE_TIMEOUT_ENV, ""))
    except ValueError:
        return _KILL_GRACE_S
    return value if value > 0 else _KILL_GRACE_S


# How long a failure report waits for the failed worker's stderr to reach EOF.
_DRAIN_S = 2.0


def _open_pidfd(pid: int) -> int:
    """A pidfd of ``pid``, or -1 when it is gone (reaped) already."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return -1


def _unreaped(pidfd: int) -> bool:
    """True while the process behind ``pidfd`` is alive or a zombie (not reaped)."""
    if pidfd < 0:
        return False
    try:
        signal.pidfd_send_signal(pidfd, 0)
    except ProcessLookupError:
        return False
    return True


def _signal_exception(sig: signal.Signals) -> SignalException:
    return SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


def _terminate_process_handler(signum: int, frame: FrameType | None) -> None:
    """torch's handler: raises :class:`SignalException` wherever the main thread is."""
    raise _signal_exception(signal.Signals(signum))


class StopSignals:
    """The stop signals of one :class:`PContext` (its handler, installed by ``start()``).

    A signal only records itself and wakes the context's monitor while one of the context's
    own steps runs on the main thread (starting a worker, waiting, stopping): the step raises
    :class:`SignalException` at its end, so no bookkeeping is cut in half and no wait has to
    be retried. Anywhere else (the agent between calls: rendezvous, exit barrier) the handler
    raises at once, as torch's does.

    Only the main thread runs Python signal handlers, so only its steps defer; the state is
    read and written by the main thread alone (``received`` may be read by any thread).
    """

    def __init__(self, wake: Callable[[], None]) -> None:
        self._wake = wake
        self.received = 0  # stop signals handled since the context started
        self._pending: signal.Signals | None = None  # the first one not raised yet
        self._depth = 0  # main-thread steps of the context now running

    def handler(self, signum: int, frame: FrameType | None) -> None:
        sig = signal.Signals(signum)
        self.received += 1
        if self._depth == 0:
            raise _signal_exception(sig)
        if self._pending is None:
            self._pending = sig
        self._wake()

    @property
    def pending(self) -> signal.Signals | None:
        """The signal a running step will raise at its end (None if none came)."""
        return self._pending

    def raise_pending(self) -> None:
        """Raises the pending signal now (and forgets it)."""
        sig, self._pending = self._pending, None
        if sig is not None:
            raise _signal_exception(sig)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Runs one step of the context whole: a signal arriving meanwhile is raised at its end
        (the outermost step's, on the main thread; other threads do not defer signals)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._pending is not None:
                self.raise_pending()  # also when the step failed: the stop signal wins


def _default_handlers_in_child() -> None:
    """A forked worker (``start_method="fork"``) starts as a fresh interpreter would: the
    agent's stop-signal handler is not inherited, so SIGTERM ends the worker, not a
    SignalException raised inside multiprocessing's bootstrap."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        try:
            handler = signal.getsignal(sig)
            if handler is _terminate_process_handler or isinstance(
                getattr(handler, "__self__", None), StopSignals
            ):
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                              else signal.SIG_DFL)
        except (OSError, ValueError):
            continue


os.register_at_fork(after_in_child=_default_handlers_in_child)


def _validate_full_rank(d: dict[int, Any], nprocs: int, what: str) -> None:
    if set(d) != set(range(nprocs)):
        raise RuntimeError(
            f"{what}, local rank mapping mismatch, expected: {set(range(nprocs))}, actual: {set(d)}"
        )


@dataclass
class RunProcsResult:
    """Results of a finished run of processes, every field keyed by local rank.

    ``return_values`` is filled for functions (None per rank for binaries); ``stdouts`` and
    ``stderrs`` are the log file paths ("" when not redirected).
    """

    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)
    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """True if any process failed."""
        return len(self.failures) > 0


class PContext(abc.ABC):
    """A set of worker processes started together, one per local rank.

    Args:
        name: short name of the processes (used as the tee'd lines' header).
        entrypoint: a callable or a binary path.
        args: arguments by local rank.
        envs: extra environment variables by local rank.
        logs_specs: where output goes (see :class:`~fastelastic.multiprocessing.DefaultLogsSpecs`).
        log_line_prefixes: header of each tee'd line by local rank (default ``[{name}{rank}]:``).
        duplicate_stdout_filters: copy tee'd stdout lines containing any of these strings into
            the attempt's ``filtered_stdout.log``.
        duplicate_stderr_filters: the same for stderr.
    """

    # torch's SubprocessContext also reports the siblings it had to stop (e.g. exit code -15)
    # as failures; its MultiprocessContext (function entrypoints) only the failed ones.
    _stopped_are_failures = True

    def __init__(
        self,
        name: str,
        entrypoint: Callable | str,
        args: dict[int, tuple],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        self.name = name
        nprocs = len(args)
        dest = logs_specs.reify(envs)
        _validate_full_rank(dest.stdouts, nprocs, "stdouts")
        _validate_full_rank(dest.stderrs, nprocs, "stderrs")
        self.entrypoint = entrypoint
        self.args = args
        self.envs = envs
        self.stdouts = dest.stdouts
        self.stderrs = dest.stderrs
        self.error_files = dest.error_files
        self.nprocs = nprocs
        self.filtered_stdout: TextIO | None = None
        self.filtered_stderr: TextIO | None = None
        if duplicate_stdout_filters:
            self.filtered_stdout = open(dest.filtered_stdout, "w", errors="replace", buffering=1)  # noqa: SIM115
        if duplicate_stderr_filters:
            self.filtered_stderr = open(dest.filtered_stderr, "w", errors="replace", buffering=1)  # noqa: SIM115
        self._pump = OutputPump(name)
        self._router = StdioRouter(
            self._pump,
            dest,
            log_line_prefixes or {},
            name,
            (self.filtered_stdout, duplicate_stdout_filters),
            (self.filtered_stderr, duplicate_stderr_filters),
        )
        self._monitor: PidfdMonitor | None = None
        self._pids: dict[int, int] = {}  # local rank -> pid (== its process group id)
        # local rank -> a pidfd of its leader: while the leader is not reaped its pid, and so
        # its group id, cannot be reused, so signalling the group reaches only ours
        self._leader_fds: dict[int, int] = {}
        self._rank_of: dict[int, int] = {}
        self._exitcodes: dict[int, int | None] = {}  # None: the exit status is unknown
        self._resolving: set[int] = set()  # ranks whose exit is being read (outside _lock)
        self._failed_ranks: list[int] = []  # in the order their failures were observed
        self._exit_times: dict[int, float] = {}  # local rank -> time.time() its exit was seen
        self._exit_seq = 0
        self._seen_seq = 0
        # Guards the exit bookkeeping; held only for bookkeeping, never across a wait.
        self._lock = threading.RLock()
        self._closed = False
        self._signals = StopSignals(self.wakeup)
        self.stuck_pids: dict[int, str] = {}  # local rank -> psutil status after close

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        """Starts the processes (and, on the main thread, installs torch's signal handlers)."""
        if threading.current_thread() is threading.main_thread():
            names = os.environ.get(SIGNALS_TO_HANDLE_ENV, "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
            for sig_name in names.split(","):
                try:
                    signal.signal(getattr(signal, sig_name.strip()), self._signals.handler)
                except (AttributeError, ValueError, RuntimeError):
                    logger.warning("Failed to register signal handler for %s", sig_name)
        else:
            logger.info("not on the main thread: signal handlers not installed")
        self._monitor = PidfdMonitor()
        self._start()
        self._pump.start()

    @abc.abstractmethod
    def _start(self) -> None:
        """Starts the processes (context specific)."""

    def _child_stdio(self, rank: int) -> tuple[int | None, int | None]:
        """Returns the fds to install as the child's stdout/stderr (None = inherit ours)."""
        return self._router.child_fds(rank)

    def _track(self, rank: int, pid: int) -> None:
        """Watches a started worker (call it inside the ``_signals.step()`` that started it:
        a worker known but unwatched, or watched but unknown, must not be left behind)."""
        assert self._monitor is not None
        with self._lock:  # a collector in another thread maps the pid to its rank
            self._monitor.add(pid, reap=False)
            self._rank_of[pid] = rank
            self._pids[rank] = pid
            self._leader_fds[rank] = _open_pidfd(pid)
        guardian.register(pid)

    # ------------------------------------------------------------------ waiting

    def _collect(self, timeout: float | None) -> bool:
        """Records exits reported by the monitor within ``timeout``; True if any.

        An exit whose status the monitor could not read is asked of the worker's owner,
        which may take a while (``_exitcode``): that happens outside ``_lock``, so readers of
        the bookkeeping (the health check) never wait on it.
        """
        monitor = self._monitor
        if monitor is None or monitor.closed:
            return False
        try:
            events = monitor.wait(timeout)
        except (OSError, ValueError):
            if monitor.closed:  # close() from another thread while we waited
                return False
            raise
        todo: list[tuple[int, int | None]] = []
        with self._lock:
            for pid, status in events:
                self._claim(self._rank_of[pid], status, todo)
            # An exit the monitor reported to a caller that never recorded it (interrupted
            # by an exception) is no longer watched. The worker is a zombie until its owner
            # reaps it, so watching it again reports its exit at the next wait; one already
            # reaped is asked of its owner.
            for rank, pid in self._pids.items():
                if (rank not in self._exitcodes and rank not in self._resolving
                        and pid not in monitor and not monitor.closed):
                    try:
                        monitor.add(pid, reap=False)
                    except ProcessLookupError:  # gone already
                        self._claim(rank, None, todo)
        try:
            for rank, status in todo:
                code = self._exitcode(rank, status)  # may block: not under _lock
                if code is None:
                    logger.warning("worker %s (local_rank %s) is gone; its exit status is "
                                   "unknown: %s", self._pids[rank], rank, self._unknown_exit(rank))
                with self._lock:
                    self._record_exit(rank, code)
        finally:
            with self._lock:
                self._resolving.difference_update(r for r, _ in todo)
        return bool(events)

    def _claim(self, rank: int, status: int | None, todo: list) -> None:
        """Makes this caller the one that records ``rank``'s exit (under ``_lock``)."""
        if rank not in self._exitcodes and rank not in self._resolving:
            self._resolving.add(rank)
            todo.append((rank, status))

    def _record_exit(self, rank: int, code: int | None) -> None:
        if rank in self._exitcodes:
            return
        self._exitcodes[rank] = code
        self._exit_times[rank] = time.time()
        self._exit_seq += 1
        if code != 0 and not self._closed:
            self._failed_ranks.append(rank)

    @abc.abstractmethod
    def _exitcode(self, rank: int, status: int | None) -> int | None:
        """The exit code of ``rank`` given the status the monitor peeked (None: ask the owner).

        Returns None when the owner does not tell it in time: the status is unknown.
        """

    def _unknown_exit(self, rank: int) -> str:
        """Why the exit status of ``rank`` is unknown (for its failure report)."""
        return (f"the worker is not this process's child and its status was not reported "
                f"within {_KILL_GRACE_S:g}s")

    def wait_any(self, timeout: float | None = None) -> bool:
        """Blocks until a worker exits, ``wakeup()`` is called or ``timeout`` seconds pass.

        An exit counts once: after this returned True for it, the next call blocks again.
        Follow a True with ``wait(0)`` to get the result (None while others still run).

        Returns:
            True if at least one worker exited since the previous ``wait_any``.
        """
        with self._signals.step():
            if self._exit_seq == self._seen_seq:
                self._collect(timeout)
            with self._lock:
                fresh = self._exit_seq != self._seen_seq
                self._seen_seq = self._exit_seq
        return fresh

    def wakeup(self) -> None:
        """Makes a ``wait``/``wait_any`` blocked in another thread return now."""
        if self._monitor is not None:
            self._monitor.wakeup()

    def fileno(self) -> int:
        """An fd that is readable when a worker exit is pending (for select/epoll loops)."""
        if self._monitor is None:
            raise RuntimeError("process context not started")
        return self._monitor.fileno()

    def wait(self, timeout: float = -1, period: float = 1) -> RunProcsResult | None:
        """Waits up to ``timeout`` s for all processes to finish or any to fail.

        Returns the moment the outcome is known (``period`` is accepted for torch
        compatibility and ignored: nothing is polled).

        Args:
            timeout: seconds; negative waits forever, 0 only checks.
            period: ignored.

        Returns:
            The result, or None if processes are still running at the timeout.
        """
        if self._monitor is None:
            raise RuntimeError("process context not started: call start() first")
        deadline = None if timeout < 0 else time.monotonic() + timeout
        with self._signals.step():
            while True:
                result = self._poll()
                if result is not None or self._closed:
                    return result
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._collect(remaining)  # returns early when a signal woke the monitor
                self._signals.raise_pending()

    def _poll(self) -> RunProcsResult | None:
        self._collect(0)
        with self._lock:
            failed = list(self._failed_ranks)
            done = len(self._exitcodes) == self.nprocs
            if not failed and done and self._closed:
                # stopped by close(): the processes we killed are the failures, as in torch
                failed = [r for r, code in sorted(self._exitcodes.items()) if code != 0]
        if failed:
            self.close()
            if self._stopped_are_failures:
                with self._lock:
                    failed += [r for r, code in sorted(self._exitcodes.items())
                               if code != 0 and r not in failed]
            failures = {}  # the first observed failure first: it wins timestamp ties
            for rank in failed:
                sink = self._router.stderr_sinks.get(rank)
                code = self._exitcodes[rank]
                failures[rank] = f = ProcessFailure(
                    local_rank=rank,
                    pid=self._pids[rank],
                    exitcode=EXITCODE_UNKNOWN if code is None else code,
                    error_file=self.error_files.get(rank, ""),
                    stderr_tail=sink.tail_text() if sink is not None else None,
                    unknown_exit=self._unknown_exit(rank) if code is None else None,
                )
                if f.error_file == _NOT_AVAILABLE and rank in self._exit_times:
                    f.timestamp = int(self._exit_times[rank])  # when it exited, not now
            first = failures[failed[0]]
            logger.error(
                "failed (exitcode: %s) local_rank: %s (pid: %s) of %s",
                first.exitcode,
                first.local_rank,
                first.pid,
                self._entrypoint_name(),
            )
            return RunProcsResult(failures=failures, stdouts=self.stdouts, stderrs=self.stderrs)
        if done:
            values = self._return_values()
            self.close()
            return RunProcsResult(return_values=values, stdouts=self.stdouts, stderrs=self.stderrs)
        return None

    def _return_values(self) -> dict[int, Any]:
        return dict.fromkeys(range(self.nprocs))

    def _entrypoint_name(self) -> str:
        ep = self.entrypoint
        return ep if isinstance(ep, str) else getattr(ep, "__qualname__", repr(ep))

    def pids(self) -> dict[int, int]:
        """The pids of the processes by local rank."""
        return dict(self._pids)

    def exitcodes(self) -> dict[int, int | None]:
        """Exit codes (``-signal`` if killed) of the processes that have exited, by local rank."""
        with self._lock:
            return dict(self._exitcodes)

    def worker_states(self) -> dict[int, str]:
        """psutil status of each live process by local rank (``disk-sleep`` = uninterruptible)."""
        import psutil  # type: ignore[import-untyped]

        states = {}
        for rank, pid in self._pids.items():
            if rank in self._exitcodes:
                continue
            try:
                states[rank] = psutil.Process(pid).status()
            except psutil.Error:
                continue
        return states

    # ------------------------------------------------------------------ stopping

    def _signal_group(self, rank: int, sig: int) -> None:
        """Signals rank's process group (grandchildren too), only while the group is provably
        ours: its leader is alive or a zombie nobody reaped (the zygote reaps its workers only
        once ``_reap`` says so; plain workers are reaped by ``_reap`` itself)."""
        pid = self._pids[rank]
        if not _unreaped(self._leader_fds.get(rank, -1)):
            logger.debug("process group %s not signalled: its leader was reaped, so the id may "
                         "be another group's now", pid)
            return
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            # not a group leader yet (spawned child before its setpgid): signal it directly
            if self._monitor is not None and pid in self._monitor:
                try:
                    self._monitor.send_signal(pid, sig)
                except ProcessLookupError:
                    pass
        except PermissionError:
            logger.warning("no permission to signal process group %s", pid)

    def _wait_ranks(self, ranks: set[int], deadline: float, signals_seen: int = -1,
                    exits: dict[int, float] | None = None) -> set[int]:
        """Waits (event driven) until ``ranks`` exited or ``deadline``; returns the alive ones.

        With ``signals_seen`` >= 0 it also returns once more stop signals than that came;
        ``exits`` gets the time (monotonic) each rank was seen gone.
        """
        while True:
            with self._lock:
                alive = {r for r in ranks if r not in self._exitcodes}
            now = time.monotonic()
            if exits is not None:
                for r in ranks - alive:
                    exits.setdefault(r, now)
            remaining = deadline - now
            if not alive or remaining <= 0:
                return alive
            if 0 <= signals_seen < self._signals.received:
                return alive
            self._collect(remaining)

    def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
        """Stops every process group: ``death_sig``, then SIGKILL after ``timeout`` seconds.

        Each worker's whole process group is signalled, so grandchildren stop too; once the
        workers are gone, any group member still alive is SIGKILLed. A worker that survives
        SIGKILL (uninterruptible sleep) is logged and listed in ``stuck_pids`` instead of
        hanging the caller. Safe to call more than once.

        Every group is SIGKILLed before it is forgotten, whatever happens meanwhile: a stop
        signal arriving (a second Ctrl-C) only ends the wait for a graceful exit, and is raised
        once the groups are gone; any other exception is re-raised after a SIGKILL sweep.

        Args:
            death_sig: the first signal (SIGTERM by default).
            timeout: seconds to wait for the processes before SIGKILL.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        sig = death_sig if death_sig else signal.SIGTERM
        with self._signals.step():
            if self._signals.received >= 2:
                timeout = 0  # a second signal came before the stop began: no graceful wait
            try:
                self._stop_processes(sig, timeout)
            except BaseException:
                self._sweep()  # whatever cut the stop short, no group outlives it
                raise
            finally:
                self._release()

    def _sweep(self) -> None:
        """SIGKILLs every group and waits (bounded) for the leaders."""
        if self._monitor is None:
            return
        for rank in self._pids:
            self._signal_group(rank, signal.SIGKILL)
        for rank in self._wait_ranks(set(self._pids), time.monotonic() + _kill_grace()):
            self.stuck_pids[rank] = "unknown"
        self._forget_dead()
        self._reap()

    def _stop_processes(self, sig: int, timeout: float) -> None:
        if self._monitor is None:
            return
        self._collect(0)
        with self._lock:
            alive = {r for r in self._pids if r not in self._exitcodes}
        for rank in sorted(alive):
            logger.info(
                "Sending process %s closing signal %s", self._pids[rank], signal.Signals(sig).name
            )
            self._signal_group(rank, sig)
        seen = self._signals.received
        start, exits = time.monotonic(), dict[int, float]()
        signalled = sorted(alive)
        alive = self._wait_ranks(alive, start + max(timeout, 0), signals_seen=seen, exits=exits)
        if signalled and logger.isEnabledFor(logging.INFO):  # how long each took to die
            logger.info("Stopped by %s: %s", signal.Signals(sig).name, ", ".join(
                f"pid {self._pids[r]} in {exits[r] - start:.3f}s (exit {self._exitcodes.get(r)})"
                if r in exits else f"pid {self._pids[r]} still alive" for r in signalled))
        if alive and self._signals.received > seen:  # a second signal: no graceful exit
            name = getattr(self._signals.pending, "name", "a signal")
            logger.warning("%s during shutdown: SIGKILLing the workers now", name)
        else:
            for rank in sorted(alive):
                logger.warning(
                    "Unable to shutdown process %s via %s, forcefully exiting via SIGKILL",
                    self._pids[rank],
                    signal.Signals(sig).name,
                )
        # SIGKILL every group: the stragglers, and grandchildren left behind by exited workers
        for rank in self._pids:
            self._signal_group(rank, signal.SIGKILL)
        grace = _kill_grace()
        alive = self._wait_ranks(alive, time.monotonic() + grace)
        if alive:
            states = self.worker_states()
            for rank in alive:
                state = states.get(rank, "unknown")
                self.stuck_pids[rank] = state
                logger.error(
                    "Process %s (local_rank %s) did not exit after SIGKILL within %ss (state: %s);"
                    " abandoning it. It may be in uninterruptible kernel sleep.",
                    self._pids[rank],
                    rank,
                    grace,
                    state,
                )
        self._forget_dead()
        self._reap()

    @abc.abstractmethod
    def _reap(self) -> None:
        """Reaps the exited processes (context specific)."""

    def _forget_dead(self) -> None:
        """Takes the groups known dead and SIGKILLed off the guardian's list, before their
        leaders are reaped (after it the guardian could no longer prove a group ours)."""
        for rank, pid in self._pids.items():
            if rank not in self.stuck_pids and rank in self._exitcodes:
                guardian.unregister(pid)

    def _release(self) -> None:
        self._forget_dead()  # idempotent: after a stop that was cut short too
        for fd in self._leader_fds.values():
            if fd >= 0:
                os.close(fd)
        self._leader_fds.clear()
        # a survivor keeps its pipes open: waiting for their EOF would only add _DRAIN_S
        if not self._pump.drain(0.2 if self.stuck_pids else _DRAIN_S):
            self._pump.stop()
        if self._monitor is not None:
            self._monitor.close()
        for f in (self.filtered_stdout, self.filtered_stderr):
            if f is not None:
                f.close()
