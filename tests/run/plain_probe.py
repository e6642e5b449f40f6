"""What a plainly started program sees of its start; prints one JSON line, then exits as
``sys.argv[1]`` says: ``ok`` (returns), ``exit3`` (``SystemExit(3)``), ``raise`` (an uncaught
``ValueError`` from a function of this file), ``exitmsg`` (``sys.exit("a message")``)."""

import json
import os
import sys


def seen() -> dict:
    main = sys.modules["__main__"]
    return {
        "name": __name__,
        "main_is_me": main.__dict__ is globals(),
        "file": __file__,
        "spec": None if __spec__ is None else __spec__.name,
        "loader": type(__loader__).__name__,
        "package": __package__,
        "argv": sys.argv,
        "orig_argv": sys.orig_argv[1:],
        "path0": sys.path[0],
        "unbuffered": not sys.stdout.line_buffering and sys.stdout.write_through,
        "cwd": os.getcwd(),
        "through_runner": any(a.endswith(b"_plain_boot.py") for a in _cmdline()),
    }


def _cmdline() -> list[bytes]:
    with open("/proc/self/cmdline", "rb") as f:
        return f.read().split(b"\0")


def fail() -> None:
    raise ValueError("the probe failed on purpose")


print("SEEN " + json.dumps(seen()), flush=True)
how = sys.argv[1] if len(sys.argv) > 1 else "ok"
if how == "exit3":
    raise SystemExit(3)
if how == "exitmsg":
    sys.exit("a message")
if how == "raise":
    fail()
