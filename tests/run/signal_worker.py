#!/usr/bin/env python3
"""Worker for the Slurm tests: handles SIGUSR1 as a checkpointing job would.

On SIGUSR1 it writes ``$DUMP_DIR/usr1.<RANK>``, then exits with status 0
(``SIGNAL_WORKER_MODE=exit``) or goes on working (``stay``, as Lightning's requeue handler
does). On SIGTERM it writes ``term.<RANK>`` and exits with status 0. Once its handlers are
installed it writes what dump_env.py writes (its "ready" mark) and works for at most 120 s.
"""

import json
import os
import signal
import sys
import time

out = os.environ["DUMP_DIR"]
rank = os.environ["RANK"]


def on_usr1(signum, frame):
    with open(os.path.join(out, f"usr1.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if os.environ.get("SIGNAL_WORKER_MODE") == "exit":
        sys.exit(0)


def on_term(signum, frame):  # a job saving its state at the time limit, then leaving
    with open(os.path.join(out, f"term.{rank}"), "w") as f:
        f.write(str(os.getpid()))
    sys.exit(0)


signal.signal(signal.SIGUSR1, on_usr1)
signal.signal(signal.SIGTERM, on_term)
data = {"env": dict(os.environ), "argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid()}
tmp = os.path.join(out, f".{rank}.tmp")
with open(tmp, "w") as f:
    json.dump(data, f)
os.replace(tmp, os.path.join(out, f"{rank}.json"))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit(7)  # never reached in the tests: the launcher stops it first
