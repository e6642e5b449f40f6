"""A worker's end, shared by the plain runner and the zygote (stdlib only, loaded by path).

Never imported by fastelastic: ``_plain_boot.py`` and ``_zygote_boot.py`` load this file by path,
under a private name and outside ``sys.modules``, so a worker holds no fastelastic
module that ``python script.py`` would not have.

:func:`end` is Python's exit minus the interpreter's teardown: it waits for the non-daemon
threads, runs the ``atexit`` handlers, flushes stdio and every file left open, then leaves by
``os._exit``. The teardown it skips (module globals freed, objects' ``__del__``) is where a
program that keeps its gloo process group aborts or hangs: freeing the group runs
``~ProcessGroupGloo`` while a gloo thread, which holds the last reference to a finished work
and through it to a Python tensor, asks for the GIL to drop it; Python ends a thread that asks
for the GIL while it finalises with ``pthread_exit``, whose forced unwind through the work's
``noexcept`` destructor is ``std::terminate`` (SIGABRT), and ``~ProcessGroupGloo`` joins that
thread holding the GIL. The teardown also takes 0.7 s with torch loaded.
"""

import os
import sys


def trim(tb, keep):
    """The traceback from its first frame ``keep`` accepts (what the interpreter would show)."""
    t = tb
    while t is not None and not keep(t.tb_frame.f_code):
        t = t.tb_next
    return t if t is not None else tb


def exit_code(exc):
    """The status the interpreter exits with for an uncaught ``SystemExit`` (printing a
    non-integer code, as it does)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    try:
        print(exc.code, file=sys.stderr)
    except Exception:  # noqa: BLE001, S110 - as the interpreter, which ignores it too
        pass
    return 1


def flush_open_files():
    """Flushes stdio and every file object still open, as the teardown would by closing them.
    False when stdout or stderr cannot be flushed (the interpreter then exits 120)."""
    ok = True
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None and not stream.closed:
                stream.flush()
        except Exception:  # noqa: BLE001 - as the interpreter's flush_std_files
            ok = False
    import gc
    import io

    types_ = (io.TextIOWrapper, io.BufferedWriter, io.BufferedRandom)
    for obj in gc.get_objects():  # a zygote's own objects are frozen: not listed
        if issubclass(type(obj), types_):  # type(): no __class__ of a proxy is run
            try:
                if not obj.closed:
                    obj.flush()
            except Exception:  # noqa: BLE001, S112 - the teardown would have ignored it too
                continue
    return ok


def end(code, sigint=False):
    """Ends the worker as the interpreter would, minus its teardown; never returns. ``sigint``:
    death by SIGINT, as the interpreter after a ``KeyboardInterrupt``."""
    threading = sys.modules.get("threading")
    try:
        if threading is not None:
            threading._shutdown()  # what Py_FinalizeEx calls first
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
        finally:
            if not flush_open_files():
                code = 120
            if sigint:
                import signal

                signal.signal(signal.SIGINT, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGINT)
            os._exit(code)
