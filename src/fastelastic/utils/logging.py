"""``get_logger``: a logger named after its caller's module, at ``$LOGLEVEL`` (else WARNING);
``configure_cli_logging``: what the ``fastrun`` command prints of fastelastic's logs."""

from __future__ import annotations

import logging
import os
import sys
import time
import warnings

from fastelastic.utils.log_level import get_log_level

__all__ = ["configure_cli_logging", "get_logger"]


def get_logger(name: str | None = None) -> logging.Logger:
    """Returns the logger ``name`` (default: the calling module's name) at level ``$LOGLEVEL``,
    or ``get_log_level()`` when unset."""
    logger = logging.getLogger(name or _caller_module(2))
    logger.setLevel(os.environ.get("LOGLEVEL", get_log_level()))
    return logger


def _caller_module(depth: int) -> str | None:
    try:
        frame = sys._getframe(depth)
        name = frame.f_globals.get("__name__")
        if name:
            return str(name)
        return os.path.splitext(os.path.basename(frame.f_code.co_filename))[0]
    except Exception as e:  # a frame that deep does not exist
        warnings.warn(
            f"Error deriving logger module name, using <None>. Exception: {e}",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


class _GlogFormatter(logging.Formatter):
    """torchrun's line format: ``I1201 15:33:25.066000 21793 fastelastic/run.py:992] msg``,
    the prefix repeated on every line of a multi-line message."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            text = f"{text}\n{record.exc_text}"
        t = time.localtime(record.created)
        micros = int((record.created % 1) * 1e6)
        path = record.pathname
        cut = path.rfind(os.sep + "fastelastic" + os.sep)
        if cut >= 0:
            path = path[cut + 1:]
        prefix = (f"{record.levelname[:1]}{time.strftime('%m%d %H:%M:%S', t)}.{micros:06d} "
                  f"{record.process} {path}:{record.lineno}] ")
        return "\n".join(prefix + line for line in text.split("\n"))


def configure_cli_logging() -> None:
    """Prints fastelastic's log records on stderr at ``$LOGLEVEL`` (default WARNING), in
    torchrun's format, as torchrun does for torch's. For the command line only: a program that
    imports fastelastic keeps its own logging setup."""
    root = logging.getLogger("fastelastic")
    if any(isinstance(h.formatter, _GlogFormatter) for h in root.handlers):
        return  # called again in one process (fastrun's main from Python, tests)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_GlogFormatter())
    level = os.environ.get("LOGLEVEL")
    if level:
        try:
            handler.setLevel(level.upper())
            root.setLevel(level.upper())  # records below WARNING must be made to be printed
        except ValueError:
            print(f"fastrun: LOGLEVEL={level!r} is not a logging level; using WARNING",
                  file=sys.stderr)
            handler.setLevel(logging.WARNING)
    else:
        handler.setLevel(get_log_level())
    root.addHandler(handler)
