"""A training loop that checkpoints into the agent's memory every step (fastelastic.checkpoint).

Settings from the environment (CKPT_*); every event is appended to $CKPT_OUT/steps.jsonl as
{"rank", "restart", "event", "step", "digest"}: "restored" once per start, "saved" per step.
The digest is a SHA-256 of every tensor of the model and the optimizer, so a test compares a
restored state with the saved one bit for bit.
"""

import hashlib
import json
import os
import signal
import time

import torch

import fastelastic.checkpoint as fc
from fastelastic.checkpoint import _worker

RANK = int(os.environ.get("RANK", "0"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
OUT = os.environ["CKPT_OUT"]
STEPS = int(os.environ.get("CKPT_STEPS", "8"))
WIDTH = int(os.environ.get("CKPT_WIDTH", "64"))
STEP_S = float(os.environ.get("CKPT_STEP_S", "0"))
CRASH_AT = int(os.environ.get("CKPT_CRASH_AT", "-1"))  # on the first start only
CRASH_RANK = int(os.environ.get("CKPT_CRASH_RANK", "0"))
CRASH_HOW = os.environ.get("CKPT_CRASH_HOW", "after_save")  # | mid_save | hang
TRIPWIRE_AT = int(os.environ.get("CKPT_TRIPWIRE_AT", "-1"))
ASYNC = os.environ.get("CKPT_ASYNC") == "1"
DISK = os.environ.get("CKPT_DISK")  # a root: step N is saved with checkpoint_id=<root>/step-N
DISK_WAIT = os.environ.get("CKPT_DISK_WAIT", "")  # "each": wait() after each save; "end"
SYNC = os.environ.get("CKPT_SYNC") == "1"  # a gloo group, a barrier per step (several nodes)
BALLAST = {int(a): int(b) for a, b in (x.split(":") for x in
                                       os.environ.get("CKPT_BALLAST", "").split(",") if x)}


class Tripwire:
    """A saved item whose unpickling leaves a file behind: a test sees whether it was."""

    def __reduce__(self):
        return (_tripped, (os.path.join(OUT, f"tripped.{RANK}"),))


def _tripped(path):
    with open(path, "w") as f:
        f.write("unpickled\n")
    return "tripwire"


def note(**kw):
    with open(os.path.join(OUT, "steps.jsonl"), "a") as f:
        f.write(json.dumps({"rank": RANK, "restart": RESTART, "pid": os.getpid(),
                            "t": time.time(), **kw}) + "\n")


def digest(model, opt):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            h.update(st[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def state(model, opt, step):
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"step": step}}
    if step == TRIPWIRE_AT:
        sd["extra"]["tripwire"] = Tripwire()
    if step in BALLAST:  # MB of bytes whose disk write takes long under a paced agent
        sd["ballast"] = torch.full((BALLAST[step] << 18,), float(step))
    return sd


def save(sd, step):
    cid = None if DISK is None else os.path.join(DISK, f"step-{step}")
    if ASYNC:
        fut = fc.async_save(sd, step=step, checkpoint_id=cid)
        fut.result()
        return fut
    return fc.save(sd, step=step, checkpoint_id=cid)


def crash_mid_save():
    real = _worker._copy_tensor
    done = []

    def copy_then_die(dst, src):
        real(dst, src)
        done.append(1)
        if len(done) == 2:  # half a shard written: the agent has it reserved, not committed
            os.kill(os.getpid(), signal.SIGKILL)

    _worker._copy_tensor = copy_then_die


def main():
    if SYNC:  # the ranks of every node keep in step, as a job's collectives make them
        import torch.distributed as dist

        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(),
                                torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {}}
    t0 = time.perf_counter()
    restored = fc.load(sd)
    load_s = time.perf_counter() - t0
    if restored is not None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        assert sd["extra"]["step"] == restored, (sd["extra"], restored)
    on_disk = fc.latest(DISK) if DISK else None
    note(event="restored", step=restored, digest=digest(model, opt), load_s=load_s,
         latest=None if on_disk is None else on_disk.step,
         early=_worker.last_restore.get("early_used") if restored is not None else None)
    if restored is not None and DISK and DISK_WAIT:
        # the step of the failure, written behind this restart
        note(event="disk", step=restored, status=_worker.disk_wait(restored, 120))
    handles = {}
    if restored is None:  # step 0: Adam holds no state yet (it appears at the first step)
        fc.save(state(model, opt, 0), step=0)
        note(event="saved", step=0, digest=digest(model, opt))
    for step in range((restored or 0) + 1, STEPS + 1):
        g = torch.Generator().manual_seed(step * 1000 + RANK)
        x = torch.randn(8, WIDTH, generator=g)
        loss = model(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if STEP_S:
            time.sleep(STEP_S)
        if SYNC:
            torch.distributed.barrier()
        crash_here = RESTART == 0 and RANK == CRASH_RANK and step == CRASH_AT
        if crash_here and CRASH_HOW == "mid_save":
            crash_mid_save()
        handles[step] = save(state(model, opt, step), step)
        note(event="saved", step=step, digest=digest(model, opt))
        if DISK_WAIT == "each":
            note(event="disk", step=step, status=handles[step].wait(120))
        if crash_here and CRASH_HOW == "after_save":
            os.kill(os.getpid(), signal.SIGKILL)
        if crash_here and CRASH_HOW == "hang":
            time.sleep(3600)
    if DISK_WAIT == "end":
        for step, h in handles.items():
            note(event="disk", step=step, status=h.wait(120))
    note(event="done", step=STEPS)
    if SYNC:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
