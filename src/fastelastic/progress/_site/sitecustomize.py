"""fastelastic's bootstrap of a plain worker started under ``--hang-timeout`` (stdlib only).

The agent puts this directory first on the worker's ``PYTHONPATH``; Python's ``site`` imports
this file before the program runs. It puts the environment and ``sys.path`` back as they
were without it, maps the worker's progress slot, then imports the user's own
``sitecustomize`` (if any), as ``site`` would have.
"""

import os
import sys


def _boot():
    here = os.path.dirname(os.path.abspath(__file__))
    env = os.environ
    slot = env.pop("FASTELASTIC_PROGRESS", None)
    saved = env.pop("FASTELASTIC_PROGRESS_PYTHONPATH", None)
    if saved is None:
        env.pop("PYTHONPATH", None)
    else:
        env["PYTHONPATH"] = saved
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path_importer_cache.pop(here, None)
    if slot:
        name = "fastelastic.progress._worker"
        try:
            mod = sys.modules.get(name)
            if mod is None:
                import importlib.util

                path = os.path.join(os.path.dirname(here), "_worker.py")
                spec = importlib.util.spec_from_file_location(name, path)
                mod = importlib.util.module_from_spec(spec)
                sys.modules[name] = mod
                spec.loader.exec_module(mod)
            mod.install(slot)
        except Exception as e:  # noqa: BLE001 - the program runs on without the marks
            sys.modules.pop(name, None)
            print(f"fastelastic: no progress reports from this worker (--hang-timeout): "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
    me = sys.modules.pop("sitecustomize")
    try:
        import sitecustomize  # noqa: F401 - the user's own, if there is one
    except ImportError as e:
        if e.name != "sitecustomize":
            raise
        # the import system takes this module back out of sys.modules when it returns; the
        # next import (site's usercustomize, or the program's first) drops it
        sys.modules["sitecustomize"] = me
        worker = sys.modules.get("fastelastic.progress._worker")
        if worker is not None:
            worker.drop_module_later("sitecustomize", me)


_boot()
del _boot
