"""Owns the concrete process contexts (MultiprocessContext, SubprocessContext); torch's api.

Also re-exports what torch's ``api`` module exports (PContext, RunProcsResult, the log specs,
SignalException), so imports written against ``torch.distributed.elastic.multiprocessing.api``
work here unchanged.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastelastic.errors import SignalException
from fastelastic.multiprocessing._pcontext import (
    _KILL_GRACE_S,
    PContext,
    RunProcsResult,
    _validate_full_rank,  # noqa: F401 - start_processes imports it from here
)
from fastelastic.multiprocessing._pycommand import PythonCommand, python_command
from fastelastic.multiprocessing._worker import FdArg, worker_main
from fastelastic.multiprocessing.errors import ProcessFailure
from fastelastic.multiprocessing.logs import DefaultLogsSpecs, LogsDest, LogsSpecs, Std, to_map
from fastelastic.multiprocessing.subprocess_handler import (
    SubprocessHandler,
    get_subprocess_handler,
)
from fastelastic.numa import bind_local_ranks

__all__ = [  # torch's api module also exports the log specs and ProcessFailure; so do we
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "ProcessFailure",
    "Std",
    "to_map",
    "MultiprocessContext",
    "PContext",
    "RunProcsResult",
    "SignalException",
    "SubprocessContext",
]


class MultiprocessContext(PContext):
    """``PContext`` of worker processes running a function (start method spawn/fork/forkserver).

    Return values come back by local rank through files in a private directory; exceptions
    are recorded to the error file with ``@record`` automatically.
    """

    _stopped_are_failures = False  # as torch's: only the workers that failed

    def __init__(
        self,
        name: str,
        entrypoint: Callable,
        args: dict[int, tuple],
        envs: dict[int, dict[str, str]],
        start_method: str,
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        if start_method not in ("spawn", "fork", "forkserver"):
            raise ValueError(
                f"start_method must be spawn, fork or forkserver, got {start_method!r}"
            )
        super().__init__(
            name,
            entrypoint,
            args,
            envs,
            logs_specs,
            log_line_prefixes,
            duplicate_stdout_filters,
            duplicate_stderr_filters,
        )
        self.start_method = start_method
        self._numa_options = numa_options
        self.numa_cpus: dict[int, frozenset[int]] = {}  # local rank -> its CPUs (bound ranks)
        self._procs: dict[int, Any] = {}
        self._ret_dir = tempfile.mkdtemp(prefix="fastelastic-ret-")

    def _start(self) -> None:
        if self._procs:
            raise ValueError("The process context already started (start() called twice?)")
        self.numa_cpus = bind_local_ranks(self._numa_options, self.nprocs)
        ctx = mp.get_context(self.start_method)
        on_main = threading.current_thread() is threading.main_thread()
        reset: tuple[int, ...] = ()
        if self.start_method == "fork":
            reset = tuple(
                int(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
            )
        for rank in range(self.nprocs):
            with self._signals.step():  # started and watched, or not started
                self._start_rank(ctx, rank, on_main, reset)

    def _start_rank(self, ctx: Any, rank: int, on_main: bool, reset: tuple[int, ...]) -> None:
        out_fd, err_fd = self._child_stdio(rank)
        try:
            proc = ctx.Process(  # type: ignore[attr-defined]
                target=worker_main,
                args=(
                    self.entrypoint,
                    self.args[rank],
                    self.envs[rank],
                    FdArg(out_fd) if out_fd is not None else None,
                    FdArg(err_fd) if err_fd is not None else None,
                    os.path.join(self._ret_dir, f"{rank}.pkl"),
                    os.getpid(),
                    on_main and self.start_method != "forkserver",
                    reset,
                    self.numa_cpus.get(rank),
                    self.start_method == "spawn",  # fork/forkserver children end by os._exit
                ),
                name=f"{self.name}-{rank}",
                daemon=False,
            )
            proc.start()
        finally:
            for fd in (out_fd, err_fd):
                if fd is not None:
                    os.close(fd)
        self._procs[rank] = proc
        if self.start_method == "fork":
            try:
                os.setpgid(proc.pid, proc.pid)  # closes the race with the child's own call
            except OSError:
                pass
        self._track(rank, proc.pid)

    def _exitcode(self, rank: int, status: int | None) -> int | None:
        if status is not None:
            return status
        proc = self._procs[rank]  # forkserver: the fork server reaps and tells the Process
        proc.join(_KILL_GRACE_S)
        return proc.exitcode

    def _unknown_exit(self, rank: int) -> str:
        return (f"its {self.start_method} parent did not report its exit within "
                f"{_KILL_GRACE_S:g}s")

    def _return_values(self) -> dict[int, Any]:
        values: dict[int, Any] = {}
        for rank in range(self.nprocs):
            path = os.path.join(self._ret_dir, f"{rank}.pkl")
            try:
                with open(path, "rb") as f:
                    values[rank] = pickle.load(f)
            except FileNotFoundError:
                values[rank] = None  # exited 0 without returning (os._exit(0))
        return values

    def _reap(self) -> None:
        for rank, proc in self._procs.items():
            if rank in self._exitcodes:
                proc.join(0)
                proc.close()

    def _release(self) -> None:
        try:
            super()._release()
        finally:
            shutil.rmtree(self._ret_dir, ignore_errors=True)


def _close_fds(*fds: int | None) -> None:
    """Closes the parent's copies of a child's file descriptors (None: not opened)."""
    for fd in fds:
        if fd is not None:
            os.close(fd)


PLAIN_RUNNER_ENV = "FASTELASTIC_PLAIN_RUNNER"
_PLAIN_BOOT = str(Path(__file__).with_name("_plain_boot.py"))


def plain_command(entrypoint: str, args: tuple) -> tuple[str, tuple]:
    """The command that starts a plain worker: a Python worker (``python [-u] SCRIPT ARGS`` or
    ``-m MODULE ARGS``) runs through ``_plain_boot.py``, which runs the program as that
    interpreter would and ends it without the interpreter's teardown; any other command
    (``--no-python``, other interpreter options, a directory or zip to run) is unchanged, as
    is every command when the agent's ``FASTELASTIC_PLAIN_RUNNER`` is ``0``.
    """
    if os.environ.get(PLAIN_RUNNER_ENV, "1") == "0":
        return entrypoint, args
    cmd = python_command(entrypoint, args)
    if not isinstance(cmd, PythonCommand):
        return entrypoint, args
    target = ("-m", cmd.target) if cmd.module else (cmd.target,)
    return entrypoint, (*cmd.options, _PLAIN_BOOT, *target, *cmd.args)


class SubprocessContext(PContext):
    """``PContext`` of worker processes running a binary (args are converted with ``str``)."""

    def __init__(
        self,
        name: str,
        entrypoint: str,
        args: dict[int, tuple],
        envs: dict[int, dict[str, str]],
        logs_specs: LogsSpecs,
        log_line_prefixes: dict[int, str] | None = None,
        numa_options: Any = None,
        duplicate_stdout_filters: list[str] | None = None,
        duplicate_stderr_filters: list[str] | None = None,
    ) -> None:
        super().__init__(
            name,
            entrypoint,
            args,
            envs,
            logs_specs,
            log_line_prefixes,
            duplicate_stdout_filters,
            duplicate_stderr_filters,
        )
        self._numa_options = numa_options
        self.numa_cpus: dict[int, frozenset[int]] = {}  # local rank -> its CPUs (bound ranks)
        self.subprocess_handlers: dict[int, SubprocessHandler] = {}

    def _start(self) -> None:
        if self.subprocess_handlers:
            raise ValueError("The subprocess handlers already started (start() called twice?)")
        self.numa_cpus = bind_local_ranks(self._numa_options, self.nprocs)
        for rank in range(self.nprocs):
            with self._signals.step():  # started and watched, or not started
                out_fd, err_fd = self._child_stdio(rank)
                try:
                    pid = self._start_plain(rank, out_fd, err_fd)
                finally:
                    _close_fds(out_fd, err_fd)
                self._track(rank, pid)

    def _start_plain(self, rank: int, out_fd: int | None, err_fd: int | None) -> int:
        """Starts ``rank`` as a plain subprocess, keeps its handler and returns its pid."""
        from fastelastic.progress._launch import plain_start_env

        entrypoint, args = plain_command(str(self.entrypoint), self.args[rank])
        handler = get_subprocess_handler(
            entrypoint=entrypoint,
            args=args,
            env=plain_start_env(self.envs[rank], dict(os.environ)),
            stdout=out_fd,
            stderr=err_fd,
            local_rank_id=rank,
            numa_options=self._numa_options,
            cpus=self.numa_cpus.get(rank, frozenset()),
        )
        self.subprocess_handlers[rank] = handler
        return handler.proc.pid

    def _exitcode(self, rank: int, status: int | None) -> int | None:
        if status is not None:
            return status
        try:
            return self.subprocess_handlers[rank].proc.wait(_KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            return None

    def _unknown_exit(self, rank: int) -> str:
        return f"it was not reaped within {_KILL_GRACE_S:g}s of being seen gone"

    def _reap(self) -> None:
        for rank, handler in self.subprocess_handlers.items():
            if rank in self._exitcodes and handler.proc.returncode is None:
                handler.proc.wait(_KILL_GRACE_S)
