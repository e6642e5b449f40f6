"""Both ways with torch: torch's client on our server, our client on torch's servers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest

from fastelastic.errors import QueueEmptyError, StoreTimeoutError
from fastelastic.store import TCPStore

pytestmark = pytest.mark.torch


def test_torch_client_on_our_server(master, torch_dist):
    dist = torch_dist
    c = dist.TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))
    c.set("a", "1")
    assert master.get("a") == b"1" and c.get("a") == b"1"
    master.set("from_us", b"\x00\x01")
    assert c.get("from_us") == b"\x00\x01"
    assert c.add("n", 3) == 3 and c.add("n", 4) == 7
    assert c.compare_set("a", "1", "2") == b"2"
    assert c.compare_set("a", "nope", "3") == b"2"
    assert c.compare_set("fresh", "", "x") == b"x"
    assert c.check(["a", "n"]) and not c.check(["zz"])
    c.append("a", "+")
    assert c.get("a") == b"2+"
    assert c.delete_key("fresh") and not c.delete_key("fresh")
    c.multi_set(["m1", "m2"], ["x", "y"])
    assert c.multi_get(["m1", "m2"]) == [b"x", b"y"]
    assert sorted(c.list_keys()) == sorted(master.list_keys())
    assert c.num_keys() == master.num_keys()
    c.queue_push("q", "item")
    assert c.queue_len("q") == 1 and c.queue_pop("q") == b"item"
    with pytest.raises(dist.QueueEmptyError):
        c.queue_pop("q", block=False)
    threading.Timer(0.05, lambda: master.set("late", "v")).start()
    assert c.get("late") == b"v"
    c.wait(["late", "a"])
    c.set_timeout(timedelta(milliseconds=200))
    with pytest.raises(dist.DistStoreError):
        c.get("never")
    assert c.get("a") == b"2+"          # still usable after the timed-out wait
    with pytest.raises(dist.DistStoreError):
        c.barrier("bar", 2)
    c.barrier("bar", 2)                  # the timed-out arrival still counted
    d = c.clone()
    assert d.get("a") == b"2+"
    assert master.server.protocol_errors == 0


def test_torch_client_counts_itself_in(master, torch_dist):
    dist = torch_dist
    c = dist.TCPStore("127.0.0.1", master.port, world_size=4, is_master=False,
                      timeout=timedelta(seconds=10))
    assert master._add_unprefixed(b"init/", 0) == 1
    assert c.num_keys() == 1


@pytest.mark.parametrize("use_libuv", [True, False], ids=["libuv", "legacy"])
def test_our_client_on_torch_server(torch_dist, use_libuv):
    dist = torch_dist
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10),
                           use_libuv=use_libuv)
    c = TCPStore("127.0.0.1", server.port, timeout=10)
    assert not c.supports_extensions
    c.set("a", "1")
    assert server.get("a") == b"1" and c.get("a") == b"1"
    server.set("t", b"\xff")
    assert c.get("t") == b"\xff"
    assert c.add("n", 2) == 2
    assert c.compare_set("a", "1", "2") == b"2"
    assert c.check(["a"]) and not c.check(["zz"])
    c.append("a", "x")
    assert server.get("a") == b"2x"
    c.multi_set(["m1", "m2"], ["1", "2"])
    assert c.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert sorted(c.list_keys()) == sorted(server.list_keys())
    assert c.num_keys() == server.num_keys()
    assert c.delete_key("m1")
    threading.Timer(0.05, lambda: server.set("late", "v")).start()
    assert c.get("late") == b"v"
    c.set_timeout(timedelta(milliseconds=200))
    with pytest.raises(StoreTimeoutError):
        c.get("never")
    assert c.get("a") == b"2x"
    if use_libuv:
        c.queue_push("q", "i")
        assert c.queue_len("q") == 1 and c.queue_pop("q") == b"i"
        with pytest.raises(QueueEmptyError):
            c.queue_pop("q", block=False)
    with pytest.raises(StoreTimeoutError):
        c.barrier("b", 2)
    server.barrier("b", 2)
    c.close()  # torch holds the store it wraps until exit: close ours, or it warns then


GLOO_WORKER = textwrap.dedent("""
    import sys
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    port, rank = int(sys.argv[1]), int(sys.argv[2])
    store = dist.TCPStore("127.0.0.1", port, world_size=4, is_master=False,
                          timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=4)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.barrier()
    print(f"rank {rank} sum {t.item()}")
    dist.destroy_process_group()
""")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gloo_process_group_on_our_store(master, torch_dist, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(GLOO_WORKER)
    procs = [subprocess.Popen([sys.executable, str(script), str(master.port), str(r)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(4)]
    outs = [p.communicate(timeout=150) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs, strict=True)):
        assert p.returncode == 0, f"rank {r} failed:\n{err}"
        assert f"rank {r} sum 10.0" in out
    assert master.server.protocol_errors == 0
