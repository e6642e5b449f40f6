"""A worker's progress slot: the marks it writes for its agent's hang check (stdlib only).

Loaded in the worker before its program runs (by the zygote after its fork, by the bootstrap
``sitecustomize`` of a plain start, or by the callable-worker wrapper), only when the agent
runs with ``--hang-timeout``; it may be loaded by file path as ``fastelastic.progress._worker``
before the ``fastelastic`` package is importable, so it imports nothing of fastelastic.

Invariants:

* The slot is a small ``mmap`` of a file the agent made (``SLOT_FIELDS`` 8-byte integers in
  native order); a mark is one or two stores into it: no syscall, no lock on the step path.
* Only the rank's own process writes: a forked child (a data loader worker) detaches in
  ``os.register_at_fork`` (its optimizer hook removed, its stack dump signal unregistered);
  an exec'd child sees nothing (the bootstrap removed its variables from ``os.environ``).
* torch is never imported here: the hooks go in when the program imports torch (at once if
  it already did, as in a zygote that preloaded it).
"""

import atexit
import faulthandler
import functools
import mmap
import os
import signal
import sys
import threading
import time

PROGRESS_ENV = "FASTELASTIC_PROGRESS"  # the slot's path (popped from the worker's environment)
SLOT_FIELDS = 16
SLOT_SIZE = SLOT_FIELDS * 8
MAGIC = 0x46455052  # "FEPR"
# field indexes
F_MAGIC, F_PID, F_STEPS, F_LAST_NS = 0, 1, 2, 3
F_SUSPEND, F_SUSPEND_NS, F_SUSPEND_KIND, F_EVAL_NS = 4, 5, 6, 7
F_MAIN_TID, F_DUMP_SIG, F_HOOKED, F_END_NS = 8, 9, 10, 11
# suspend kinds (bits of F_SUSPEND_KIND)
K_SAVE, K_LOAD, K_CHECKPOINT, K_CUSTOM = 1, 2, 4, 8
KIND_NAMES = {K_SAVE: "torch.save", K_LOAD: "torch.load",
              K_CHECKPOINT: "torch.distributed.checkpoint", K_CUSTOM: "suspend()"}
# the signal the agent sends for a dump of every thread's stack (faulthandler, no GIL needed)
DUMP_SIGNAL = int(signal.SIGRTMIN) + 7

_slot = None  # memoryview('q') of the mapping, None when not installed or detached
_mm = None
_stacks = None  # the file faulthandler writes a dump into
_opt_handle = None
_lock = threading.Lock()  # suspend depth (saves may run in threads)
_train_depth = 0
_slot_path = [None]


def install(path):
    """Maps the slot at ``path`` and arms the marks; a no-op when already installed."""
    global _slot, _mm
    if _slot is not None:
        return
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        _mm = mmap.mmap(fd, SLOT_SIZE)
    finally:
        os.close(fd)
    _slot = memoryview(_mm).cast("q")
    _slot_path[0] = path
    if _slot[F_PID] and _slot[F_PID] != os.getpid():
        # an earlier Python process of the same worker (a shell wrapper runs several) marked
        # this slot: its marks (its end, its steps) are not this process's
        for i in range(F_PID + 1, SLOT_FIELDS):
            _slot[i] = 0
    _slot[F_PID] = os.getpid()
    _slot[F_MAIN_TID] = threading.get_ident()
    os.register_at_fork(after_in_child=_detach)
    atexit.register(_finishing)
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is not None and not getattr(shutdown, "__fastelastic_marked__", False):
        # what Python calls once the program's main code returned, first of all (before the
        # exit hooks of concurrent.futures' pools, its non-daemon threads' join, atexit)
        threading._shutdown = _ending_first(shutdown)
    # each watched module is hooked now if imported, else when it is: every start mode (a
    # zygote that preloaded torch, a script that imports DCP late) ends with both hooked
    pending = set()
    for name, hook in _WATCHED.items():
        if _WATCHED_DONE[name] in sys.modules:
            hook()
        else:
            pending.add(name)
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))


def _detach():
    """In a forked child: it is not the rank; it reports nothing."""
    global _slot, _opt_handle
    _slot = None
    if _opt_handle is not None:
        _opt_handle.remove()
        _opt_handle = None
    try:
        faulthandler.unregister(DUMP_SIGNAL)
    except (ValueError, RuntimeError):
        pass
    for f in list(sys.meta_path):
        if isinstance(f, _AfterImport):
            sys.meta_path.remove(f)


def _ended():
    """The rank's program ended (its main code returned, its default process group was
    destroyed, or the interpreter exits): from now on the agent judges it by the end-of-run
    bound, not the training timeout. The first end counts."""
    s = _slot
    if s is not None and not s[F_END_NS]:
        s[F_END_NS] = time.monotonic_ns()


def _ending_first(shutdown):
    @functools.wraps(shutdown)
    def marked():
        _ended()
        return shutdown()

    marked.__fastelastic_marked__ = True
    return marked


def _finishing():
    """The last atexit handler: the end is marked again (the exit's handlers, an upload, are
    done: the interpreter's teardown gets the end-of-run bound of its own), and faulthandler's
    handler is about to go, so the agent must not send the dump signal (its default action
    would kill the process)."""
    s = _slot
    if s is None:
        return
    s[F_END_NS] = time.monotonic_ns()
    s[F_DUMP_SIG] = 0


def _finishing_after(fn):
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        finally:
            if not args and not kwargs.get("group"):  # the default group: the rank is done
                _ended()

    marked.__fastelastic_marked__ = True
    return marked


def _arm_dump():
    """Registers the stack dump (all threads, from the C signal handler, GIL or not)."""
    global _stacks
    s = _slot
    if s is None or s[F_DUMP_SIG]:
        return
    path = _mm_path()
    if path is None:
        return
    _stacks = open(path, "ab", buffering=0)  # noqa: SIM115 - held for the process's life
    faulthandler.register(DUMP_SIGNAL, file=_stacks, all_threads=True, chain=False)
    s[F_DUMP_SIG] = DUMP_SIGNAL


def _mm_path():
    p = _slot_path[0]
    return None if p is None else p + ".stacks"


def step():
    """One unit of progress (as an optimizer step is); a no-op outside a hang-checked worker."""
    s = _slot
    if s is not None:
        s[F_STEPS] += 1
        s[F_LAST_NS] = time.monotonic_ns()
        if not s[F_DUMP_SIG]:
            _arm_dump()


def _on_step(optimizer, args, kwargs, _now=time.monotonic_ns):
    s = _slot
    if s is not None:
        s[F_STEPS] += 1
        s[F_LAST_NS] = _now()
        if s[F_EVAL_NS]:
            s[F_EVAL_NS] = 0  # an optimizer step ends an evaluation


def _enter(kind):
    s = _slot
    if s is None:
        return
    with _lock:
        if not s[F_SUSPEND]:
            s[F_SUSPEND_NS] = time.monotonic_ns()
        s[F_SUSPEND] += 1
        s[F_SUSPEND_KIND] |= kind


def _exit(kind):
    s = _slot
    if s is None:
        return
    with _lock:
        s[F_SUSPEND] = max(0, s[F_SUSPEND] - 1)
        if not s[F_SUSPEND]:
            s[F_SUSPEND_KIND] = 0
            s[F_LAST_NS] = time.monotonic_ns()  # the time it took was not a stall


class suspend:  # noqa: N801 - used as a context manager, like a function
    """Marks a section that may make no progress for long (a custom upload, an evaluation).

    ``with fastelastic.progress.suspend(): ...``; a hang verdict waits while any rank is in one.
    """

    def __init__(self, kind=K_CUSTOM):
        self.kind = kind

    def __enter__(self):
        _enter(self.kind)
        return self

    def __exit__(self, *exc):
        _exit(self.kind)
        return False


def _suspending(fn, kind):
    @functools.wraps(fn)
    def marked(*args, **kwargs):
        _enter(kind)
        try:
            return fn(*args, **kwargs)
        finally:
            _exit(kind)

    marked.__fastelastic_marked__ = True
    return marked


_wrappers: dict = {}  # id(original) -> (original, its one wrapper)


def _replace(modules, name, make):
    """Puts ``make(fn)`` in place of ``name`` in each module, one wrapper per original:
    ``torch.save is torch.serialization.save`` stays true (pickle finds a function by its
    module and name, and checks it is the same object)."""
    for mod in modules:
        fn = getattr(mod, name, None) if mod is not None else None
        if fn is None or getattr(fn, "__fastelastic_marked__", False):
            continue
        got = _wrappers.get(id(fn))
        if got is None or got[0] is not fn:
            got = _wrappers[id(fn)] = (fn, make(fn))
        setattr(mod, name, got[1])


def _wrap(modules, name, kind):
    _replace(modules, name, lambda fn: _suspending(fn, kind))


def _stepping(fn):
    """``fn`` (a whole step, as a CUDA graph's replay is), then one step marked."""

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        out = fn(*args, **kwargs)
        s = _slot
        if s is not None:
            s[F_STEPS] += 1
            s[F_LAST_NS] = time.monotonic_ns()
        return out

    marked.__fastelastic_marked__ = True
    return marked


def _hook_torch():
    """The optimizer-step hook, torch.save/load and model.eval()/train() marks."""
    global _opt_handle
    torch = sys.modules.get("torch")
    optimizer = sys.modules.get("torch.optim.optimizer")
    if torch is None or optimizer is None or _opt_handle is not None or _slot is None:
        return
    _opt_handle = optimizer.register_optimizer_step_post_hook(_on_step)
    ser = sys.modules.get("torch.serialization")
    _wrap((ser, torch), "save", K_SAVE)
    _wrap((ser, torch), "load", K_LOAD)
    _replace([sys.modules.get(name) for name in
              ("torch.distributed.distributed_c10d", "torch.distributed")],
             "destroy_process_group", _finishing_after)
    graph = getattr(sys.modules.get("torch.cuda.graphs"), "CUDAGraph", None)
    if graph is not None and not getattr(graph.replay, "__fastelastic_marked__", False):
        graph.replay = _stepping(graph.replay)  # a whole-step CUDA graph calls no optimizer
    module = getattr(getattr(torch, "nn", None), "Module", None)
    if module is not None and not getattr(module.train, "__fastelastic_marked__", False):
        module.train = _marking_train(module.train)
    _slot[F_HOOKED] = 1
    _arm_dump()


def _marking_train(train):
    """``Module.train``: the outermost ``eval()`` starts an evaluation, ``train()`` ends it.

    Costs nothing per forward pass (a global forward hook would cost every module call and
    be guarded on by torch.compile). It cannot see an evaluation run in train mode, nor one
    in a module whose class overrides ``train`` without calling ``Module.train``.
    """

    @functools.wraps(train)
    def marked(self, mode=True):
        global _train_depth
        _train_depth += 1
        try:
            return train(self, mode)
        finally:
            _train_depth -= 1
            s = _slot
            if _train_depth == 0 and s is not None:
                if mode:
                    if s[F_EVAL_NS]:
                        s[F_EVAL_NS] = 0
                        s[F_LAST_NS] = time.monotonic_ns()
                elif not s[F_EVAL_NS]:
                    s[F_EVAL_NS] = time.monotonic_ns()

    marked.__fastelastic_marked__ = True
    return marked


def _hook_checkpoint():
    dcp = sys.modules.get("torch.distributed.checkpoint")
    if dcp is None or _slot is None:
        return
    saver = sys.modules.get("torch.distributed.checkpoint.state_dict_saver")
    loader = sys.modules.get("torch.distributed.checkpoint.state_dict_loader")
    for mods, names in (((saver, dcp), ("save", "save_state_dict", "async_save")),
                        ((loader, dcp), ("load", "load_state_dict"))):
        for name in names:
            _wrap(mods, name, K_CHECKPOINT)


_leftover: list = []  # (name, module): the bootstrap's module, to leave sys.modules


def drop_module_later(name, module):
    """Takes ``module`` out of ``sys.modules[name]`` at the next import (the bootstrap's)."""
    _leftover.append((name, module))
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(set()))


def _drop_leftover():
    while _leftover:
        name, module = _leftover.pop()
        if sys.modules.get(name) is module:
            del sys.modules[name]


_WATCHED = {"torch": _hook_torch, "torch.distributed.checkpoint": _hook_checkpoint}
# the module whose presence says a watched one finished importing (torch imports torch.optim)
_WATCHED_DONE = {"torch": "torch.optim", "torch.distributed.checkpoint":
                 "torch.distributed.checkpoint.state_dict_saver"}


class _AfterImport:
    """A ``sys.meta_path`` finder that runs a hook once a watched module finished importing.

    It finds nothing itself: for a watched name it asks the finders after it and wraps the
    loader's ``exec_module``; every other import costs one set lookup. It leaves
    ``sys.meta_path`` once every watched module was seen.
    """

    def __init__(self, pending=None):
        self.pending = set(_WATCHED) if pending is None else pending

    def find_spec(self, name, path=None, target=None):
        if _leftover:
            _drop_leftover()
        if name not in self.pending:
            if not self.pending:
                self._leave()
            return None
        self.pending.discard(name)
        if not self.pending:
            self._leave()
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        run = getattr(loader, "exec_module", None)
        if run is None:
            return spec
        hook = _WATCHED[name]

        def exec_module(module):
            run(module)
            hook()

        try:
            loader.exec_module = exec_module
        except (AttributeError, TypeError):
            return spec
        return spec

    def _leave(self):
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
