"""The worker zygote's own program (stdlib only; ``python [-u] -c <exec this file> FILE CONFIG``).

Never imported by fastelastic: :mod:`fastelastic.multiprocessing._zygote` has a short ``-c``
run this file as ``__main__``, so the zygote holds no fastelastic module that a plain worker
would not have. The zygote imports the preload modules once, then serves its agent over a
``SOCK_SEQPACKET`` socket (fd ``CONFIG["fd"]``), one pickled tuple per message:

* agent -> zygote: ``("spawn", request)`` with the worker's stdin/stdout/stderr as 3 fds
  (``SCM_RIGHTS``); ``("ack", pid)`` once the agent watches ``pid`` through a pidfd.
* zygote -> agent: ``("ready", info)`` or ``("unusable", reason)`` after the imports;
  ``("spawned", pid)`` or ``("refused", reason)`` per spawn; ``("exit", pid, code)`` when a
  worker ended (``code`` is ``-signal`` when a signal ended it).

A worker is reaped (and its status sent) only after its ack, so the agent's pidfd never races
the pid's reuse. Before every fork the zygote checks it has one thread and no CUDA context.
The forked child makes itself what ``python script.py args`` (or ``python -m module args``)
would be: own process group, parent-death signal, stdio, signal dispositions and mask, cwd,
environment (replaced, then what the preload imports set in the zygote's redone),
``sys.argv``/``sys.orig_argv``/``sys.path[0]``, a fresh ``__main__``, numpy's global RNG
reseeded; then the top-level code below runs the program (runpy semantics).
Before forking, the zygote moves its objects to the collector's permanent generation
(``gc.freeze()``, as Python's documentation advises for pre-fork servers).
On EOF of its socket (the agent is gone) the zygote SIGKILLs its workers' groups and exits.
"""

import ctypes
import gc
import json
import os
import pickle
import selectors
import signal
import socket
import sys
import time
import types

_MAX_MSG = 1 << 20
_STARTUP_ENV = ("LD_PRELOAD", "LD_LIBRARY_PATH")  # also every PYTHON* variable


def _load_end(path):
    """``_worker_end.py`` (a worker's end, shared with the plain runner), by path."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("_fastelastic_worker_end", path)
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_END = _load_end(os.path.join(os.path.dirname(sys.argv[1]), "_worker_end.py"))


def _send(sock, msg):
    """Sends one message; a gone agent is not an error here (the next receive sees its EOF and
    ends the zygote: e.g. a launch that failed while the zygote was still importing)."""
    try:
        sock.send(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))
    except ConnectionError:
        pass


def _startup_env(env):
    return {k: v for k, v in env.items() if k.startswith("PYTHON") or k in _STARTUP_ENV}


def _threads():
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return 1


def _extra_threads(n):
    """Names the threads besides the main one: Python ones by name, the others counted."""
    threading = sys.modules.get("threading")
    py = []
    if threading is not None:
        py = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    parts = []
    if py:
        parts.append("Python: " + ", ".join(py))
    native = n - 1 - len(py)
    if native > 0:
        parts.append(f"{native} native, e.g. a BLAS/OpenMP pool: OMP_NUM_THREADS=1 avoids it")
    return "; ".join(parts)


def _unfit(boot_env, env):
    """Why a fork now would not give a faithful worker ('' when it would)."""
    n = _threads()
    if n != 1:
        return (
            f"the zygote has {n} threads after its imports ({_extra_threads(n)})"
            " and a fork copies only one"
        )
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and getattr(cuda, "is_initialized", lambda: False)():
        return "the preloaded modules initialised CUDA, which a forked child cannot use"
    if env is not None:
        theirs = _startup_env(env)
        if theirs != boot_env:
            keys = set(theirs) | set(boot_env)
            diff = sorted(k for k in keys if theirs.get(k) != boot_env.get(k))
            return f"the worker's {', '.join(diff)} differ from the zygote's (read at startup)"
    return ""


def _ignored_from_mask(mask):
    return {s for s in range(1, 65) if mask >> (s - 1) & 1}


def _import_env(before):
    """What the preload imports did to the environment: ``(before, {name: value or None})``."""
    after = os.environ
    changed = {k: v for k, v in after.items() if before.get(k) != v}
    changed.update({k: None for k in before if k not in after})
    return before, changed


def _replay_import_env(import_env):
    """Redoes in the worker's environment what the preload imports did to the zygote's.

    A plain worker runs those imports itself and keeps what they set (torch sets
    ``TORCHINDUCTOR_CACHE_DIR``, Lightning ``PYTORCH_NVML_BASED_CUDA_CHECK=1``). A variable the
    worker's environment gives a value of its own (``LOCAL_RANK``...) keeps that value: the
    import would have found it there.
    """
    before, changed = import_env
    for name, value in changed.items():
        if os.environ.get(name) != before.get(name):
            continue
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def _child(req, fds, zygote_pid, closing, import_env):
    """In the forked child: becomes the worker described by ``req``; returns the job."""
    os.setpgid(0, 0)
    if req.get("cpus"):
        # NUMA binding, before anything runs (the zygote forks with one thread, so this binds
        # the whole worker). torch's intra-op thread count needs no fixing: the zygote only
        # forks when torch's import started no OpenMP pool, i.e. with OMP_NUM_THREADS=1 in
        # its environment, which decides that count in a plain worker as well (tested).
        os.sched_setaffinity(0, req["cpus"])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG: die with the zygote
    if os.getppid() != zygote_pid:
        os.kill(os.getpid(), signal.SIGKILL)
    for fd in closing:
        try:
            os.close(fd)
        except OSError:
            pass
    for target, fd in enumerate(fds):
        os.dup2(fd, target)  # inheritable, like a plain worker's stdio
    for fd in set(fds):
        if fd > 2:
            os.close(fd)
    ignored = _ignored_from_mask(req["sigign"])
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
        except (OSError, ValueError):
            continue
    # what every Python interpreter does at startup
    for name in ("SIGPIPE", "SIGXFSZ"):
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    if signal.SIGINT not in ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    _replay_import_env(import_env)
    sys.argv = list(req["argv"])
    sys.orig_argv = list(req["orig_argv"])
    if sys.path:
        sys.path[0] = req["path0"]
    else:
        sys.path.insert(0, req["path0"])
    np_random = sys.modules.get("numpy.random")
    if np_random is not None:
        np_random.seed()  # a fresh interpreter seeds numpy's global RNG from the OS
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = sys.modules["builtins"]
    sys.modules["__main__"] = main
    slot = os.environ.pop("FASTELASTIC_PROGRESS", None)  # --hang-timeout: arm the marks
    if slot and req.get("progress"):
        _arm_progress(req["progress"], slot)
    return req


def _arm_progress(path, slot):
    """Loads fastelastic's progress marks by file path (as the plain start's bootstrap does)."""
    name = "fastelastic.progress._worker"
    try:
        import importlib.util

        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mod.install(slot)
    except Exception as e:  # noqa: BLE001 - the program runs on without the marks
        sys.modules.pop(name, None)
        print(f"fastelastic: no progress reports from this worker (--hang-timeout): "
              f"{type(e).__name__}: {e}", file=sys.stderr)


IMPLIED_ENV = "FASTELASTIC_PRELOAD_DYNAMO"  # 0: torch preloaded without torch._dynamo


def _import_implied():
    """With torch preloaded (by name or by a module that imports it), ``torch._dynamo`` too:
    every ``torch.optim`` optimizer's constructor imports it, so a restarted training script
    would otherwise pay it (4-6 s for 4 workers on 2 cores). Best effort: a failure leaves the
    worker to import it itself. The environment is left as the named imports left it (the
    import sets ``TORCHINDUCTOR_CACHE_DIR``, which inductor derives again when it needs it), so
    a worker, torch or not, starts with the environment it has without this import. What was
    done, for the agent's log."""
    if "torch" not in sys.modules or os.environ.get(IMPLIED_ENV) == "0":
        return ""
    if "torch._dynamo" in sys.modules:
        return ""
    before = dict(os.environ)
    try:
        __import__("torch._dynamo")
    except Exception as e:  # noqa: BLE001 - the worker imports it itself, as without us
        for name in [m for m in sys.modules if m == "torch._dynamo" or
                     m.startswith("torch._dynamo.")]:
            sys.modules.pop(name, None)
        return f"torch._dynamo not preloaded: {type(e).__name__}: {e}"
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)
    return "torch._dynamo"


def _serve(cfg):
    """Imports the modules, then forks workers on request; returns only in a forked child."""
    ctl = socket.socket(fileno=cfg["fd"])
    boot_env = _startup_env(os.environ)
    agent_env = dict(os.environ)
    t0 = time.monotonic()
    try:
        for name in cfg["modules"]:
            __import__(name)
    except BaseException as e:  # noqa: BLE001 - any failure only disables the zygote
        _send(ctl, ("unusable", f"import {name} failed: {type(e).__name__}: {e}"))
        return None
    implied = _import_implied()
    reason = _unfit(boot_env, None)
    if reason:
        _send(ctl, ("unusable", reason))
        return None
    import_env = _import_env(agent_env)
    _send(ctl, ("ready", {"pid": os.getpid(), "import_s": time.monotonic() - t0,
                          "implied": implied}))
    me = os.getpid()
    sel = selectors.DefaultSelector()
    sel.register(ctl, selectors.EVENT_READ)
    # pid -> [pidfd, acked, exited, reported]. An exited worker stays a zombie (its status is
    # read with WNOWAIT) until the agent says "reap": its pid, and so its process group id,
    # cannot be reused while the agent may still signal the group (grandchildren included).
    kids = {}

    def report(pid):
        entry = kids[pid]
        if entry[1] and entry[2] and not entry[3]:
            entry[3] = True
            info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            _send(ctl, ("exit", pid, code))

    def reap(pid):
        entry = kids.pop(pid, None)
        if entry is not None:
            os.waitpid(pid, 0)
            os.close(entry[0])

    while True:
        for key, _ in sel.select():
            if key.fileobj is not ctl:
                pid = key.data
                sel.unregister(key.fd)
                kids[pid][2] = True
                report(pid)
                continue
            try:
                data, fds, flags, _ = socket.recv_fds(ctl, _MAX_MSG, 3)
            except ConnectionError:
                data, fds, flags = b"", [], 0
            if not data:  # the agent is gone (or closed us): nothing may outlive it
                for pid in kids:
                    try:
                        os.killpg(pid, signal.SIGKILL)
                    except OSError:
                        pass
                return None
            msg = pickle.loads(data)
            if msg[0] == "ack":
                entry = kids.get(msg[1])
                if entry is not None:
                    entry[1] = True
                    report(msg[1])
                continue
            if msg[0] == "reap":  # the agent is done with these groups
                for pid in msg[1]:
                    if pid in kids and kids[pid][3]:
                        reap(pid)
                continue
            req = msg[1]
            reason = "truncated request" if flags & socket.MSG_TRUNC or len(fds) != 3 else ""
            reason = reason or _unfit(boot_env, req["env"])
            if reason:
                for fd in fds:
                    os.close(fd)
                _send(ctl, ("refused", reason))
                continue
            # Python's advice for pre-fork servers: the children's collections (and the final
            # one at exit) then skip the preloaded objects instead of copying every page that
            # holds one (2.5 s -> 0.5 s for a worker with torch._dynamo to exit, here)
            gc.freeze()
            pid = os.fork()
            if pid == 0:
                # close through their objects: a stale object would later close a reused fd
                sel.close()
                ctl.close()
                return _child(req, fds, me, [k[0] for k in kids.values()], import_env)
            try:
                os.setpgid(pid, pid)  # closes the race with the child's own call
            except OSError:
                pass
            for fd in fds:
                os.close(fd)
            pidfd = os.pidfd_open(pid)
            kids[pid] = [pidfd, False, False, False]
            sel.register(pidfd, selectors.EVENT_READ, pid)
            _send(ctl, ("spawned", pid))


def _run(job):
    """Runs the worker's program as ``python`` would; returns its uncaught exception, if any."""
    import runpy

    if job["module"]:
        # what `python -m` runs (its traceback shows these runpy frames too)
        run = runpy._run_module_as_main  # type: ignore[attr-defined]
        try:
            run(job["argv"][0], alter_argv=True)
        except BaseException as e:  # noqa: BLE001 - handed back to the top level
            return e, _END.trim(e.__traceback__, lambda c: c.co_name == "_run_module_as_main")
        return None
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(job["argv"][0])
    main = sys.modules["__main__"]
    with open(path, "rb") as f:
        code = compile(f.read(), path, "exec", dont_inherit=True)
    main.__dict__.update(
        __file__=path, __cached__=None, __loader__=SourceFileLoader("__main__", path)
    )
    del job
    try:
        exec(code, main.__dict__)
    except BaseException as e:  # noqa: BLE001 - handed back to the top level
        return e, _END.trim(e.__traceback__, lambda c: c.co_filename == path)
    return None


if __name__ == "__main__":
    _cfg = json.loads(sys.argv[-1])
    if _cfg.get("path0") is not None:
        sys.path[0] = _cfg["path0"]
    _job = _serve(_cfg)
    if _job is None:
        sys.exit(0)
    del _cfg
    _failed = _run(_job)
    del _job
    _fast = os.environ.get("FASTELASTIC_PRELOAD_FAST_EXIT", "1") != "0"
    if _failed is None:
        if _fast:
            _END.end(0)
        sys.exit(0)
    _exc, _tb = _failed
    del _failed
    _exc.__traceback__ = _tb
    if isinstance(_exc, SystemExit) and _fast:
        _END.end(_END.exit_code(_exc))
    if isinstance(_exc, (SystemExit, KeyboardInterrupt)):
        # SystemExit: its code; KeyboardInterrupt: traceback, then death by SIGINT
        raise _exc
    sys.excepthook(type(_exc), _exc, _exc.__traceback__)
    del _exc, _tb
    if _fast:
        _END.end(1)
    sys.exit(1)
