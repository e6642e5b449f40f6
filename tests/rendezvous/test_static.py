"""The ``static`` rendezvous: rank 0 hosts the store, the rest connect, nothing changes."""

from __future__ import annotations

import socket

import pytest

from fastelastic.errors import StoreError
from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_static_two_nodes_share_the_store(nodes):
    port = _free_port()
    handlers = [get_rendezvous_handler(RendezvousParameters(
        "static", f"127.0.0.1:{port}", "st", 2, 2, rank=r, timeout=20)) for r in (0, 1)]
    for i, h in enumerate(handlers):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(30)
    assert not nodes.errors, nodes.errors
    infos = [nodes.results[i] for i in (0, 1)]
    assert [(x.rank, x.world_size) for x in infos] == [(0, 2), (1, 2)]
    assert infos[0].bootstrap_store_info.master_port == port
    infos[0].store.set("k", b"v")
    assert infos[1].store.get("k") == b"v"
    h = handlers[0]
    assert h.get_backend() == "static" and h.use_agent_store
    assert (h.is_closed(), h.num_nodes_waiting(), h.get_run_id(), h.shutdown()) == (
        False, 0, "st", True)
    # shutdown closed rank 0's own connection; its server still serves rank 1
    with pytest.raises(StoreError):
        infos[0].store.get("k")
    infos[1].store.set("k2", b"v2")
    assert infos[1].store.get("k2") == b"v2"
    assert handlers[1].shutdown()
    with pytest.raises(StoreError):
        infos[1].store.get("k2")


@pytest.mark.parametrize(
    ("endpoint", "conf", "match"),
    [("127.0.0.1:1", {}, "rank is absent"),
     ("", {"rank": 0}, "endpoint is absent"),
     ("127.0.0.1", {"rank": 0}, "Port is absent"),
     ("127.0.0.1:1", {"rank": 5}, "out of range")],
)
def test_static_rejects_bad_parameters(endpoint, conf, match):
    with pytest.raises(ValueError, match=match):
        get_rendezvous_handler(RendezvousParameters("static", endpoint, "st", 2, 2, **conf))
