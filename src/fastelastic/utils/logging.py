"""``get_logger``: a logger named after its caller's module, at ``$LOGLEVEL`` (else WARNING)."""

from __future__ import annotations

import logging
import os
import sys
import warnings

from fastelastic.utils.log_level import get_log_level

__all__ = ["get_logger"]


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
