"""A healthy DDP loop (gloo, torch.optim.SGD) whose ranks save a DCP checkpoint that takes
HANG_SAVE_S at step HANG_SAVE_AT (a storage writer slow to write, as a slow filesystem is).

``torch.distributed.checkpoint`` is imported late: by the script, after the hang check's
marks were armed (a zygote's worker has torch preloaded, not DCP), before the first step (its
import on a busy machine takes seconds: a wait no rule calls progress). Records go to
$HANG_OUT/steps.jsonl as hang_worker.py's do.
"""

import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

RANK = int(os.environ["RANK"])
RESTART = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
OUT = os.environ["HANG_OUT"]
STEPS = int(os.environ.get("HANG_STEPS", "8"))
STEP_S = float(os.environ.get("HANG_STEP_S", "0.02"))
SAVE_AT = int(os.environ.get("HANG_SAVE_AT", "3"))
SAVE_S = float(os.environ.get("HANG_SAVE_S", "12"))


def note(**kw):
    with open(os.path.join(OUT, "steps.jsonl"), "a") as f:
        f.write(json.dumps({"rank": RANK, "restart": RESTART, "pid": os.getpid(),
                            "t": time.time(), **kw}) + "\n")


def save(model, dcp):
    class SlowWriter(dcp.FileSystemWriter):
        def write_data(self, plan, planner):
            if RANK == 0:
                time.sleep(SAVE_S)  # the storage takes this long; the other ranks wait for it
            return super().write_data(plan, planner)

    path = os.path.join(OUT, f"dcp.{RESTART}")
    t0 = time.monotonic()
    dcp.save({"model": model.state_dict()}, storage_writer=SlowWriter(path))
    note(event="saved", took=time.monotonic() - t0)


def main():
    note(event="start")
    dist.init_process_group("gloo")
    import torch.distributed.checkpoint as dcp  # late, on purpose

    torch.manual_seed(0)
    model = DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    for step in range(STEPS):
        note(step=step)
        if step == SAVE_AT:
            save(model, dcp)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        time.sleep(STEP_S)
    note(event="done")
    del model  # DDP before its process group (item 3 of issue 35: the end is not ours here)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
