"""Starts and watches worker processes: torch's ``torch.distributed.elastic.multiprocessing``.

:func:`start_processes` launches ``n`` copies of a function or a binary and returns a
:class:`PContext`; ``pcontext.wait()`` returns the moment a worker exits (pidfd monitor, no
polling) and ``pcontext.close()`` stops whole process groups. See ``api.py`` for the details.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable
from typing import Any

from fastelastic.errors import SignalException
from fastelastic.multiprocessing.api import (
    MultiprocessContext,
    PContext,
    RunProcsResult,
    SubprocessContext,
    _validate_full_rank,
)
from fastelastic.multiprocessing.errors import ProcessFailure
from fastelastic.multiprocessing.logs import (
    DefaultLogsSpecs,
    LogsDest,
    LogsSpecs,
    Std,
    to_map,
)

_logger = logging.getLogger(__name__)

__all__ = [
    "DefaultLogsSpecs",
    "LogsDest",
    "LogsSpecs",
    "MultiprocessContext",
    "PContext",
    "ProcessFailure",
    "RunProcsResult",
    "SignalException",
    "Std",
    "SubprocessContext",
    "start_processes",
    "to_map",
]


def start_processes(
    name: str,
    entrypoint: Callable | str,
    args: dict[int, tuple],
    envs: dict[int, dict[str, str]],
    logs_specs: LogsSpecs,
    log_line_prefixes: dict[int, str] | None = None,
    start_method: str = "spawn",
    numa_options: Any = None,
    duplicate_stdout_filters: list[str] | None = None,
    duplicate_stderr_filters: list[str] | None = None,
    zygote: Any = None,
) -> PContext:
    """Starts one copy of ``entrypoint`` per local rank and returns the running context.

    ``args`` and ``envs`` are keyed by local rank and must cover ``0..n-1``. A callable runs in
    a child started with ``start_method`` (its return value is collected); a ``str`` is a binary
    run with ``str()`` of each argument (``start_method`` is ignored). Each child runs in its
    own process group, dies with this process (guardian and parent-death signal), and has
    ``TORCHELASTIC_ERROR_FILE`` set by ``logs_specs``.

    Args:
        name: short human-readable name of the processes (header of tee'd lines).
        entrypoint: a function or the path of a binary.
        args: arguments by local rank.
        envs: environment variables by local rank (added to this process's environment).
        logs_specs: log destinations: ``log_dir``, ``redirects``, ``tee``.
        log_line_prefixes: header of tee'd lines by local rank.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (functions only).
        numa_options: NUMA binding (torch's ``NumaOptions`` or ours, or a mode name): local
            rank ``i`` runs on the CPUs torch would choose for GPU ``i`` (see
            :mod:`fastelastic.numa`); the chosen sets are the context's ``numa_cpus``.
        duplicate_stdout_filters: copy matching tee'd stdout lines to ``filtered_stdout.log``.
        duplicate_stderr_filters: copy matching tee'd stderr lines to ``filtered_stderr.log``.
        zygote: a started :class:`~fastelastic.multiprocessing._zygote.Zygote` (fastelastic):
            a Python command it can run is forked by it instead of started plainly.

    Returns:
        A started :class:`MultiprocessContext` (function) or :class:`SubprocessContext` (binary).

    Raises:
        RuntimeError: ``args`` or ``envs`` do not cover every local rank.
        NumaBindingError: a worker cannot be bound (and no fallback); nothing was started.
        ValueError: unknown ``start_method``.
    """
    nprocs = len(args)
    _validate_full_rank(args, nprocs, "args")
    _validate_full_rank(envs, nprocs, "envs")
    context: PContext
    if zygote is not None and _zygote_runs(zygote, entrypoint, args[0]):
        from fastelastic.multiprocessing._zygote import ZygoteContext

        context = ZygoteContext(
            zygote,
            name=name,
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            logs_specs=logs_specs,
            log_line_prefixes=log_line_prefixes,
            numa_options=numa_options,
            duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
    elif isinstance(entrypoint, str):
        context = SubprocessContext(
            name=name,
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            logs_specs=logs_specs,
            log_line_prefixes=log_line_prefixes,
            numa_options=numa_options,
            duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
    else:
        context = MultiprocessContext(
            name=name,
            entrypoint=entrypoint,
            args=args,
            envs=envs,
            start_method=start_method,
            logs_specs=logs_specs,
            log_line_prefixes=log_line_prefixes,
            numa_options=numa_options,
            duplicate_stdout_filters=duplicate_stdout_filters,
            duplicate_stderr_filters=duplicate_stderr_filters,
        )
    try:
        context.start()
    except SignalException as e:
        # Ctrl-C or SIGTERM while starting: the workers started so far are stopped as the
        # agent stops running workers (the same signal, then SIGKILL after the grace period;
        # a second signal hurries it), then the signal goes on to the agent.
        _logger.warning("Received %s death signal while starting workers, shutting them down",
                        e.sigval)
        context.close(signal.Signals(int(e.sigval)))  # type: ignore[call-overload]
        raise
    except BaseException:
        # a start that failed leaves nothing behind, at once
        context.close(signal.SIGKILL, 0)
        raise
    return context


def _zygote_runs(zygote: Any, entrypoint: Callable | str, args: tuple) -> bool:
    """True if ``zygote`` can fork this Python command (same interpreter, options, path)."""
    from fastelastic.multiprocessing._pycommand import PythonCommand, python_command

    cmd = python_command(entrypoint, args)
    return isinstance(cmd, PythonCommand) and bool(zygote.matches(cmd))
