"""Owns the guardian: a tiny process that SIGKILLs our worker groups if this process dies.

Each agent process starts one guardian lazily (``python -I -S -c``, no fastelastic import, own
session so terminal signals and group kills aimed at the agent do not reach it). The agent
holds the only write end of a pipe whose read end is the guardian's stdin, and sends
``+pid``/``-pid`` lines as worker groups start and are cleaned up. When the agent exits or is
SIGKILLed the kernel closes the write end; the guardian reads EOF and SIGKILLs every process
group still registered whose leader is not reaped yet (grandchildren included: while the leader
is unreaped its pid, so its group id, cannot be reused; the agent unregisters a group before
it reaps it) and each leader through a pidfd (in case it had not become a group leader yet),
then exits. Forked children close their inherited copy of
the write end (``os.register_at_fork``) so they cannot keep the pipe open.

The handle keeps the set of registered pids: a guardian that died (killed by someone) is
replaced at the next registration, and the new one is told every pid still registered, so a
group registered with the old one is still killed if the agent dies.
"""

from __future__ import annotations

import atexit
import logging
import os
import subprocess
import sys
import threading

logger = logging.getLogger(__name__)

_GUARDIAN_CODE = r"""
import os, signal
for s in (signal.SIGHUP, signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
    signal.signal(s, signal.SIG_IGN)
groups = {}
buf = b""
while True:
    chunk = os.read(0, 65536)
    if not chunk:
        break
    buf += chunk
    *lines, buf = buf.split(b"\n")
    for line in lines:
        if len(line) < 2:
            continue
        pid = int(line[1:])
        if line[:1] == b"+":
            try:
                groups[pid] = os.pidfd_open(pid)
            except OSError:
                groups[pid] = -1
        else:
            fd = groups.pop(pid, -1)
            if fd >= 0:
                os.close(fd)
for pid, fd in groups.items():
    try:  # the group only while its leader is unreaped: its id cannot be another's then
        if fd >= 0:
            signal.pidfd_send_signal(fd, 0)
            os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    if fd >= 0:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except OSError:
            pass
"""


class _Guardian:
    """The agent-side handle of the guardian process (one per agent process, thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._wfd = -1
        self._owner = os.getpid()
        self._live: dict[int, None] = {}  # registered pids, in registration order

    def _start_locked(self) -> None:
        rfd, wfd = os.pipe()  # both non-inheritable; the child gets rfd as its stdin only
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _GUARDIAN_CODE],
                stdin=rfd,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
        except BaseException:
            os.close(wfd)
            raise
        finally:
            os.close(rfd)
        self._wfd = wfd
        self._owner = os.getpid()

    def _send(self, pid: int, add: bool) -> None:
        with self._lock:
            if self._owner != os.getpid():
                self._wfd = -1
                self._proc = None
                self._live.clear()
            if add:
                self._live[pid] = None
            elif pid in self._live:
                del self._live[pid]
            else:
                return  # not registered (or unregistered already): nothing to say
            if self._wfd < 0 or (self._proc is not None and self._proc.poll() is not None):
                if self._wfd >= 0:
                    logger.warning("worker guardian exited; starting a new one")
                    os.close(self._wfd)
                    self._wfd = -1
                if not self._live:
                    return
                self._start_locked()
                # the new guardian learns every pid still registered (the old one's too)
                lines = b"".join(b"+%d\n" % p for p in self._live)
            else:
                lines = (b"+" if add else b"-") + b"%d\n" % pid
            os.write(self._wfd, lines)

    def register(self, pid: int) -> None:
        """Makes the guardian SIGKILL process group ``pid`` (and pid itself) if we die."""
        self._send(pid, True)

    def unregister(self, pid: int) -> None:
        """Forgets process group ``pid`` (its workers were stopped by us)."""
        try:
            self._send(pid, False)
        except OSError:
            logger.warning("could not unregister pid %s from the guardian", pid, exc_info=True)

    @property
    def pid(self) -> int | None:
        """The guardian's pid, or None before the first registration."""
        return self._proc.pid if self._proc is not None else None

    def _after_fork_in_child(self) -> None:
        if self._wfd >= 0:
            try:
                os.close(self._wfd)
            except OSError:
                pass
        self._wfd = -1
        self._proc = None
        self._live = {}
        self._lock = threading.Lock()

    def shutdown(self) -> None:
        """Closes the pipe (the guardian kills what is still registered and exits)."""
        with self._lock:
            if self._wfd >= 0 and self._owner == os.getpid():
                os.close(self._wfd)
                self._wfd = -1
                self._live.clear()  # the guardian kills them all now
                if self._proc is not None:
                    try:
                        self._proc.wait(5)
                    except subprocess.TimeoutExpired:
                        logger.warning("worker guardian %s did not exit", self._proc.pid)
                self._proc = None


guardian = _Guardian()
os.register_at_fork(after_in_child=guardian._after_fork_in_child)
atexit.register(guardian.shutdown)
