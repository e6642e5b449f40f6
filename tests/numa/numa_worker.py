"""A worker that records its CPU affinity (and torch's thread count when asked), once per start."""

import json
import os
import sys
import time

out = os.environ["NUMA_TEST_OUT"]
rank = int(os.environ["LOCAL_RANK"])
restart = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
info = {"rank": rank, "restart": restart, "cpus": sorted(os.sched_getaffinity(0)),
        "ppid": os.getppid()}
if os.environ.get("NUMA_TEST_TORCH") == "1":
    import torch

    info["threads"] = torch.get_num_threads()
with open(os.path.join(out, f"{restart}-{rank}.json"), "w") as f:
    json.dump(info, f)
if os.environ.get("NUMA_TEST_FAIL_ONCE") == "1" and restart == 0 and rank == 0:
    # fail once, after rank 1 recorded its start (else the restart may stop it before that)
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "0-1.json")) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.exit(3)
