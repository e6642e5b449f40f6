"""Redirects a process's stdout or stderr to a file at the file-descriptor level (Linux), so
output from Python, C libraries and child processes all lands there (torch's ``redirects``)."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

__all__ = ["get_libc", "redirect", "redirect_stderr", "redirect_stdout"]

IS_WINDOWS = sys.platform == "win32"
IS_MACOS = sys.platform == "darwin"

logger = logging.getLogger(__name__)

_VALID_STD = {"stdout", "stderr"}


def get_libc() -> Any:
    """The C library (``None`` on macOS, where redirects are not supported)."""
    if IS_MACOS:
        logger.warning("NOTE: Redirects are currently not supported in MacOs.")
        return None
    return ctypes.CDLL("libc.so.6")


libc = get_libc()


@contextmanager
def redirect(std: str, to_file: str) -> Iterator[None]:
    """Inside the block, ``std`` (``"stdout"`` or ``"stderr"``) goes to ``to_file`` (truncated;
    its directory must exist): the file descriptor itself is replaced, so C code and child
    processes are redirected too. Buffers (Python's and C stdio's) are flushed at both ends.

    Raises:
        ValueError: ``std`` is neither ``"stdout"`` nor ``"stderr"``.
    """
    if std not in _VALID_STD:
        raise ValueError(f"unknown standard stream <{std}>, must be one of {_VALID_STD}")
    stream = getattr(sys, std)
    fd = stream.fileno()

    def flush() -> None:
        stream.flush()
        if libc is not None:
            libc.fflush(None)  # every C stdio stream

    saved = os.dup(fd)
    try:
        with open(to_file, "w+b") as dst:
            flush()
            os.dup2(dst.fileno(), fd)
            try:
                yield
            finally:
                flush()
                os.dup2(saved, fd)
    finally:
        os.close(saved)


redirect_stdout = partial(redirect, "stdout")
redirect_stderr = partial(redirect, "stderr")
