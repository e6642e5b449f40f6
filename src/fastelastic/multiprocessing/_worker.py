"""Owns the child side of a callable worker: process group, stdio, environment, return value."""

from __future__ import annotations

import atexit
import gc
import io
import os
import pickle
import signal
import sys
import threading
import traceback
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
    own_end: bool = False,
) -> None:
    """Runs ``fn(*args)`` in a fresh process group and stores its return value in ``ret_path``.

    With ``cpus`` (NUMA binding) every thread of the child is bound to them before ``fn`` runs.
    With ``own_end`` (spawn) the process ends here, through :func:`end_process`; otherwise
    multiprocessing's fork and forkserver children end by ``os._exit`` when this returns.
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
    if not own_end:
        _run(fn, args, ret_path)
        return
    code = 1
    try:
        _run(fn, args, ret_path)
        code = 0
    except SystemExit as e:  # as multiprocessing's child reads it
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            sys.stderr.write(f"{e.code}\n")
    except BaseException:  # noqa: BLE001 - reported as multiprocessing's child reports it
        sys.stderr.write(f"Process {_process_name()}:\n")
        traceback.print_exc()
    end_process(code)


def _run(fn: Callable[..., Any], args: tuple, ret_path: str) -> None:
    ret = record(fn)(*args)
    tmp = ret_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(ret, f)
    os.replace(tmp, ret_path)  # complete and closed before the process can end


def _process_name() -> str:
    import multiprocessing

    return multiprocessing.current_process().name


_FILE_TYPES = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)


def flush_open_files() -> None:
    """Flushes every file object still open, as the interpreter's teardown would by closing
    them (a file the program left open and unflushed loses nothing)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass
    for obj in gc.get_objects():
        if issubclass(type(obj), _FILE_TYPES):  # type(): no __class__ of a proxy is run
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001, S112 - teardown would have ignored it too
                continue


def end_process(code: int) -> None:
    """Ends this worker as the interpreter would, minus its teardown; never returns.

    Python's exit waits for the non-daemon threads, runs the ``atexit`` handlers (with
    multiprocessing's own, as its child does) and flushes; so does this, then the open files
    are flushed and the process leaves by ``os._exit``. The teardown it skips is where a
    worker that returns without destroying its gloo process group can die or hang: a gloo
    thread that drops a finished work's tensors a moment after the collective returned takes
    the GIL to do it, and once the interpreter finalises a thread that asks for the GIL is
    ended by ``pthread_exit``, which through gloo's C++ frames is ``std::terminate``
    (SIGABRT); freeing the group's globals there runs ``~ProcessGroupGloo``, which joins
    those threads while holding the GIL. Here no destructor joins them and the GIL is
    handed to them as usual until ``os._exit``.
    """
    try:
        mp_util = sys.modules.get("multiprocessing.util")
        if mp_util is not None:
            mp_util._exit_function()  # type: ignore[attr-defined]  # as _bootstrap does
    finally:
        try:
            threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize calls
        finally:
            try:
                atexit._run_exitfuncs()
            finally:
                flush_open_files()
                os._exit(code)
