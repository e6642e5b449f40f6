"""A worker that trains with its peers, then on alone for $FINISH_EXTRA_S more seconds.

With FINISH_TORCH=1 it trains as a gloo world (init_process_group, all_reduce) first. Every
event is appended to $FINISH_OUT/events.jsonl as {"rank", "restart", "pid", "event", "t"}.
"""

import json
import os
import time

OUT = os.environ["FINISH_OUT"]
RANK = int(os.environ["RANK"])
EXTRA_S = float(os.environ.get("FINISH_EXTRA_S", "0"))
TORCH = os.environ.get("FINISH_TORCH") == "1"


def note(event):
    with open(os.path.join(OUT, "events.jsonl"), "a") as f:
        f.write(json.dumps({"rank": RANK, "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]),
                            "pid": os.getpid(), "event": event, "t": time.time()}) + "\n")


def main():
    note("start")
    if TORCH:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(8)
        for _ in range(5):
            dist.all_reduce(t)
        assert float(t[0]) == dist.get_world_size() ** 5
    note("trained")
    end = time.monotonic() + 1.0 + EXTRA_S  # local work, no collective: a last epoch, a save
    n = 0
    while time.monotonic() < end:
        n += 1
        time.sleep(0.01)
    if TORCH:
        dist.destroy_process_group()
    note("done")


if __name__ == "__main__":
    main()
