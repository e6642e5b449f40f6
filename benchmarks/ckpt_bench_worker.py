"""The worker of bench_checkpoint.py, run by fastrun with one rank; settings from CKPT_BENCH_*.

``stall``: for each size, ``rounds`` interleaved rounds of: one copy of the state into
pre-faulted memory, ``fastelastic.checkpoint.save`` and ``async_save`` (the call), ``torch.save``
to a local file, ``dcp.save`` with ``FileSystemWriter`` and ``dcp.async_save`` (the call, the
default thread stager); seconds per call to ``$CKPT_BENCH_OUT/stall.json``.
``restore``: the first life saves two steps and SIGKILLs itself; the second restores and
records the load's seconds, the crash-to-restored wall time and one copy of the same bytes.
``disk``: training steps that sleep ``$CKPT_BENCH_STEP_S`` (1 s) and save every step: with no
save, ``fc.save`` to memory, ``fc.save`` with a ``checkpoint_id`` (the agent writes it behind),
the same every 10th step, and ``dcp.save`` every step; seconds per step, the stall per save and
what ``wait()`` said of each step (written or skipped), to ``$CKPT_BENCH_OUT/disk.json``.
"""

import json
import os
import shutil
import signal
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import fastelastic.checkpoint as fc
from fastelastic.checkpoint import _worker

MODE = os.environ["CKPT_BENCH_MODE"]
OUT = os.environ["CKPT_BENCH_OUT"]
DISK = os.environ["CKPT_BENCH_DISK"]
SIZES = [int(x) for x in os.environ["CKPT_BENCH_SIZES_MB"].split(",")]
ROUNDS = int(os.environ.get("CKPT_BENCH_ROUNDS", "3"))
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
PIECES = 16  # tensors per state: a model's worth of large parameters, not one blob


def make_state(mb: int) -> dict:
    n = (mb << 20) // 4 // PIECES
    return {"model": {f"layer{i}.weight": torch.randn(n) for i in range(PIECES)},
            "extra": {"epoch": 3, "note": "bench"}}


def tensors(sd: dict) -> list[torch.Tensor]:
    return list(sd["model"].values())


def prefaulted_copy_s(src: list[torch.Tensor], dst: list[torch.Tensor]) -> float:
    t = time.perf_counter()
    for d, s in zip(dst, src, strict=True):
        d.copy_(s)
    return time.perf_counter() - t


def _stall(t0: float, t1: float) -> float:
    """Seconds from the last rank's start to the last rank's end (``time.monotonic``: one clock
    for every process of the node): how much later than without the call the slowest rank can
    go on, as the next step's collective waits for it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return t1 - t0
    t = torch.tensor([t0, t1], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[1] - t[0])


def _gather(obj: dict) -> list:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


STALL_METHODS = ("memcpy", "fc.save", "fc.async_save", "torch.save", "dcp.save", "dcp.async_save")


def stall_one(mb: int, step: int) -> tuple[dict, int]:
    """Rounds of every method, interleaved; each call starts at a barrier of every rank and
    counts from the last rank's start to the last rank's end (``_stall``)."""
    only = [m for m in os.environ.get("CKPT_BENCH_ONLY", "").split(",") if m] or STALL_METHODS
    rank = dist.get_rank()
    sd = make_state(mb)
    dst = [torch.empty_like(t) for t in tensors(sd)]
    prefaulted_copy_s(tensors(sd), dst)  # faults the destination in
    for _ in range(2):  # both buffers reserved and mapped: the steady state
        step += 1
        fc.save(sd, step=step)
    got: dict = {k: [] for k in only}
    phases: list = []
    for r in range(ROUNDS):
        for how in only:
            dist.barrier()
            t = time.monotonic()
            fut = None
            if how == "memcpy":
                prefaulted_copy_s(tensors(sd), dst)
            elif how == "fc.save":
                step += 1
                fc.save(sd, step=step)
            elif how == "fc.async_save":
                step += 1
                fut = fc.async_save(sd, step=step)
            elif how == "torch.save":
                path = os.path.join(DISK, f"t{mb}_{r}_{rank}.pt")
                torch.save(sd, path)
            elif how == "dcp.save":
                d = os.path.join(DISK, f"dcp{mb}_{r}")
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(d))
            elif how == "dcp.async_save":
                d = os.path.join(DISK, f"adcp{mb}_{r}")
                fut = dcp.async_save(sd, storage_writer=dcp.FileSystemWriter(d))
            t1 = time.monotonic()
            dt = t1 - t
            if fut is not None:  # dcp.async_save's thread runs collectives: done before ours
                fut.result()
            got[how].append(_stall(t, t1))
            if how == "fc.save":
                phases.append(_gather({"s": dt, **getattr(_worker, "last_save", {})}))
            if how == "torch.save":
                os.unlink(path)
            elif how.startswith("dcp") and rank == 0:
                shutil.rmtree(d)
    return {"stall": got, "phases": phases}, step


def disk_one(mb: int, step: int) -> tuple[dict, int]:
    sd = make_state(mb)
    steps = int(os.environ.get("CKPT_BENCH_STEPS", "10"))
    step_s = float(os.environ.get("CKPT_BENCH_STEP_S", "1"))
    for _ in range(2):  # both buffers reserved and mapped
        step += 1
        fc.save(sd, step=step)
    got: dict = {}
    for how in ("none", "fc.save", "fc.save+disk", "fc.save+disk/10", "dcp.save"):
        stalls, handles = [], []
        t0 = time.perf_counter()
        for i in range(steps):
            time.sleep(step_s)  # the step's compute
            step += 1
            t = time.perf_counter()
            if how == "fc.save":
                fc.save(sd, step=step)
            elif how == "fc.save+disk" or (how == "fc.save+disk/10" and i % 10 == 9):
                handles.append(fc.save(sd, step=step, checkpoint_id=os.path.join(
                    DISK, f"disk{mb}", f"step-{step}")))
            elif how == "dcp.save":
                dcp.save(sd, storage_writer=dcp.FileSystemWriter(
                    os.path.join(DISK, f"dcp{mb}", f"step-{step}")))
            else:
                continue
            stalls.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        t = time.perf_counter()
        statuses = [h.wait(600) for h in handles]
        got[how] = {"step_s": wall / steps, "stalls": stalls, "drain_s": time.perf_counter() - t,
                    "written": statuses.count("written"), "skipped": statuses.count("skipped")}
        for d in (f"disk{mb}", f"dcp{mb}"):
            shutil.rmtree(os.path.join(DISK, d), ignore_errors=True)
    return got, step


def disk() -> None:
    dist.init_process_group("gloo")
    results: dict = {}
    step = 0
    for mb in SIZES:
        results[str(mb)], step = disk_one(mb, step)
    with open(os.path.join(OUT, "disk.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def stall() -> None:
    dist.init_process_group("gloo")  # dcp.async_save needs a group; the others use it too
    results: dict = {}
    step = 0
    for mb in SIZES:
        results[str(mb)], step = stall_one(mb, step)
    if dist.get_rank() == 0:
        with open(os.path.join(OUT, "stall.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def restore() -> None:
    """First life: every rank saves steps 1 and 2, then local rank 0 SIGKILLs itself (fastrun
    restarts every rank). Second life: the process group, then every rank loads from a barrier
    (the load's stall counted as the stall's rounds: from the last rank's start to the last
    rank's end; each rank's phases), then three copies of the same bytes into pre-faulted
    memory, each from a barrier; rank 0 writes every rank's figures."""
    mb = SIZES[0]
    sd = make_state(mb)
    rank = int(os.environ.get("RANK", "0"))
    if RESTART == 0:
        fc.save(sd, step=1)
        fc.save(sd, step=2)  # returns once every local rank's step 2 is in memory
        if rank == 0:
            with open(os.path.join(OUT, "crash.json"), "w") as f:
                json.dump({"t": time.time()}, f)
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # the agent stops this rank once rank 0 died
        raise SystemExit("rank 0's crash did not stop this rank")
    target = {"model": {k: torch.zeros_like(v) for k, v in sd["model"].items()}, "extra": {}}
    dist.init_process_group("gloo")
    dist.barrier()
    t = time.monotonic()
    step = fc.load(target)
    t1 = time.monotonic()
    load_s = t1 - t
    wall = time.time()
    load_stall = _stall(t, t1)
    assert step == 2, step
    assert all(torch.equal(a, b) for a, b in zip(tensors(sd), tensors(target), strict=True))
    dst = [torch.zeros_like(v) for v in tensors(sd)]
    copies = []
    for _ in range(3):
        dist.barrier()
        t0 = time.monotonic()
        prefaulted_copy_s(tensors(sd), dst)
        copies.append(_stall(t0, time.monotonic()))
    with open(os.path.join(OUT, "crash.json")) as f:
        crashed = json.load(f)["t"]
    mine = {"load_s": load_s, "crash_to_restored_s": wall - crashed, **_worker.last_restore}
    every = _gather(mine)
    if rank == 0:
        with open(os.path.join(OUT, "restore.json"), "w") as f:
            json.dump({"ranks": every, "memcpy_s": sorted(copies)[1], "load_stall_s": load_stall},
                      f)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.manual_seed(0)
    {"stall": stall, "disk": disk}.get(MODE, restore)()
