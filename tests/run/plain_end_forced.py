"""A plain 2-rank script whose end aborts in the interpreter's teardown (issue 35 item 3).

Rank 0 starts an ``all_reduce`` with ``async_op=True`` and drops its handle at once: gloo's
worker thread then holds the last reference to the work and, through it, to the tensor's
Python object. Rank 1 joins that collective only when rank 0's ``atexit`` handler says so,
the moment before rank 0's interpreter starts to finalise; so rank 0's gloo thread finishes
the work, and asks for the GIL to drop that object, while the interpreter finalises. Python
ends such a thread with ``pthread_exit``, whose forced unwind through the work's destructor
(``noexcept``) is ``std::terminate``: started directly (``python script.py``), rank 0 dies of
SIGABRT. Ended without the teardown, both ranks exit 0.
"""

import atexit
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

dist.init_process_group(backend="gloo", timeout=timedelta(seconds=120))
rank = dist.get_rank()
store = _get_default_store()
t = torch.ones(1)
if rank == 0:
    w = dist.all_reduce(t, async_op=True)
    del w  # the gloo thread now holds the work's last reference
    atexit.register(store.set, "plain_end_forced/ending", "1")
else:
    store.wait(["plain_end_forced/ending"], timedelta(seconds=120))
    dist.all_reduce(t)
print("end of script", rank, flush=True)
