"""Runs a test that counts this process's fds in a fresh interpreter of its own.

Daemon threads left by earlier tests (an etcd client's lease watch retrying a stopped
cluster, for one) open and close sockets at any moment, so the fd table of the test process
is no measure of what the code under test holds; a fresh interpreter has no such threads.
"""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

_FLAG = "FE_ISOLATED_TEST"


def isolated(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if os.environ.get(_FLAG):
            return fn(*args, **kwargs)
        node = f"{inspect.getsourcefile(fn)}::{fn.__name__}"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly",
                            "-p", "no:cacheprovider", node],
                           env={**os.environ, _FLAG: "1"}, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        assert " passed" in r.stdout, r.stdout[-2000:]

    return wrapper
