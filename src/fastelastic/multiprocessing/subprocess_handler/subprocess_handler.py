"""Owns SubprocessHandler: one binary worker in its own process group (torch's shape)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import threading
from typing import Any

from fastelastic._native.procmon import set_pdeathsig
from fastelastic.numa import bind_local_ranks

__all__ = ["SubprocessHandler"]


def _prepare_child(agent_pid: int, cpus: frozenset[int]) -> None:
    """In the forked child before ``exec``: the parent-death signal (if ``agent_pid``) and the
    NUMA binding (the exec'd program and every thread it makes inherit it)."""
    if agent_pid:
        set_pdeathsig(signal.SIGKILL, agent_pid)
    os.sched_setaffinity(0, cpus)


class SubprocessHandler:
    """Runs ``entrypoint *args`` as a new process group leader; ``proc`` is its ``Popen``.

    The child gets ``PR_SET_PDEATHSIG=SIGKILL`` when started from the main thread (the signal
    fires when the *thread* that forked it exits, so other threads would be a trap).

    Args:
        entrypoint: the binary.
        args: its arguments (converted with ``str``).
        env: variables added to this process's environment.
        stdout: a file path ("" or None: inherit ours) or an fd to use as the child's stdout.
        stderr: the same for stderr.
        local_rank_id: the worker's local rank.
        numa_options: NUMA binding (see :mod:`fastelastic.numa`): the child is bound to the
            CPUs of GPU ``local_rank_id`` with ``sched_setaffinity`` before ``exec``.
        cpus: the CPUs already chosen for it (fastelastic; an empty set: unbound), instead of
            choosing them from ``numa_options``.

    Raises:
        NumaBindingError: ``numa_options`` cannot bind this worker (and no fallback).
    """

    def __init__(
        self,
        entrypoint: str,
        args: tuple,
        env: dict[str, str],
        stdout: str | int | None,
        stderr: str | int | None,
        local_rank_id: int,
        numa_options: Any = None,
        *,
        cpus: frozenset[int] | None = None,
    ) -> None:
        self.local_rank_id = local_rank_id
        if cpus is None:
            cpus = bind_local_ranks(numa_options, local_rank_id + 1, only=local_rank_id).get(
                local_rank_id, frozenset()
            )
        self._files: list = []
        full_env = os.environ.copy()
        full_env.update(env)
        out = self._target(stdout)
        err = self._target(stderr)
        me = os.getpid()
        pdeathsig = threading.current_thread() is threading.main_thread()
        preexec = None
        if cpus:
            preexec = functools.partial(_prepare_child, me if pdeathsig else 0, cpus)
        elif pdeathsig:
            preexec = functools.partial(set_pdeathsig, signal.SIGKILL, me)
        try:
            self.proc: subprocess.Popen = subprocess.Popen(
                [str(entrypoint), *(str(a) for a in args)],
                env=full_env,
                stdout=out,
                stderr=err,
                process_group=0,
                # syscalls only in the child (prctl, sched_setaffinity): they take no lock, so
                # other threads are harmless
                preexec_fn=preexec,  # noqa: PLW1509
            )
        finally:
            for f in self._files:
                f.close()

    def _target(self, dest: str | int | None) -> int | None:
        if dest is None or dest == "":
            return None
        if isinstance(dest, int):
            return dest
        f = open(dest, "wb")  # noqa: SIM115 - closed right after the fork
        self._files.append(f)
        return f.fileno()

    def close(self, death_sig: signal.Signals | None = None) -> None:
        """Sends ``death_sig`` (SIGTERM by default) to the worker's whole process group."""
        try:
            os.killpg(self.proc.pid, death_sig or signal.SIGTERM)
        except ProcessLookupError:
            pass
