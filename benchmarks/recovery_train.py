"""The training job of bench_recovery: a gloo DDP loop that checkpoints every step.

Like examples/ddp_train.py (same model, data and checkpoint handling), plus one JSON line per
event appended to ``$RECOVERY_EVENTS``: ``start`` (before torch is imported), ``init`` (process
group up, with the step it resumed from) and ``step`` (every rank after every step).

Usage: ``recovery_train.py CKPT_DIR [--period S]`` (each step takes at least S seconds).
"""

import json
import os
import sys
import time

_T0 = time.time()
_FD = os.open(os.environ["RECOVERY_EVENTS"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
_NODE = os.environ.get("NODE_NAME", "?")


def emit(**kw: object) -> None:
    os.write(_FD, (json.dumps({"node": _NODE, "pid": os.getpid(), **kw}) + "\n").encode())


emit(ev="start", t=_T0)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402


def main() -> None:
    ckpt_dir = sys.argv[1]
    period = float(sys.argv[sys.argv.index("--period") + 1]) if "--period" in sys.argv else 0.1
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = os.path.join(ckpt_dir, "checkpoint.pt")
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    emit(ev="init", t=time.time(), rank=rank, world=world, resumed=start)
    g = torch.Generator().manual_seed(1234 + rank)
    loss_fn = nn.MSELoss()
    for step in range(start, 10**9):
        t0 = time.monotonic()
        x = torch.randn(64, 32, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), x[:, :1])
        loss.backward()  # DDP all-reduces the gradients over gloo
        opt.step()
        if rank == 0:
            tmp = f"{ckpt}.tmp.{os.getpid()}"
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
        dist.barrier()  # the checkpoint of this step is on disk before anyone goes on
        emit(ev="step", t=time.time(), rank=rank, world=world, step=step + 1)
        time.sleep(max(0.0, period - (time.monotonic() - t0)))


if __name__ == "__main__":
    main()
