"""Owns the child side of a callable worker: process group, stdio, environment, return value."""

from __future__ import annotations

import os
import pickle
import signal
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import Any

from fastelastic._native.procmon import set_pdeathsig
from fastelastic.multiprocessing.errors import record


class FdArg:
    """An fd handed to a worker: pickled for spawn/forkserver so the child receives a copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> FdArg:
    return FdArg(dup.detach())


def _rebind(name: str, fd: int) -> None:
    """Points ``sys.<name>`` at ``fd`` if it writes elsewhere (a forked parent's replacement)."""
    stream = getattr(sys, name)
    try:
        ok = stream is not None and stream.fileno() == fd
    except (OSError, ValueError, AttributeError):
        ok = False
    if not ok:
        setattr(sys, name, open(fd, "w", buffering=1, closefd=False, errors="backslashreplace"))  # noqa: SIM115


def bind_all_threads(cpus: frozenset[int]) -> None:
    """Binds this process's threads to ``cpus``: the calling one, and every other one that
    still has the calling thread's former affinity (one bound elsewhere on purpose keeps its
    own, as torch does; a thread that ended meanwhile is skipped)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getaffinity(int(tid)) == before:
                os.sched_setaffinity(int(tid), cpus)
        except (OSError, ValueError):
            continue


def worker_main(
    fn: Callable[..., Any],
    args: tuple,
    env: dict[str, str],
    stdout: FdArg | None,
    stderr: FdArg | None,
    ret_path: str,
    agent_pid: int,
    pdeathsig: bool,
    reset_signals: tuple[int, ...],
    cpus: frozenset[int] | None = None,
) -> None:
    """Runs ``fn(*args)`` in a fresh process group and stores its return value in ``ret_path``.

    With ``cpus`` (NUMA binding) every thread of the child is bound to them before ``fn`` runs.
    """
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    if cpus:
        bind_all_threads(cpus)
    if pdeathsig:
        set_pdeathsig(signal.SIGKILL, agent_pid)
    for sig in reset_signals:
        signal.signal(sig, signal.SIG_DFL)
    for target, arg, name in ((1, stdout, "stdout"), (2, stderr, "stderr")):
        if arg is not None:
            os.dup2(arg.fd, target)
            os.close(arg.fd)
            _rebind(name, target)
    os.environ.update(env)
    slot = os.environ.pop("FASTELASTIC_PROGRESS", None)  # --hang-timeout: this is a rank
    if slot:
        from fastelastic.progress._worker import install

        install(slot)
    ret = record(fn)(*args)
    tmp = ret_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(ret, f)
    os.replace(tmp, ret_path)
