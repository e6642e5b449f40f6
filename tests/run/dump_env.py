#!/usr/bin/env python3
"""Worker used by the tests: writes its environment, argv and cwd as JSON, then waits if asked."""

import json
import os
import sys
import time

out = os.environ["DUMP_DIR"]
rank = os.environ.get("RANK", "norank")
data = {"env": dict(os.environ), "argv": sys.argv, "cwd": os.getcwd(), "module": __name__,
        "pid": os.getpid(), "ppid": os.getppid()}
tmp = os.path.join(out, f".{rank}.{os.getpid()}.tmp")
with open(tmp, "w") as f:
    json.dump(data, f)
os.replace(tmp, os.path.join(out, f"{rank}.json"))
gate = os.environ.get("DUMP_WAIT_FOR")
only_group = os.environ.get("DUMP_WAIT_GROUP")
if gate and only_group is not None and os.environ.get("GROUP_RANK") != only_group:
    gate = None
if gate:  # hold the job open until the test says so (bounded)
    deadline = time.monotonic() + 60
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.05)
