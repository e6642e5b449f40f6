"""Owns the preloaded worker zygote: the agent-side handle (:class:`Zygote`) and ZygoteContext.

With ``--preload MOD[,MOD...]`` (``FASTELASTIC_PRELOAD``, ``WorkerSpec.preload``) the agent
starts one zygote process as soon as it starts: ``python [-u] -c ... _zygote_boot.py``, which
imports the modules once (while the rendezvous runs) and then forks every worker of every
attempt on request, so a (re)started worker does not pay for Python's startup and the imports.
The forked worker makes itself what ``python script.py args`` / ``python -m module args`` would
be (see ``_zygote_boot.py``). The agent watches it through a pidfd like any worker (it is not
its parent); the zygote reaps it and sends its exit code (``-signal`` when killed).

A zygote that cannot give faithful workers (extra threads, a CUDA context, an import that
failed, a worker environment whose ``PYTHON*`` variables differ from its own) says why in one
line and the workers start plainly. A zygote that dies is started again (its workers die with
it: parent-death signal); one that dies before being ready three times in a row is given up.
It is registered with the guardian and dies with the agent.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import pickle
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from fastelastic._native.procmon import set_pdeathsig
from fastelastic.multiprocessing._guardian import guardian
from fastelastic.multiprocessing._pcontext import _KILL_GRACE_S
from fastelastic.multiprocessing._pycommand import PythonCommand, python_command
from fastelastic.multiprocessing.api import SubprocessContext, _close_fds
from fastelastic.numa import bind_local_ranks

__all__ = [
    "PRELOAD_ENV",
    "PythonCommand",
    "Zygote",
    "ZygoteContext",
    "ZygoteState",
    "parse_preload",
    "python_command",
]

logger = logging.getLogger(__name__)

PRELOAD_ENV = "FASTELASTIC_PRELOAD"
_BOOT_PATH = str(Path(__file__).with_name("_zygote_boot.py"))
_PROGRESS_PATH = str(Path(__file__).resolve().parent.parent / "progress" / "_worker.py")
# a short -c (what ps shows for the zygote and its workers) that runs the boot file as __main__
_BOOT_C = "import sys;p=sys.argv[1];exec(compile(open(p).read(),p,'exec'))"
_MAX_MSG = 1 << 20  # the zygote's receive buffer; a bigger request starts that worker plainly
_MODULE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_REPLY_TIMEOUT_S = 30.0
# close() waits this long for the supervisor (which gives a zygote _KILL_GRACE_S, then
# SIGKILL), then SIGKILLs the zygote itself and waits as long again
_CLOSE_JOIN_S = _KILL_GRACE_S + 5.0
_MAX_EARLY_DEATHS = 3
_LOST = object()  # the zygote died before it reported this worker's exit


def parse_preload(value: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """``"torch,numpy"`` (or a list) as a tuple of module names; ``None``/``""`` is empty.

    Raises:
        ValueError: an item is not a dotted module name.
    """
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(i).strip() for i in items if str(i).strip())
    for name in names:
        if not _MODULE_RE.match(name):
            raise ValueError(
                f"--preload: {name!r} is not a module name (expected e.g. torch,numpy)"
            )
    return names


def _ignored_signals_mask() -> int:
    """The signals a plain worker would start with ignored: ours, less those Popen restores."""
    mask = 0
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    mask = int(line.split()[1], 16)
                    break
    except OSError:
        pass
    for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # subprocess's restore_signals
        mask &= ~(1 << (int(sig) - 1))
    return mask


class ZygoteState(str, enum.Enum):
    """The lifecycle of a :class:`Zygote` (a ``str``, so ``state == "ready"`` reads well)."""

    NEW = "new"  # not started
    STARTING = "starting"  # a zygote process is importing the modules (or is being launched)
    READY = "ready"  # it forks workers on request
    UNUSABLE = "unusable"  # workers start plainly from now on (``reason`` says why); final
    CLOSED = "closed"  # closed; no zygote process is left; final


_TRANSITIONS: dict[ZygoteState, frozenset[ZygoteState]] = {
    ZygoteState.NEW: frozenset({ZygoteState.STARTING, ZygoteState.CLOSED}),
    # STARTING -> STARTING: a zygote died before it was ready and another is launched
    ZygoteState.STARTING: frozenset(
        {ZygoteState.STARTING, ZygoteState.READY, ZygoteState.UNUSABLE, ZygoteState.CLOSED}
    ),
    ZygoteState.READY: frozenset(
        {ZygoteState.STARTING, ZygoteState.UNUSABLE, ZygoteState.CLOSED}
    ),
    ZygoteState.UNUSABLE: frozenset({ZygoteState.CLOSED}),
    ZygoteState.CLOSED: frozenset(),
}


class Zygote:
    """The agent's handle of its worker zygote (thread-safe; one per agent).

    Invariants:

    * ``_cond`` is the one lock: the state, the process, the socket and the workers' exits
      change only under it, and the state only through :meth:`_set_state`.
    * One supervisor thread (``fe-zygote``, from ``start()`` to ``close()``) owns the zygote
      processes and their sockets: it launches each (so the parent-death signal, which follows
      the thread that forked, lasts until ``close()``), reads its messages, and is the only
      one to close a socket or reap a process. Other threads send on ``_sock`` under the lock
      only (without blocking), and ``close()`` only shuts it down, which wakes the supervisor.
    * ``close()`` wins: once the state is CLOSED no zygote is launched, a launch already under
      way kills what it made, and ``close()`` returns after the supervisor did, so no zygote
      outlives it.

    Args:
        modules: the modules to import once.
        command: the workers' Python command (gives the interpreter, its options and
            ``sys.path[0]`` for the imports).
        ready_timeout: the longest the imports may take, counted from ``start()`` (and from
            the relaunch of a zygote that had been ready). Past it the zygote is given up at
            once, killed, and every worker starts plainly: no later wait waits again.
    """

    def __init__(
        self, modules: tuple[str, ...], command: PythonCommand, ready_timeout: float = 600.0
    ) -> None:
        self.modules = tuple(modules)
        self.command = command
        self._ready_timeout = ready_timeout
        self._cond = threading.Condition()
        self._spawn_lock = threading.Lock()  # one spawn request at a time
        self._state = ZygoteState.NEW
        self._ready_by = float("inf")  # monotonic deadline of the imports while STARTING
        self._reason = ""
        self._gen = 0  # the zygote process's generation (one per launch)
        self._sock: socket.socket | None = None  # the live generation's, while it is usable
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._replies: list[tuple] = []
        self._status: dict[int, Any] = {}
        self._owner: dict[int, int] = {}  # worker pid -> zygote generation
        self._early_deaths = 0
        self._told: set[str] = set()
        self.ready_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ lifecycle

    @property
    def pid(self) -> int | None:
        """The current zygote process's pid (None before start / after close)."""
        proc = self._proc
        return proc.pid if proc is not None and proc.returncode is None else None

    @property
    def state(self) -> ZygoteState:
        return self._state

    @property
    def reason(self) -> str:
        """Why the zygote is unusable ('' while it is usable)."""
        return self._reason

    def _set_state(self, new: ZygoteState, reason: str = "") -> None:
        """The one transition function (call it with ``_cond`` held); wakes every waiter.

        Raises:
            RuntimeError: ``new`` cannot follow the current state.
        """
        if new not in _TRANSITIONS[self._state]:
            raise RuntimeError(f"zygote: no transition {self._state.value} -> {new.value}")
        if new is ZygoteState.STARTING and self._state is not ZygoteState.STARTING:
            # a zygote dying before it is ready is relaunched within the same allowance
            self._ready_by = time.monotonic() + self._ready_timeout
        self._state = new
        if new is ZygoteState.UNUSABLE:
            self._reason = reason
        self._cond.notify_all()

    def matches(self, command: PythonCommand) -> bool:
        """True if ``command`` runs with the zygote's interpreter, options and ``sys.path[0]``."""
        mine = self.command
        return (command.exe, command.options, command.module, command.path0()) == (
            mine.exe,
            mine.options,
            mine.module,
            mine.path0(),
        )

    def start(self) -> None:
        """Starts the zygote process (returns at once; the imports run in the background)."""
        with self._cond:
            if self._state is not ZygoteState.NEW:
                return
            self._set_state(ZygoteState.STARTING)
            self._thread = threading.Thread(target=self._supervise, name="fe-zygote",
                                            daemon=True)
            self._thread.start()

    def _supervise(self) -> None:
        """The supervisor thread: launches, reads, reaps and relaunches until closed."""
        while True:
            launched = self._launch()
            if launched is None:
                return
            gen, sock, proc = launched
            self._read(sock, proc)
            with self._cond:
                if self._sock is sock:
                    self._sock = None  # no one sends on it from now on
            sock.close()
            _stop(proc)
            guardian.unregister(proc.pid)
            if not self._relaunch(gen, proc):
                return

    def _launch(self) -> tuple[int, socket.socket, subprocess.Popen] | None:
        """Starts a zygote process; None when closed (or it could not start)."""
        with self._cond:
            if self._state is not ZygoteState.STARTING:
                return None
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        cfg = {"fd": child.fileno(), "modules": list(self.modules), "path0": self.command.path0()}
        me = os.getpid()
        try:
            proc = subprocess.Popen(
                [self.command.exe, *self.command.options, "-c", _BOOT_C, _BOOT_PATH,
                 json.dumps(cfg)],
                stdin=subprocess.DEVNULL,
                pass_fds=(child.fileno(),),
                process_group=0,
                # this thread lives until close(): the signal fires when the agent dies
                preexec_fn=lambda: set_pdeathsig(signal.SIGKILL, me),  # noqa: PLW1509
            )
        except OSError as e:
            parent.close()
            self._give_up(f"the zygote could not start: {e}")
            return None
        finally:
            child.close()
        guardian.register(proc.pid)
        with self._cond:
            closed = self._state is ZygoteState.CLOSED
            if not closed:
                self._gen += 1
                self._sock = parent
                self._proc = proc
                gen = self._gen
        if closed:  # close() came during the launch: what it made goes now
            parent.close()
            _stop(proc, 0)
            guardian.unregister(proc.pid)
            return None
        logger.info("worker zygote %s started: importing %s", proc.pid, ",".join(self.modules))
        return gen, parent, proc

    def _give_up(self, reason: str, kill: bool = False) -> None:
        """Marks the zygote unusable; ``kill``: and SIGKILLs the live one (the supervisor
        then sees its socket end, reaps it and launches no other)."""
        with self._cond:
            if self._state in (ZygoteState.CLOSED, ZygoteState.UNUSABLE):
                return
            self._set_state(ZygoteState.UNUSABLE, reason)
            proc = self._proc if kill else None
            if proc is not None and proc.returncode is None:
                proc.kill()  # it is the supervisor's child, not reaped yet (we hold the lock)
        logger.warning("--preload: starting workers plainly: %s", reason)

    def _read(self, sock: socket.socket, proc: subprocess.Popen) -> None:
        """Takes the zygote's messages until its socket ends (it died, or close())."""
        while True:
            try:
                data = sock.recv(_MAX_MSG)
            except OSError:
                data = b""
            if not data:
                return
            msg = pickle.loads(data)
            kind = msg[0]
            with self._cond:
                if kind == "exit":
                    self._status[msg[1]] = msg[2]
                elif kind in ("spawned", "refused"):
                    self._replies.append(msg)
                elif kind == "ready" and self._state is ZygoteState.STARTING:
                    self._early_deaths = 0
                    self.ready_info = msg[1]
                    self._set_state(ZygoteState.READY)
                    implied = msg[1].get("implied", "")
                    logger.info(
                        "worker zygote %s ready: imported %s in %.2fs",
                        proc.pid,
                        ",".join(self.modules) + (f" (and {implied})" if implied else ""),
                        msg[1]["import_s"],
                    )
                self._cond.notify_all()
            if kind == "unusable":
                self._give_up(msg[1])

    def _relaunch(self, gen: int, proc: subprocess.Popen) -> bool:
        """After zygote ``gen`` ended: True if another is to be launched."""
        with self._cond:
            for pid, owner in self._owner.items():
                if owner == gen and pid not in self._status:
                    self._status[pid] = _LOST
            self._cond.notify_all()
            if self._state in (ZygoteState.CLOSED, ZygoteState.UNUSABLE):
                return False
            was_ready = self._state is ZygoteState.READY
            self._early_deaths = 0 if was_ready else self._early_deaths + 1
            deaths = self._early_deaths
        code = proc.returncode
        how = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        if deaths >= _MAX_EARLY_DEATHS:
            self._give_up(f"the zygote died {deaths} times before its imports finished ({how})")
            return False
        logger.warning("worker zygote %s died (%s); starting a new one", proc.pid, how)
        with self._cond:
            if self._state is ZygoteState.CLOSED:  # close() while we logged: it wins
                return False
            self._set_state(ZygoteState.STARTING)
        return True

    def close(self) -> None:
        """Stops the zygote (it SIGKILLs any worker it still has) and waits for it, boundedly.

        No zygote process outlives this call, whatever the supervisor was doing, unless it
        survives SIGKILL (uninterruptible sleep): then it is logged and left behind after
        ``2 * _CLOSE_JOIN_S``.
        """
        with self._cond:
            if self._state is ZygoteState.CLOSED:
                return
            self._set_state(ZygoteState.CLOSED)
            if self._sock is not None:
                try:
                    self._sock.shutdown(socket.SHUT_RDWR)  # EOF for both: the supervisor wakes
                except OSError:
                    pass
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return
        thread.join(_CLOSE_JOIN_S)
        if thread.is_alive():  # a zygote that cannot be reaped (uninterruptible sleep...)
            with self._cond:
                proc = self._proc
                if proc is not None and proc.returncode is None:
                    proc.kill()
            thread.join(_CLOSE_JOIN_S)
        if thread.is_alive():
            logger.warning("worker zygote %s: its supervisor did not finish within %gs of "
                           "close(); leaving it behind", self.pid, 2 * _CLOSE_JOIN_S)

    # ------------------------------------------------------------------ workers

    def _tell_once(self, reason: str) -> None:
        if reason not in self._told and len(self._told) < 64:
            self._told.add(reason)
            logger.warning("--preload: starting a worker plainly: %s", reason)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits for the imports of a zygote that is still starting; True if it is ready.

        Waits up to ``timeout``, or (None) until the ready deadline: a zygote still starting
        then is given up and killed, so every later wait returns at once.
        """
        with self._cond:
            until = self._ready_by if timeout is None else time.monotonic() + timeout
            wait = min(until, self._ready_by) - time.monotonic()
            self._cond.wait_for(
                lambda: self._state is not ZygoteState.STARTING,
                None if wait == float("inf") else max(0.0, wait),
            )
            late = self._state is ZygoteState.STARTING and time.monotonic() >= self._ready_by
        if late:
            self._give_up(f"its imports did not finish within the ready timeout "
                          f"({self._ready_timeout:g}s); the zygote was killed", kill=True)
        return self._state is ZygoteState.READY

    def _send(self, data: bytes, fds: tuple[int, ...] = ()) -> int:
        """Sends one message to the live zygote (call with ``_cond`` held); its generation.

        Raises:
            OSError: no live zygote, or it does not take the message now (its queue is full:
                it is hung); the caller never blocks under the lock.
        """
        sock = self._sock
        if sock is None:
            raise ConnectionResetError("the zygote is gone")
        socket.send_fds(sock, [data], list(fds), socket.MSG_DONTWAIT)
        return self._gen

    def spawn(self, request: dict[str, Any], fds: tuple[int, int, int]) -> int | str:
        """Forks one worker; returns its pid, or why to start it plainly instead.

        Waits for the imports of a zygote that is still starting, until the ready deadline.
        """
        data = pickle.dumps(("spawn", request), protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > _MAX_MSG:
            return self._refuse(f"the worker's request is {len(data)} bytes (> {_MAX_MSG})")
        self.wait_ready()
        with self._spawn_lock:
            with self._cond:
                if self._state is not ZygoteState.READY:
                    return self._reason or f"the zygote is {self._state.value}"
                self._replies.clear()
                try:
                    gen = self._send(data, fds)
                except OSError as e:
                    reply: tuple | None = ("refused", f"the zygote is unreachable: {e}")
                else:
                    self._cond.wait_for(
                        lambda: bool(self._replies)
                        or self._gen != gen
                        or self._state is not ZygoteState.READY,
                        _REPLY_TIMEOUT_S,
                    )
                    reply = self._replies.pop(0) if self._replies else None
                    if reply is not None and reply[0] == "spawned":
                        self._owner[reply[1]] = gen
                        return int(reply[1])
                    if reply is None and self._gen == gen and self._proc is not None:
                        self._proc.kill()  # hung: a late fork must not run unsupervised
            # told (logged) outside the lock
            if reply is None:
                return self._refuse("the zygote did not answer")
            return self._refuse(str(reply[1]))

    def _refuse(self, reason: str) -> str:
        self._tell_once(reason)
        return reason

    def ack(self, pid: int) -> None:
        """Tells the zygote the agent watches ``pid``: it may reap it and report its exit."""
        with self._cond:
            try:
                self._send(pickle.dumps(("ack", pid)))
            except OSError:
                pass  # the zygote is gone (the worker died with it) or hung (it is killed)

    def release(self, pids: list[int]) -> None:
        """Tells the zygote the agent is done with these exited workers' process groups: it
        reaps them only now, so their ids stay ours while the agent may signal the groups."""
        if not pids:
            return
        with self._cond:
            try:
                self._send(pickle.dumps(("reap", list(pids))))
            except OSError:
                pass  # the zygote is gone: its zombies went to init, which reaped them

    def exit_status(self, pid: int, timeout: float) -> int | None:
        """The exit code of worker ``pid`` (``-signal`` if killed), as its zygote reported.

        None if the zygote did not report it within ``timeout`` (the status is unknown).
        """
        with self._cond:
            self._cond.wait_for(lambda: pid in self._status, timeout)
            code = self._status.pop(pid, None)
            self._owner.pop(pid, None)
        if code is _LOST:
            logger.warning(
                "worker %s: its zygote died before reporting its exit; it was killed with it"
                " (reported as SIGKILL)",
                pid,
            )
            return -int(signal.SIGKILL)
        return code

    def forget(self, pids: list[int]) -> None:
        """Drops what is kept about ``pids`` (their context was released)."""
        with self._cond:
            for pid in pids:
                self._status.pop(pid, None)
                self._owner.pop(pid, None)


def _stop(proc: subprocess.Popen, grace: float = _KILL_GRACE_S) -> None:
    """Waits up to ``grace`` for a zygote told to go (socket EOF), then SIGKILLs it."""
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _stdin_fd() -> tuple[int, bool]:
    """Our fd 0 (or /dev/null when it is closed); True when the caller must close it."""
    try:
        os.fstat(0)
        return 0, False
    except OSError:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC), True


class ZygoteContext(SubprocessContext):
    """``SubprocessContext`` whose workers are forked by the zygote (plain ones as fallback)."""

    def __init__(self, zygote: Zygote, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._zygote = zygote
        self._zpids: dict[int, int] = {}  # local rank -> pid, for zygote-forked ranks

    def _request(self, rank: int, cmd: PythonCommand) -> dict[str, Any]:
        env = os.environ.copy()
        env.update(self.envs[rank])
        return {
            "argv": [cmd.target, *cmd.args],
            "module": cmd.module,
            "orig_argv": [cmd.exe, *(str(a) for a in self.args[rank])],
            "env": env,
            "cwd": os.getcwd(),
            "path0": cmd.path0(),
            "sigign": _ignored_signals_mask(),
            "cpus": sorted(self.numa_cpus.get(rank, ())) or None,  # NUMA binding
            "progress": _PROGRESS_PATH,
        }

    def _start(self) -> None:
        if self.subprocess_handlers or self._zpids:
            raise ValueError("The subprocess handlers already started (start() called twice?)")
        self.numa_cpus = bind_local_ranks(self._numa_options, self.nprocs)
        for rank in range(self.nprocs):
            cmd = python_command(self.entrypoint, self.args[rank])
            forked = isinstance(cmd, PythonCommand) and self._zygote.matches(cmd)
            if forked:
                # before the step: a stop signal may cut this wait (the imports) short
                self._zygote.wait_ready()
            with self._signals.step():  # started and watched, or not started
                self._start_rank(rank, cmd if forked else None)

    def _start_rank(self, rank: int, cmd: PythonCommand | str | None) -> None:
        out_fd, err_fd = self._child_stdio(rank)
        in_fd, close_in = _stdin_fd()
        try:
            got: int | str = "the worker's command differs from the zygote's"
            if isinstance(cmd, PythonCommand):
                out = 1 if out_fd is None else out_fd
                fds = (in_fd, out, 2 if err_fd is None else err_fd)
                got = self._zygote.spawn(self._request(rank, cmd), fds)
            if isinstance(got, int):
                pid = got
                self._zpids[rank] = pid
            else:
                pid = self._start_plain(rank, out_fd, err_fd)
        finally:
            _close_fds(out_fd, err_fd, in_fd if close_in else None)
        self._track(rank, pid)
        if rank in self._zpids:
            self._zygote.ack(pid)

    def _exitcode(self, rank: int, status: int | None) -> int | None:
        if rank in self.subprocess_handlers:
            return super()._exitcode(rank, status)
        if status is not None:
            return status
        return self._zygote.exit_status(self._zpids[rank], _KILL_GRACE_S)

    def _unknown_exit(self, rank: int) -> str:
        if rank in self.subprocess_handlers:
            return super()._unknown_exit(rank)
        return f"its zygote did not report its exit within {_KILL_GRACE_S:g}s"

    def _reap(self) -> None:
        super()._reap()  # the ranks started plainly
        self._zygote.release([pid for rank, pid in self._zpids.items() if rank in self._exitcodes])

    def _release(self) -> None:
        try:
            super()._release()
        finally:
            self._zygote.forget(list(self._zpids.values()))
