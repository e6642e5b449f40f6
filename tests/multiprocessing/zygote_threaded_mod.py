"""Imported by a zygote in the tests: starts a thread, so forking would lose it."""

import threading

_stop = threading.Event()
threading.Thread(target=_stop.wait, args=(120,), name="preload-thread", daemon=True).start()
