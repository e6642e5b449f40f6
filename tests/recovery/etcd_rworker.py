"""A worker for the etcd recovery tests: ``rworker.py`` plus where its store is.

Appends one JSON line to ``$RECOVERY_OUT/starts.jsonl`` when it starts: ``node``, ``pid``,
``t``, ``world``, ``rank``, ``restart``, ``group_rank``, ``master`` (``MASTER_ADDR:MASTER_PORT``)
and ``store_ok`` (it could write to and read from that store within 10 s), then runs
``$NODE_RUN_S`` seconds (default 600) and exits 0.
"""

import os
from datetime import timedelta

from rworker import log_start, train  # this file's directory is the script's sys.path[0]

rank = int(os.environ["RANK"])
master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
try:
    from fastelastic.store import TCPStore

    store = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                     timeout=timedelta(seconds=10))
    store.set(f"etcd_rworker/{rank}", b"1")
    ok = store.get(f"etcd_rworker/{rank}") == b"1"
    store.close()
except Exception as e:  # noqa: BLE001 - recorded, the test says what failed
    ok = False
    print(f"etcd_rworker: store {master}: {type(e).__name__}: {e}", flush=True)
log_start(group_rank=int(os.environ["GROUP_RANK"]), master=master, store_ok=ok)
train()
