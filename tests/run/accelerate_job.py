"""Tiny Hugging Face Accelerate job: every rank adds its rank + 1 with ``reduce``.

Writes the sum, Accelerate's view of the job and the environment to ``$DUMP_DIR/<RANK>.json``
(the dump_env.py format). With ``FAIL_ON_FIRST_ATTEMPT=<rank>`` that rank exits with status 3
before joining the process group on the first attempt, so the launcher restarts the group.
"""

import json
import os
import sys

if os.environ.get("FAIL_ON_FIRST_ATTEMPT") == os.environ["RANK"] and \
        os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    sys.exit(3)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

acc = Accelerator(cpu=True)
total = acc.reduce(torch.tensor([float(acc.process_index + 1)]), reduction="sum")
out = {
    "env": dict(os.environ), "sum": total.item(), "process_index": acc.process_index,
    "local_process_index": acc.local_process_index, "num_processes": acc.num_processes,
    "distributed_type": str(acc.distributed_type),
}
acc.wait_for_everyone()
acc.end_training()  # destroys the process group (gloo at exit without it: std::terminate at times)
with open(os.path.join(os.environ["DUMP_DIR"], f"{acc.process_index}.json"), "w") as f:
    json.dump(out, f)
