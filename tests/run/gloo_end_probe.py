"""What README's example relies on in torch 2.13's gloo, probed in one process (world size 1).

``python gloo_end_probe.py PORT held|dynamo-late``; prints one JSON line.

* ``held``: a collective on a tensor made in Python, its handle kept. The tensor's Python
  object has one reference more than Python's own while the work holds it (torch keeps a
  C++-held tensor's PyObject alive). ``destroy_process_group`` frees the group here and joins
  gloo's threads; the extra reference is still there afterwards (no gloo thread dropped the
  tensor), and goes when the handle goes, on this thread.
* ``dynamo-late``: ``torch._dynamo`` imported after ``init_process_group`` (as DDP and every
  ``torch.optim`` optimizer do in a plain start): the group outlives ``destroy_process_group``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _runloops() -> int:
    """gloo's worker threads (``ProcessGroupGloo::runLoop``, named by torch)."""
    n = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                n += f.read().strip() == "pt_gloo_runloop"
        except OSError:
            continue
    return n


def main() -> None:
    port, mode = sys.argv[1], sys.argv[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK="0", WORLD_SIZE="1")
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    out: dict[str, object] = {}
    if mode == "dynamo-late":
        import torch._dynamo  # noqa: F401
    t = torch.ones(1)
    base = sys.getrefcount(t)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    out["extra_refs_held"] = sys.getrefcount(t) - base
    dist.barrier()
    # each thread names itself once it runs, which on a busy machine may come after the
    # collectives above (one thread can run them all): give the default two up to 10 s
    for _ in range(1000):
        if _runloops() >= 2:
            break
        time.sleep(0.01)
    out["runloops"] = _runloops()
    dist.destroy_process_group()
    out["runloops_after_destroy"] = _runloops()
    out["extra_refs_after_destroy"] = sys.getrefcount(t) - base
    del work
    out["extra_refs_after_handle"] = sys.getrefcount(t) - base
    print(json.dumps(out), flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
