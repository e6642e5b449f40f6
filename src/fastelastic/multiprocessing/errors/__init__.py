"""Owns worker failure reporting: ProcessFailure, record, and the ChildFailedError re-export.

The error-file JSON is torch's, so a worker decorated with torch's ``@record`` reports to our
agent and one decorated with ours reports to torch's. Without ``@record`` (or when the worker
died before it could write the file) :class:`ProcessFailure` shows the tail of the worker's
stderr instead, so the traceback still reaches the user.
"""

from __future__ import annotations

import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from functools import wraps
from typing import Any, TypeVar

from fastelastic.errors import ChildFailedError
from fastelastic.multiprocessing.errors.error_handler import ErrorHandler
from fastelastic.multiprocessing.errors.handlers import get_error_handler

__all__ = [
    "EXITCODE_UNKNOWN",
    "ChildFailedError",
    "ErrorHandler",
    "ProcessFailure",
    "get_error_handler",
    "record",
]

logger = logging.getLogger(__name__)

JSON = dict[str, Any]
GlobalRank = int
_NOT_AVAILABLE = "<N/A>"
# ProcessFailure.exitcode of a worker that is gone but whose exit status could not be learnt
# (its owner, the zygote or the fork server, did not report it): no process exits with 256,
# and it is not a -signal. The failure's message says why the status is unknown.
EXITCODE_UNKNOWN = 256
_R = TypeVar("_R")


@dataclass
class ProcessFailure:
    """A failed worker process, with the root cause read from its error file.

    The message and timestamp come from ``error_file`` when the worker wrote one (``@record``).
    Otherwise the timestamp is now and the message is the signal that killed the worker or,
    when given, the tail of the worker's stderr (which holds Python's traceback).

    Args:
        local_rank: the worker's local rank.
        pid: the worker's pid.
        exitcode: exit code, ``-signal`` if killed by a signal, or :data:`EXITCODE_UNKNOWN`
            when the worker is gone but its exit status could not be learnt.
        error_file: path of the worker's error file (need not exist).
        stderr_tail: the last lines the worker wrote to stderr, used when there is no file.
        unknown_exit: with ``EXITCODE_UNKNOWN``, why the status is unknown (in the message).
        stopped_for: why the agent stopped a worker that had not exited (a hang verdict, a
            D-state timeout, with no restart left); the message then says it first.
        stacks_file: where the stacks of such a worker were written, when they were.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    stderr_tail: str | None = None
    unknown_exit: str | None = None
    stopped_for: str | None = None
    stacks_file: str | None = None
    error_file_data: JSON = field(init=False)
    message: Any = field(init=False)
    timestamp: int = field(init=False)

    def __post_init__(self) -> None:
        self.error_file_data = {"message": "<NONE>"}
        self.message = ""
        data = self._read_error_file()
        if data is not None:
            self.error_file_data = data
            self.message, self.timestamp = self._get_error_data(data)
        else:
            self.error_file = _NOT_AVAILABLE
            self.timestamp = int(time.time())
        if not self.message:
            self.message = self._synthesize_message()

    def _read_error_file(self) -> JSON | None:
        try:
            with open(self.error_file) as fp:
                text = fp.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        except OSError:
            logger.exception("Failed to read reply file: %s", self.error_file)
            return None
        if not text.strip():
            return None  # the worker died while writing it
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            logger.exception("Failed to parse reply file: %s", self.error_file)
            return None
        return data if isinstance(data, dict) and "message" in data else None

    def _synthesize_message(self) -> str:
        parts = [self.stopped_for] if self.stopped_for else []
        if self.exitcode == EXITCODE_UNKNOWN:
            parts.append(
                f"exit status of PID {self.pid} unknown: {self.unknown_exit or 'not reported'}"
            )
        elif self.exitcode < 0:
            parts.append(
                f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
            )
        elif not self.stderr_tail:
            self.error_file_data["errorTraits"] = {
                "category": "system_terminated_error",
                "retryability": "False",
            }
            parts.append(
                "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
            )
        if self.stderr_tail:
            parts.append(
                "(no error file; last lines of the worker's stderr follow)\n" + self.stderr_tail
            )
        return "\n".join(parts)

    @staticmethod
    def _get_error_data(error_file_data: JSON) -> tuple[Any, int]:
        message = error_file_data["message"]
        if isinstance(message, str):
            return message, int(error_file_data.get("timestamp", 0))
        return message, int(message["extraInfo"]["timestamp"])

    def signal_name(self) -> str:
        """The name of the signal that killed the worker, or ``<N/A>``."""
        if self.exitcode < 0:
            try:
                return signal.Signals(-self.exitcode).name
            except ValueError:
                return _NOT_AVAILABLE
        return _NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """The failure time as ``YYYY-MM-DD_HH:MM:SS``."""
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")


def record(
    fn: Callable[..., _R], error_handler: ErrorHandler | None = None
) -> Callable[..., _R | None]:
    """Decorates a worker's main function to write its uncaught exception to the error file.

    Equivalent to torch's ``@record``: ``SystemExit(0)`` returns None; a ``ChildFailedError``
    (the function is itself an agent) copies the root cause's error file into ours; any
    other exception is recorded with its traceback and re-raised.

    Args:
        fn: the function to wrap.
        error_handler: the handler; :func:`get_error_handler` by default.

    Returns:
        The wrapped function.
    """
    handler = error_handler if error_handler is not None else get_error_handler()

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> _R | None:
        handler.initialize()
        try:
            return fn(*args, **kwargs)
        except SystemExit as se:
            if se.code == 0:
                return None
            raise
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.error_file != _NOT_AVAILABLE:
                handler.dump_error_file(failure.error_file, failure.exitcode)
            else:
                logger.info(
                    "local_rank %s FAILED with no error file. Decorate your entrypoint fn "
                    "with @record for traceback info.",
                    rank,
                )
            raise
        except Exception as e:
            handler.record_exception(e)
            raise

    return wrapper
