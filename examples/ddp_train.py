"""Train a small model with torch DDP on CPU (gloo), checkpointing and resuming after a restart.

Run it with 4 workers on this machine::

    fastrun --standalone --nproc-per-node 4 examples/ddp_train.py

Make the first attempt crash (rank 1 at step 30) and watch the restarted group resume from the
last checkpoint instead of step 0::

    fastrun --standalone --nproc-per-node 4 --max-restarts 1 examples/ddp_train.py --fail-at 30

The model regresses a fixed random linear map plus a small nonlinearity on synthetic data that
every rank generates from the same seed and shards by rank, so no dataset is downloaded. Rank 0
saves ``{model, optimizer, step}`` every ``--ckpt-every`` steps with an atomic rename; after a
restart (``TORCHELASTIC_RESTART_COUNT`` > 0) every rank loads that file and continues.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

try:  # the error file makes fastrun's failure report show this worker's traceback
    from fastelastic.multiprocessing.errors import record
except ImportError:  # running under plain torchrun without fastelastic installed
    from torch.distributed.elastic.multiprocessing.errors import record


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=64, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--ckpt-dir", default=None,
                   help="default: <tmp>/fastelastic-ddp-<TORCHELASTIC_RUN_ID>; must be shared "
                   "by all nodes when they run on different machines")
    p.add_argument("--fail-at", type=int, default=-1,
                   help="on the first attempt, rank --fail-rank exits with an error at this step")
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--out", default=None, help="rank 0 writes a JSON summary here")
    p.add_argument("--progress", default=None,
                   help="every rank appends one JSON line per completed step (and the injected "
                   "failure) to this file: rank, step, restart, wall time, pid, ppid")
    return p.parse_args()


class Net(nn.Module):
    def __init__(self, d_in: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _dataset(n: int = 8192, d: int = 32, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g) / d**0.5
    y = x @ w + 0.1 * torch.sin(3 * x[:, :1]) + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def _progress(path: str | None, **event: object) -> None:
    if path:
        event.update(t=time.time(), pid=os.getpid(), ppid=os.getppid())
        line = (json.dumps(event) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one short O_APPEND write: lines of ranks never interleave
        finally:
            os.close(fd)


def _save(path: str, model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # readers see the old or the new checkpoint, never half of one


# The handles of the collectives run on tensors made here, kept until the process ends.
_HELD: list[dist.Work] = []


def _wait(work: dist.Work) -> None:
    """Waits for a collective on tensors made in Python, and keeps its handle for good.

    A gloo thread drops a finished work a moment after the collective returned (torch 2.13),
    and dropping the last C++ reference to a tensor that has a Python object takes the GIL.
    While we hold the handle, the work outlives that thread's references, so the thread drops
    none of its tensors: it never waits for the GIL, and ~ProcessGroupGloo, which joins the
    thread with the GIL held, cannot deadlock on it. The collectives DDP runs itself (its
    gradient buckets, its start-up broadcast) and barriers use tensors made in C++, which
    have no Python object.
    """
    work.wait()
    _HELD.append(work)


@record
def main() -> None:
    args = _args()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # Plain env:// initialisation, as any torchrun script does. Each restart gets a fresh store
    # from the rendezvous, so the restarted group never reads the dead attempt's addresses.
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "local")
    ckpt_dir = args.ckpt_dir or os.path.join(tempfile.gettempdir(), f"fastelastic-ddp-{run_id}")
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, "checkpoint.pt")

    torch.manual_seed(0)  # same initial weights everywhere (DDP also broadcasts rank 0's)
    model = DDP(Net())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if os.path.exists(ckpt):
        state = torch.load(ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    starts = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
    _wait(dist.all_gather(starts, torch.tensor([start]), async_op=True))
    if len({int(t.item()) for t in starts}) != 1:  # e.g. --ckpt-dir not shared between machines
        raise RuntimeError(
            f"ranks found different checkpoints in {ckpt_dir} (steps by rank: "
            f"{[int(t.item()) for t in starts]}); use a --ckpt-dir every node can read"
        )
    if rank == 0:
        print(f"[ddp_train] world={world} restart={restart} resuming_from_step={start}", flush=True)

    x, y = _dataset()
    shard_x, shard_y = x[rank::world], y[rank::world]
    g = torch.Generator().manual_seed(rank)
    loss_fn = nn.MSELoss()
    t0 = time.monotonic()
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        if step == args.fail_at and restart == 0 and rank == args.fail_rank:
            _progress(args.progress, event="crash", rank=rank, step=step, restart=restart)
            raise RuntimeError(f"injected failure at step {step} on rank {rank}")
        idx = torch.randint(0, shard_x.shape[0], (args.batch,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(shard_x[idx]), shard_y[idx])
        loss.backward()  # DDP all-reduces the gradients over gloo here
        opt.step()
        done = step + 1
        _progress(args.progress, event="step", rank=rank, step=done, restart=restart)
        if done % args.ckpt_every == 0 or done == args.steps:
            if rank == 0:
                _save(ckpt, model.module, opt, done)
            dist.barrier()  # nobody runs ahead of a checkpoint that a restart would use
        if rank == 0 and (done % 20 == 0 or done == args.steps):
            print(f"[ddp_train] step {done}/{args.steps} loss {loss.item():.5f}", flush=True)

    final = torch.tensor([loss.item()])
    _wait(dist.all_reduce(final, async_op=True))
    mean_loss = final.item() / world
    if rank == 0:
        summary = {
            "world_size": world,
            "restart_count": restart,
            "resumed_from_step": start,
            "steps": args.steps,
            "final_loss": mean_loss,
            "seconds": round(time.monotonic() - t0, 3),
        }
        print(f"[ddp_train] done: {json.dumps(summary)}", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(summary, f)
    # Everyone reaches the end before anyone tears gloo down: a rank that exits while a peer
    # still has collectives in flight can make the peer's gloo thread abort (seen under load).
    dist.barrier()
    # Then the model, then the group. ~ProcessGroupGloo joins gloo's threads while holding the
    # GIL, where the group's last reference goes: here, or in DDP's Reducer, or never (torch
    # keeps it referenced when torch._dynamo was imported after init_process_group, as DDP and
    # the optimizers import it). Wherever that is, no gloo thread needs the GIL: see _wait.
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # Leave without Python's teardown, which would drop _HELD's handles (see _wait) while a
    # group that outlived destroy_process_group (above) may still have gloo threads, and a
    # thread that asks for the GIL while Python finalises is ended by pthread_exit through a
    # C++ destructor, which is std::terminate: SIGABRT, and a rank that trained to the end
    # would be reported as failed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
