"""torchrun --rdzv-backend=fastelastic: 2 nodes x 2 workers on loopback with unmodified torch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip(
    "torch", reason="!!! torch is not installed: the torchrun plugin test cannot run"
)

_WORKER = textwrap.dedent("""
    import json, os, sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    out = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_RANK",
                                      "MASTER_PORT", "TORCHELASTIC_USE_AGENT_STORE")}
    out["sum"] = int(t.item())
    with open(os.path.join(sys.argv[1], "rank%s.json" % out["RANK"]), "w") as f:
        json.dump(out, f)
    dist.destroy_process_group()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_handler_generator_returns_torch_typed_handler():
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousParameters,
    )

    from fastelastic.rendezvous.torch_plugin import handler_generator

    port = _free_port()
    create = handler_generator()
    handler = create(RendezvousParameters("fastelastic", f"127.0.0.1:{port}", "p", 1, 1,
                                          last_call_timeout=0, join_timeout=20))
    assert isinstance(handler, RendezvousHandler)
    info = handler.next_rendezvous()
    from torch.distributed.elastic.rendezvous.api import RendezvousInfo

    assert isinstance(info, RendezvousInfo)
    assert isinstance(info.store, torch.distributed.PrefixStore)
    assert (info.rank, info.world_size) == (0, 1)
    boot = info.bootstrap_store_info
    assert boot.master_port != port  # workers get a fresh store of their own each round
    workers = torch.distributed.TCPStore(boot.master_addr, boot.master_port, is_master=False)
    assert workers.num_keys() == 0
    info.store.set("x", b"1")  # torch's client talks to our server
    assert info.store.get("x") == b"1"
    assert handler.num_nodes_waiting() == 0 and not handler.is_closed()
    assert handler.shutdown() and handler.is_closed()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_torchrun_two_nodes_two_workers(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(_WORKER)
    port = _free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--rdzv-backend=fastelastic",
           f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=plugin", "--nnodes=2",
           "--nproc-per-node=2", "--rdzv-conf=last_call_timeout=0,join_timeout=120",
           "--monitor-interval=0.1", str(script), str(tmp_path)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              cwd=tmp_path) for _ in range(2)]
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=200)
            outs.append(out.decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted(int(r["RANK"]) for r in results) == [0, 1, 2, 3]
    assert {r["WORLD_SIZE"] for r in results} == {"4"}
    assert sorted(r["GROUP_RANK"] for r in results) == ["0", "0", "1", "1"]
    assert {r["sum"] for r in results} == {0 + 1 + 2 + 3}
    ports = {r["MASTER_PORT"] for r in results}
    assert len(ports) == 1 and ports != {str(port)}  # one fresh worker store for the round
    assert {r["TORCHELASTIC_USE_AGENT_STORE"] for r in results} == {"True"}
