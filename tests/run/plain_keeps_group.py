"""A script that keeps its gloo group to its end, for plain starts (issue 35 item 3: started
directly, its end can abort in the interpreter's teardown; benchmarks/results/plain_end35.md)."""

import os

import torch
import torch.distributed as dist

dist.init_process_group(backend="gloo")
t = torch.tensor(int(os.environ["RANK"]))
dist.all_reduce(t, op=dist.ReduceOp.SUM)
os.write(1, f"sum {int(t.item())}\n".encode())  # one write: the lines of 4 workers stay whole
# the group is left for the interpreter's teardown
