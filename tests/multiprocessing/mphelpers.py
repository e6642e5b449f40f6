"""Helpers for the multiprocessing tests: bounded waits on real process exits (pidfd)."""

from __future__ import annotations

import os
import select
import time


def wait_gone(pid: int, timeout: float) -> bool:
    """True if process ``pid`` is gone (exited) within ``timeout`` s; pidfd poll, no sleeps."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        p = select.poll()
        p.register(fd, select.POLLIN)
        return bool(p.poll(timeout * 1000))
    finally:
        os.close(fd)


def is_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def read_line(fd: int, timeout: float) -> bytes:
    """Reads one line from a pipe within ``timeout`` s (select-bounded)."""
    deadline = time.monotonic() + timeout
    buf = b""
    while not buf.endswith(b"\n"):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no full line within {timeout}s (got {buf!r})")
        r, _, _ = select.select([fd], [], [], remaining)
        if r:
            chunk = os.read(fd, 1)
            if not chunk:
                raise EOFError(f"pipe closed after {buf!r}")
            buf += chunk
    return buf


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))
