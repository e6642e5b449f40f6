"""Owns SubprocessHandler: one binary worker in its own process group (torch's shape)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import Any

from fastelastic._native.procmon import set_pdeathsig

__all__ = ["SubprocessHandler"]


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
        numa_options: accepted for torch compatibility; not applied.
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
    ) -> None:
        self.local_rank_id = local_rank_id
        self._files: list = []
        full_env = os.environ.copy()
        full_env.update(env)
        out = self._target(stdout)
        err = self._target(stderr)
        me = os.getpid()
        pdeathsig = threading.current_thread() is threading.main_thread()
        try:
            self.proc: subprocess.Popen = subprocess.Popen(
                [str(entrypoint), *(str(a) for a in args)],
                env=full_env,
                stdout=out,
                stderr=err,
                process_group=0,
                # one prctl in the child; it takes no lock, so other threads are harmless
                preexec_fn=(lambda: set_pdeathsig(signal.SIGKILL, me)) if pdeathsig else None,  # noqa: PLW1509
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
