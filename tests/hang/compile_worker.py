"""Trains 100 steps under ``torch.compile(backend="eager")``, with or without the progress
marks installed (argv[1] "1"/"0"), compiling the model (argv[2] "model") or the whole training
step with the optimizer in it ("step"); prints torch._dynamo's counters as JSON."""

import json
import sys

import torch

MARKS = sys.argv[1] == "1"
MODE = sys.argv[2]
if MARKS:  # as a hang-checked worker has them (a real mapped slot)
    from fastelastic.progress import _worker as w
    from fastelastic.progress._launch import ProgressSlots

    slots = ProgressSlots()
    w.install(slots.prepare([0])[0])
from torch._dynamo.utils import counters  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(32, 64)
fwd = torch.compile(model, backend="eager") if MODE == "model" else model


def train_step():
    fwd(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


step = train_step if MODE == "model" else torch.compile(train_step, backend="eager")
for i in range(100):
    if i % 25 == 24:  # an evaluation now and then: model.eval() ... model.train()
        model.eval()
        with torch.no_grad():
            fwd(x)
        model.train()
    step()
keys = ("stats", "frames", "graph_break", "recompiles", "unimplemented")
print(json.dumps({
    "counters": {k: dict(counters[k]) for k in keys if k in counters},
    "steps": int(w._slot[w.F_STEPS]) if MARKS else None,
}))
