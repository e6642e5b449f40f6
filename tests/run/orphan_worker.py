#!/usr/bin/env python3
"""Worker for the PID-1 tests: leaves orphans, as daemonising helpers do, then reports zombies.

Starts ``$ORPHANS`` (default 3) short-lived grandchildren whose parent exits at once (``sh -c
'sleep 0.2 &'``): each is re-parented to PID 1 of the PID namespace and exits 0.2 s later. Once
they all exited (1.5 s), it lists every zombie of the namespace (``/proc``, mounted for it)
into ``$DUMP_DIR/zombies.<RANK>`` as ``<pid> <ppid> <name>`` lines, then sleeps
``$WORKER_SLEEP`` seconds (default 0) and exits 0.
"""

import os
import subprocess
import time

out, rank = os.environ["DUMP_DIR"], os.environ["RANK"]
for _ in range(int(os.environ.get("ORPHANS", "3"))):
    subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True, timeout=10)
time.sleep(1.5)  # the orphans' 0.2 s, and PID 1's time to reap them
zombies = []
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        continue  # exited and reaped meanwhile
    name, _, rest = stat.partition(" (")[2].rpartition(") ")
    state, ppid = rest.split()[:2]
    if state == "Z":
        zombies.append(f"{pid} {ppid} {name}")
with open(os.path.join(out, f"zombies.{rank}"), "w") as f:
    f.write("".join(z + "\n" for z in zombies))
time.sleep(float(os.environ.get("WORKER_SLEEP", "0")))
