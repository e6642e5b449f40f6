"""A plain worker's runner (stdlib only): ``python [-u] THIS_FILE (SCRIPT | -m MODULE) ARGS``.

Never imported by fastelastic: the agent starts a plain Python worker through this file (see
:func:`fastelastic.multiprocessing.api.plain_command`), which runs the program as
``python [-u] SCRIPT ARGS`` (or ``-m MODULE ARGS``) would, then ends it as the zygote's workers
end: Python's exit minus the interpreter's teardown.

What the program sees is what the interpreter gives it: a fresh ``__main__`` (``__file__``
absolute, ``__spec__`` None, a ``SourceFileLoader``; or runpy's for ``-m``), ``sys.argv`` as
given (``-m``: the module's file first), ``sys.path[0]`` the script's real directory (the cwd
for ``-m``; nothing under ``-P``), ``sys.orig_argv`` without this file, its traceback from its
own first frame. Its exit status is Python's: 0, ``SystemExit``'s code (a non-integer code
printed, status 1), 1 after the traceback of an uncaught exception (``sys.excepthook``), death
by SIGINT after a ``KeyboardInterrupt``'s traceback, 120 when stdout cannot be flushed.

It ends as ``_worker_end.end`` does: Python's exit minus the interpreter's teardown, where a
program that keeps its gloo process group can abort. ``FASTELASTIC_PLAIN_RUNNER=0`` (the
agent's environment) starts the program directly, with that teardown.
"""

import os
import sys


def _load_end():
    """``_worker_end.py`` beside this file, by path (see its docstring)."""
    from importlib.util import module_from_spec, spec_from_file_location

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_worker_end.py")
    spec = spec_from_file_location("_fastelastic_worker_end", path)
    mod = module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_END = _load_end()


def _fresh_main():
    import types

    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = sys.modules["builtins"]
    sys.modules["__main__"] = main
    return main


def _run(argv, safe_path):
    """Runs the program; returns its uncaught exception and the traceback to show, if any."""
    if argv[0] == "-m":
        import runpy

        sys.argv = argv[1:]
        sys.argv[0] = "-m"  # as the interpreter has it until runpy finds the module
        if not safe_path:
            sys.path[0] = os.getcwd()
        _fresh_main()
        run = runpy._run_module_as_main
        try:
            run(argv[1], alter_argv=True)
        except BaseException as e:  # noqa: BLE001 - handed back to the top level
            return e, _END.trim(e.__traceback__, lambda c: c.co_name == "_run_module_as_main")
        return None
    from importlib.machinery import SourceFileLoader

    path = os.path.abspath(argv[0])
    sys.argv = list(argv)
    if not safe_path:
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    main = _fresh_main()
    loader = SourceFileLoader("__main__", path)
    main.__dict__.update(__file__=path, __cached__=None, __loader__=loader)
    try:
        with open(path, "rb") as f:
            code = compile(f.read(), path, "exec", dont_inherit=True)
    except SyntaxError as e:
        return e, None  # the interpreter shows the error alone, with no traceback
    except BaseException as e:  # noqa: BLE001 - e.g. the file is gone or unreadable
        return e, _END.trim(e.__traceback__, lambda c: False)
    del argv
    try:
        exec(code, main.__dict__)
    except BaseException as e:  # noqa: BLE001 - handed back to the top level
        return e, _END.trim(e.__traceback__, lambda c: c.co_filename == path)
    return None


def _report(exc, tb):
    """Shows an uncaught exception as the interpreter does (``sys.excepthook``, ``sys.last_*``)."""
    exc.__traceback__ = tb
    sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
    try:
        sys.excepthook(type(exc), exc, tb)
    except BaseException as hook_error:  # noqa: BLE001 - as the interpreter: both are shown
        import traceback

        print("Error in sys.excepthook:", file=sys.stderr)
        traceback.print_exception(hook_error)
        print("\nOriginal exception was:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, tb)


def _main():
    me = sys.argv[0]
    argv = sys.argv[1:]
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print(f"{me}: expected SCRIPT ARGS or -m MODULE ARGS", file=sys.stderr)
        os._exit(2)
    orig = list(getattr(sys, "orig_argv", ()))
    if me in orig:
        del orig[orig.index(me)]
        sys.orig_argv = orig
    runner = sys.modules["__main__"]  # noqa: F841 - this file's module, kept while it runs
    failed = _run(argv, bool(getattr(sys.flags, "safe_path", False)))
    del argv
    if failed is None:
        _END.end(0)
    exc, tb = failed
    del failed
    if isinstance(exc, SystemExit):
        _END.end(_END.exit_code(exc))
    sigint = isinstance(exc, KeyboardInterrupt)
    _report(exc, tb)
    del exc, tb
    _END.end(1, sigint)


if __name__ == "__main__":
    _main()
