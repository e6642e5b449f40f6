"""The end of a fastrun: the failure report, and clear one-line errors for launch problems."""

from __future__ import annotations

import errno
import glob
import json
import logging
import os
import signal
import socket
import sys
from argparse import ArgumentParser
from collections.abc import Callable
from typing import Any

__all__ = ["format_failure_report", "run_and_report", "worker_traceback"]

_TAIL_LINES = 30


def _how(exitcode: int) -> str:
    """How a worker ended, as the report says it."""
    from fastelastic.multiprocessing.errors import EXITCODE_UNKNOWN

    if exitcode == EXITCODE_UNKNOWN:
        return "exit status unknown (nobody could report it)"
    sig = _signal_name(exitcode)
    return f"killed by {sig}" if sig else f"exit code {exitcode}"


def _signal_name(exitcode: int) -> str | None:
    if exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def _callstack_from_error_data(data: Any) -> str | None:
    """The worker's traceback from an error file written by ``@record`` (torch's layout)."""
    if not isinstance(data, dict):
        return None
    msg = data.get("message")
    if isinstance(msg, dict):
        extra = msg.get("extraInfo") or {}
        stack = extra.get("py_callstack")
        if stack:
            return str(stack).rstrip()
        return str(msg.get("message") or "") or None
    if isinstance(msg, str) and msg:
        return msg.rstrip()
    return None


def _tail(path: str, lines: int = _TAIL_LINES) -> str | None:
    """The last ``lines`` lines of ``path`` (reads at most 64 KiB from its end)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            data = f.read()
    except OSError:
        return None
    text = data.decode("utf-8", "replace").rstrip()
    if not text:
        return None
    return "\n".join(text.splitlines()[-lines:])


def _rank_log_dir(failure: Any, run_log_dir: str | None) -> str | None:
    """The directory holding the failed worker's error.json / stdout.log / stderr.log."""
    error_file = getattr(failure, "error_file", "") or ""
    if os.path.isabs(error_file) and os.path.isdir(os.path.dirname(error_file)):
        return os.path.dirname(error_file)
    if not run_log_dir:
        return None
    attempts = sorted(
        glob.glob(os.path.join(run_log_dir, "attempt_*")),
        key=lambda p: int(p.rsplit("_", 1)[-1]) if p.rsplit("_", 1)[-1].isdigit() else -1,
    )
    for attempt in reversed(attempts):
        cand = os.path.join(attempt, str(failure.local_rank))
        if os.path.isdir(cand):
            return cand
    return None


def worker_traceback(failure: Any, run_log_dir: str | None) -> tuple[str | None, str]:
    """Returns (traceback text or None, where it came from) for one ``ProcessFailure``."""
    error_file = getattr(failure, "error_file", "") or ""
    has_file = os.path.isabs(error_file) and os.path.isfile(error_file)
    stack = _callstack_from_error_data(failure.error_file_data) if has_file else None
    if stack:
        return stack, f"error file {failure.error_file}"
    tail = getattr(failure, "stderr_tail", None)
    if tail and tail.strip():
        tail = "\n".join(tail.rstrip().splitlines()[-_TAIL_LINES:])
        return tail, "no error file; last lines of the worker's stderr"
    rank_dir = _rank_log_dir(failure, run_log_dir)
    if rank_dir:
        stderr_log = os.path.join(rank_dir, "stderr.log")
        tail = _tail(stderr_log)
        if tail:
            return tail, f"last lines of {stderr_log}"
    return None, (
        "no traceback captured: decorate the worker's main with "
        "fastelastic.multiprocessing.errors.record (or torch's), or run with --tee 2"
    )


def format_failure_report(exc: Any, run_log_dir: str | None = None, host: str | None = None) -> str:
    """Formats the report for a ``ChildFailedError``.

    Args:
        exc: the ``ChildFailedError`` (``name`` and ``failures``: global rank -> ProcessFailure).
        run_log_dir: the job's log directory (``DefaultLogsSpecs`` run directory), if known.
        host: host name to print; defaults to this host's name.

    Returns:
        The multi-line report (no trailing newline).
    """
    host = host or socket.gethostname()
    rank, root = exc.get_first_failure()
    how = _how(root.exitcode)
    width = 78
    lines = [
        "=" * width,
        f"fastrun: {exc.name} FAILED",
        "-" * width,
        f"root cause : rank {rank} (local_rank {root.local_rank}) on host {host}",
    ]
    stopped_for = getattr(root, "stopped_for", None)
    if stopped_for:  # it never exited by itself: why the agent stopped it, where its stacks are
        lines.append(f"failure    : {stopped_for} (pid {root.pid}); stopped by the agent: {how}")
        stacks = getattr(root, "stacks_file", None)
        lines.append(f"stacks     : {stacks or 'none taken'}")
        stack, origin = None, ""
    else:
        lines.append(f"failure    : {how} (pid {root.pid})")
        stack, origin = worker_traceback(root, run_log_dir)
    if stack:
        lines.append(f"traceback  : ({origin})")
        lines.extend("  " + ln for ln in stack.splitlines())
    elif origin:
        lines.append(f"traceback  : {origin}")
    rank_dir = _rank_log_dir(root, run_log_dir)
    if rank_dir or run_log_dir:
        lines.append(f"logs       : {rank_dir or run_log_dir}")
    others = sorted(r for r in exc.failures if r != rank)
    for r in others:
        f = exc.failures[r]
        what = getattr(f, "stopped_for", None) or _how(f.exitcode)
        lines.append(f"also failed: rank {r} (local_rank {f.local_rank}) {what}")
    lines.append("=" * width)
    return "\n".join(lines)


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = e
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _store_error_line(e: BaseException) -> str | None:
    """A one-line explanation for address-in-use, unreachable-store and closed-rendezvous
    errors, else None."""
    from fastelastic.errors import (
        RendezvousClosedError,
        RendezvousConnectionError,
        StoreConnectionError,
    )

    for err in _chain(e):
        text = " ".join(str(err).split())
        if (isinstance(err, OSError) and err.errno == errno.EADDRINUSE) or (
            "already in use" in text.lower()
        ):
            return (
                f"{text} [fastrun: the port comes from --master-port (static) or "
                "--rdzv-endpoint; --standalone picks a free one]"
            )
    for err in _chain(e):
        text = " ".join(str(err).split())
        if isinstance(err, RendezvousClosedError):
            return (
                f"{text} [fastrun: the job ended on another node while this one was joining "
                "a round: a node whose workers failed with no restart left closes it (its "
                "report says why)]"
            )
        if isinstance(err, (StoreConnectionError, ConnectionRefusedError,
                            RendezvousConnectionError)):
            return (
                f"{text} [fastrun: the store address comes from --rdzv-endpoint, or "
                "--master-addr/--master-port for static; is the rank-0 node up?]"
            )
    return None


def _write_launcher_error_file(exc: Any) -> None:
    """Copies the root cause into this launcher's own error file, as torch's ``@record`` does."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    _, root = exc.get_first_failure()
    data = getattr(root, "error_file_data", None)
    if not data or not data.get("message"):
        return
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError as e:
        print(f"fastrun: could not write error file {path}: {e}", file=sys.stderr)


def run_and_report(fn: Callable[[], Any], parser: ArgumentParser) -> int:
    """Runs the launch ``fn`` and turns its outcome into an exit status and a final message.

    Returns:
        0 on success, 1 on a failed job, 2 on a configuration error, 128+N on signal N.
    """
    from fastelastic.errors import NumaBindingError
    from fastelastic.multiprocessing.api import SignalException
    from fastelastic.multiprocessing.errors import ChildFailedError

    try:
        fn()
    except ChildFailedError as e:
        _write_launcher_error_file(e)
        report = format_failure_report(e, getattr(e, "run_log_dir", None))
        print(report, file=sys.stderr, flush=True)
        return 1
    except SignalException as e:
        sig = getattr(e, "sigval", None)
        name = sig.name if isinstance(sig, signal.Signals) else str(sig)
        print(f"{parser.prog}: received {name}; workers were stopped", file=sys.stderr)
        return 128 + int(sig) if sig is not None else 1
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except NumaBindingError as e:  # torch's outcome (a failed launch), in one line
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        line = _store_error_line(e)
        if line is None:
            raise
        logging.getLogger(__name__).debug("launch failed", exc_info=True)
        print(f"{parser.prog}: error: {line}", file=sys.stderr)
        return 1
    return 0
