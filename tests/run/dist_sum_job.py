"""One ``elastic_launch`` of torch's launcher-test function: a static rendezvous, N workers (spawn)
that each call gloo ``init_process_group``, do one ``all_reduce`` and return without destroying
their process group. Prints the sorted return values as JSON; a failure raises (exit 1).

``python dist_sum_job.py NPROC PORT``
"""

from __future__ import annotations

import json
import os
import sys


def dist_sum() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    t = torch.tensor(int(os.environ["RANK"]))
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())  # the group is left for the process's end to deal with


def main() -> None:
    from fastelastic.launcher.api import LaunchConfig, elastic_launch

    nproc, port = int(sys.argv[1]), int(sys.argv[2])
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id="", rdzv_backend="static",
        rdzv_endpoint=f"127.0.0.1:{port}", rdzv_configs={"rank": 0}, monitor_interval=0.1,
        start_method="spawn", max_restarts=0,
    )
    from dist_sum_job import dist_sum as fn  # importable by the spawned workers

    print(json.dumps(sorted(elastic_launch(config, fn)().values())), flush=True)


if __name__ == "__main__":
    main()
