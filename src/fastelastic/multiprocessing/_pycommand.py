"""A worker command that is a Python interpreter running a script or a module, parsed (a leaf
module: the zygote forks such commands, and a plain start runs them through its runner)."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from typing import Any

__all__ = ["PythonCommand", "python_command"]

_SUPPORTED_OPTIONS = ("-u",)
_PYTHON_RE = re.compile(r"^python[0-9.]*$")


@dataclass(frozen=True)
class PythonCommand:
    """A worker command ``EXE [OPTIONS] (SCRIPT | -m MODULE) ARGS`` the zygote can run."""

    exe: str
    options: tuple[str, ...]
    module: bool
    target: str  # the script path or the module name
    args: tuple[str, ...]

    def path0(self) -> str:
        """``sys.path[0]`` of the interpreter: the script's real directory, or the cwd for -m."""
        if self.module:
            return os.getcwd()
        return os.path.dirname(os.path.realpath(self.target))


def python_command(entrypoint: Any, args: tuple) -> PythonCommand | str:
    """Parses a worker command; returns why the zygote cannot run it when it cannot."""
    if not isinstance(entrypoint, str):
        return "the entrypoint is a function (--run-path or the API), not a Python command"
    exe = os.path.basename(entrypoint)
    same = os.path.realpath(entrypoint) == os.path.realpath(sys.executable)
    if not _PYTHON_RE.match(exe) and not same:
        return f"the entrypoint {entrypoint!r} is not a Python interpreter (--no-python)"
    items = [str(a) for a in args]
    options: list[str] = []
    i = 0
    while i < len(items) and items[i].startswith("-") and items[i] != "-m":
        if items[i] not in _SUPPORTED_OPTIONS:
            return f"interpreter option {items[i]!r} is not supported by the zygote"
        options.append(items[i])
        i += 1
    module = i < len(items) and items[i] == "-m"
    if module:
        i += 1
    if i >= len(items):
        return "no script or module to run"
    target = items[i]
    if not module and not os.path.isfile(target):
        return f"{target!r} is not a regular script file"
    return PythonCommand(entrypoint, tuple(options), module, target, tuple(items[i + 1 :]))
