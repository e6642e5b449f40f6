"""The launcher as PID 1 (a container's entry point, as a Kubernetes pod runs it).

PID 1 of a PID namespace inherits every orphan of the namespace, and a process that never
waits for them leaves them as zombies: a worker's daemonised helper, a zygote's grandchild,
whatever a training script forks and forgets. The agent waits for its own workers by pid
(pidfd, ``waitid(P_PID)``, ``Popen.wait``), so a reaper inside it that waits for any child
would steal those waits. So, as PID 1, ``fastrun`` forks first: the child runs the launcher
unchanged (every child it starts stays its own), and PID 1 only reaps every orphan that
reaches it and forwards signals to the launcher; it exits with the launcher's status
(128+N when signal N ended it). As tini and ``docker --init`` do.
"""

from __future__ import annotations

import os
import signal
import sys

# Signals a pod's runtime or an operator sends PID 1, forwarded to the launcher. PID 1 of a
# namespace gets no signal it has no handler for, so without forwarding a SIGTERM would
# never reach the launcher (kubelet then SIGKILLs the pod after its grace period).
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
             signal.SIGUSR2, signal.SIGALRM, signal.SIGWINCH, signal.SIGCONT)
ENV = "FASTELASTIC_PID1_INIT"  # "0": as PID 1, run the launcher in this process all the same


def become_init_if_pid1() -> None:
    """When this process is PID 1: fork; returns in the child (the launcher); the parent
    reaps and forwards until the launcher ends, then exits with its status. Otherwise (or
    with ``FASTELASTIC_PID1_INIT=0``) returns at once. Call it before any thread starts."""
    if os.getpid() != 1 or os.environ.get(ENV, "1") == "0":
        return
    watched = {*FORWARDED, signal.SIGCHLD}
    # Blocked before the fork: a signal that comes in between is pending, not lost, and is
    # taken by sigwaitinfo below (a blocked SIGCHLD with its default action stays pending).
    old = signal.pthread_sigmask(signal.SIG_BLOCK, watched)
    sys.stdout.flush()  # nothing buffered is written twice (by both processes)
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return
    sys.exit(_serve(pid, watched))


def _serve(launcher: int, watched: set[signal.Signals]) -> int:
    """PID 1's loop: forwards each signal to ``launcher``; on SIGCHLD reaps every child that
    exited (the launcher itself, or orphans); returns the launcher's exit status."""
    while True:
        info = signal.sigwaitinfo(watched)
        if info.si_signo != signal.SIGCHLD:
            try:
                os.kill(launcher, info.si_signo)
            except ProcessLookupError:
                pass  # it just exited: its SIGCHLD is pending
            continue
        while True:  # one SIGCHLD may stand for several exits
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return 1  # no child left, the launcher's status lost (cannot happen)
            if pid == 0:
                break
            if pid == launcher:
                code = os.waitstatus_to_exitcode(status)
                return 128 - code if code < 0 else code
