"""A gloo worker for the recovery tests: every step is an all_reduce of its whole world.

Appends one JSON line ``{"node", "t", "world", "wid", "rank", "restart"}`` to
``$RECOVERY_OUT/steps.jsonl`` after each step (``wid``: the world's store address, one per
round), every 0.25 s, for ``$NODE_RUN_S`` seconds (default 600). A step logged means every rank
of that world took part in it: a world whose steps are logged is training. With ``$ORPHANS``
set it first leaves that many orphans (``sh -c 'sleep 0.2 &'``), as a daemonising helper does:
re-parented to PID 1 of its PID namespace (the launcher, in a pod), which must reap them.
"""

import json
import os
import subprocess
import time

import torch
import torch.distributed as dist


def main() -> None:
    for _ in range(int(os.environ.get("ORPHANS", "0"))):
        subprocess.run(["sh", "-c", "sleep 0.2 & exit 0"], check=True, timeout=10)
    dist.init_process_group("gloo")
    x = torch.ones(1)
    path = os.path.join(os.environ["RECOVERY_OUT"], "steps.jsonl")
    meta = {"node": os.environ.get("NODE_NAME", "?"), "world": dist.get_world_size(),
            "wid": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
            "rank": dist.get_rank(), "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"])}
    end = time.monotonic() + float(os.environ.get("NODE_RUN_S", "600"))
    while time.monotonic() < end:
        dist.all_reduce(x)
        line = json.dumps({**meta, "t": time.time()}) + "\n"
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
        os.close(fd)
        time.sleep(0.25)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
