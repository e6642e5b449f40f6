"""Dumps a stuck worker's Python stacks before the watchdog kills it (py-spy or faulthandler)."""

from __future__ import annotations

import faulthandler
import logging
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable

__all__ = ["catches_signal", "dump_stacks", "enable_stack_dump"]

logger = logging.getLogger(__name__)

#: The signal a worker registers with ``faulthandler`` so the server can ask for its stacks.
DUMP_SIGNAL = signal.SIGUSR2


def enable_stack_dump(sig: int = DUMP_SIGNAL) -> None:
    """Call in a worker: on ``sig`` it writes every thread's stack to its stderr (its log).

    Args:
        sig: the signal to register; the server sends ``SIGUSR2`` by default.
    """
    faulthandler.register(sig, file=sys.stderr, all_threads=True, chain=False)


def catches_signal(pid: int, sig: int) -> bool:
    """Tells whether process ``pid`` has a handler installed for ``sig`` (``SigCgt`` mask)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except OSError:
        return False
    return False


def dump_stacks(
    pid: int,
    send_signal: Callable[[int, int], int],
    timeout: float = 10.0,
    grace: float = 0.5,
) -> str:
    """Dumps the stacks of ``pid``; returns how (``"py-spy"``, ``"faulthandler"`` or ``"none"``).

    With py-spy on PATH its output is logged here (the agent's log) at ERROR. Otherwise, if the
    worker registered ``DUMP_SIGNAL`` (``enable_stack_dump``), the signal makes the worker write
    its own stacks into its stderr; ``grace`` seconds are then allowed for the write to finish.

    Args:
        pid: the stuck worker.
        send_signal: ``(pid, sig) -> errno`` that signals through the server's pidfd.
        timeout: cap on py-spy's run time, seconds.
        grace: time given to faulthandler to write, seconds.
    """
    pyspy = shutil.which("py-spy")
    if pyspy is not None:
        try:
            out = subprocess.run(
                [pyspy, "dump", "--pid", str(pid)],
                capture_output=True,
                text=True,
                timeout=timeout,
                check=False,
            )
            logger.error(
                "Python stacks of stuck worker pid=%s (py-spy):\n%s%s", pid, out.stdout, out.stderr
            )
            return "py-spy"
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.warning("py-spy dump of pid=%s failed: %s", pid, e)
    if catches_signal(pid, DUMP_SIGNAL) and send_signal(pid, DUMP_SIGNAL) == 0:
        logger.error("Asked stuck worker pid=%s to write its Python stacks into its log", pid)
        time.sleep(grace)  # faulthandler gives no completion signal: a bounded policy grace
        return "faulthandler"
    logger.warning(
        "Cannot dump stacks of pid=%s: no py-spy and no faulthandler signal registered", pid
    )
    return "none"
