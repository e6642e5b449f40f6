"""One rank of a 2-process gloo job whose store comes from fastelastic's public API.

argv: <source: tcpstore | rendezvous | c10d_backend | dynamic> <rank> <port> <run id>
Prints one JSON line: {"rank", "world_size", "sum", "store_type"}.
"""

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from fastelastic.rendezvous import RendezvousParameters
from fastelastic.store import PrefixStore, TCPStore


def _store(source: str, rank: int, port: int, run_id: str):
    endpoint = f"127.0.0.1:{port}"
    if source == "tcpstore":
        store = TCPStore("127.0.0.1", port, is_master=rank == 0, timeout=timedelta(seconds=60))
        return PrefixStore("pg", store), rank, 2
    params = RendezvousParameters(
        "c10d", endpoint, run_id, 2, 2, is_host=rank == 0, join_timeout=60
    )
    if source == "rendezvous":  # the fast c10d handler
        from fastelastic.rendezvous.registry import get_rendezvous_handler

        handler = get_rendezvous_handler(params)
    else:
        from fastelastic.rendezvous.c10d_rendezvous_backend import create_backend

        backend, store = create_backend(params)
        if source == "c10d_backend":
            # a temporary: torch's PrefixStore must keep working once our object is unreferenced
            return dist.PrefixStore("pg", store), rank, 2
        from fastelastic.rendezvous.dynamic_rendezvous import create_handler

        handler = create_handler(store, backend, params)  # torch's dynamic rendezvous
    info = handler.next_rendezvous()
    return info.store, info.rank, info.world_size


def main() -> None:
    source, rank, port, run_id = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    store, rank, world = _store(source, rank, port, run_id)
    store_type = type(store).__module__ + "." + type(store).__qualname__
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "world_size": world, "sum": t.item(),
                      "store_type": store_type}), flush=True)


if __name__ == "__main__":
    main()
