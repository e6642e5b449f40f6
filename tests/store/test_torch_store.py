"""The stores fastelastic hands out are ``torch.distributed.Store``s once torch is imported."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import uuid
from datetime import timedelta

import pytest

from fastelastic.store import PrefixStore, Store, TCPStore, as_torch_store
from fastelastic.store._torch import unwrap

pytestmark = pytest.mark.torch
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_store_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_stores_are_torch_stores_with_our_fast_paths(torch_dist):
    dist = torch_dist
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=10)
    try:
        p = PrefixStore("a", s)
        for store in (s, p):
            assert isinstance(store, dist.Store)
            assert isinstance(store, Store)
        assert isinstance(s, TCPStore) and isinstance(p, PrefixStore)
        assert s.timeout == timedelta(seconds=10)
        # our callers call the wrapped client's own methods: no Python hop, same round trips
        plain = unwrap(s)
        assert type(plain) is not type(s) and s.get.__self__ is plain
        assert s.supports_extensions and s.port == plain.port
        assert unwrap(p).underlying_store is plain  # a prefix over an adapter keeps one level
        # torch's PrefixStore over ours (C++ -> our methods), and ours over it
        tp = dist.PrefixStore("t", p)
        tp.set("k", "v")
        assert s.get("a/t/k") == b"v" and tp.get("k") == b"v"
        assert tp.add("n", 2) == 2 and s.add("a/t/n", 3) == 5
        assert tp.compare_set("k", "v", "w") == b"w"
        assert tp.check(["k"]) and not tp.check(["missing"])
        tp.multi_set(["m1", "m2"], ["1", "2"])
        assert tp.multi_get(["m1", "m2"]) == [b"1", b"2"]
        tp.append("k", "+")
        assert p.get("t/k") == b"w+"
        tp.wait(["k"], timedelta(seconds=1))
        tp.set_timeout(timedelta(milliseconds=100))
        with pytest.raises(RuntimeError):  # our StoreTimeoutError through torch's C++
            tp.get("never")
        c = s.clone()
        assert isinstance(c, dist.Store) and c.get("a/t/k") == b"w+"
        c.close()
        assert as_torch_store(tp) is tp and as_torch_store(s) is s
    finally:
        s.shutdown_server()


def test_without_torch_the_stores_are_plain():
    code = textwrap.dedent(
        """
        import sys
        from fastelastic.rendezvous.c10d_rendezvous_backend import create_backend
        from fastelastic.rendezvous import RendezvousParameters
        from fastelastic.store import PrefixStore, TCPStore
        s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        assert type(s) is TCPStore and type(PrefixStore("p", s)) is PrefixStore
        _, b = create_backend(RendezvousParameters("c10d", "127.0.0.1:0", "r", 1, 1,
                                                   is_host=True))
        assert type(b) is TCPStore, type(b)
        assert "torch" not in sys.modules, "a store imported torch"
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.timeout(180)
@pytest.mark.parametrize("source", ["tcpstore", "rendezvous", "c10d_backend", "dynamic"])
def test_init_process_group_on_our_store_across_processes(torch_dist, source, outputs_of):
    port, run_id = _free_port(), uuid.uuid4().hex
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, source, str(rank), str(port), run_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs_of(procs, 150)]
    assert sorted(r["rank"] for r in results) == [0, 1]
    assert all(r["world_size"] == 2 and r["sum"] == 3.0 for r in results)
    if source != "c10d_backend":
        # what fastelastic handed to init_process_group was its own store, as a torch Store
        assert all(r["store_type"].startswith("fastelastic.") for r in results), results
