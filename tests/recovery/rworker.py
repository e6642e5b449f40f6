"""A worker for the recovery tests: logs its start, then 'trains' until told to stop.

Appends one JSON line ``{"node", "pid", "t", "world", "rank", "restart"}`` to
``$RECOVERY_OUT/starts.jsonl`` when it starts, then runs ``$NODE_RUN_S`` seconds (default
600) and exits 0. ``etcd_rworker.py`` reuses ``log_start`` and ``train`` with more fields.
"""

import json
import os
import time


def log_start(**extra: object) -> None:
    line = json.dumps({
        "node": os.environ.get("NODE_NAME", "?"), "pid": os.getpid(), "t": time.time(),
        "world": int(os.environ["WORLD_SIZE"]), "rank": int(os.environ["RANK"]),
        "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), **extra,
    }) + "\n"
    fd = os.open(os.path.join(os.environ["RECOVERY_OUT"], "starts.jsonl"),
                 os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, line.encode())  # one write with O_APPEND: lines never interleave
    os.close(fd)


def train() -> None:
    end = time.monotonic() + float(os.environ.get("NODE_RUN_S", "600"))
    while time.monotonic() < end:
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))


if __name__ == "__main__":
    log_start()
    train()
