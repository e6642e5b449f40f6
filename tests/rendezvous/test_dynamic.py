"""torch-shaped DynamicRendezvousHandler with C10dRendezvousBackend on fastelastic's store."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous.c10d_rendezvous_backend import (
    C10dRendezvousBackend,
    create_backend,
)
from fastelastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
    create_handler,
)
from fastelastic.store import TCPStore


def _handler(port, min_nodes, max_nodes, last_call=30.0, join=20.0, run_id="dyn"):
    store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    timeout = RendezvousTimeout(join=timedelta(seconds=join),
                                last_call=timedelta(seconds=last_call))
    backend = C10dRendezvousBackend(store, run_id)
    return DynamicRendezvousHandler.from_backend(run_id, store, backend,
                                                 min_nodes, max_nodes, "127.0.0.1", timeout)


def test_timeout_validation_and_defaults():
    t = RendezvousTimeout()
    assert (t.join, t.last_call, t.close, t.heartbeat) == (
        timedelta(seconds=600), timedelta(seconds=30), timedelta(seconds=30), timedelta(seconds=5))
    with pytest.raises(ValueError, match="join timeout"):
        RendezvousTimeout(join=timedelta(0))
    params = RendezvousParameters("c10d", "127.0.0.1:1", "r", 1, 1, keep_alive_interval=None)
    with pytest.raises(TypeError, match="keep_alive_interval=None"):
        create_handler(None, None, params)  # type: ignore[arg-type]


def test_backend_fencing(server):
    a = C10dRendezvousBackend(server, "fence")
    assert a.get_state() is None
    state, token, won = a.set_state(b"one")
    assert (state, won) == (b"one", True)
    _, _, won = a.set_state(b"two", token=None)  # no token: only if absent
    assert not won
    state2, token2, won = a.set_state(b"three", token)
    assert (state2, won) == (b"three", True)
    state3, _, won = a.set_state(b"stale", token)  # stale token loses, gets current state
    assert (state3, won) == (b"three", False)
    assert a.get_state() == (b"three", token2)
    server.set("torch.rendezvous.bad", b"***not base64***")
    with pytest.raises(RendezvousStateError):
        C10dRendezvousBackend(server, "bad").get_state()


def test_max_nodes_and_ranks(server, nodes):
    hs = [_handler(server.port, 2, 3, last_call=60) for _ in range(3)]
    for i, h in enumerate(hs):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors, nodes.errors
    assert sorted(nodes.results[i].rank for i in range(3)) == [0, 1, 2]
    assert {nodes.results[i].world_size for i in range(3)} == {3}
    assert nodes.results[0].bootstrap_store_info.master_port == server.port
    for h in hs:
        h._stop_heartbeats()


def test_last_call_late_joiner_and_rejoin(server, nodes):
    a, b = (_handler(server.port, 2, 3, last_call=1) for _ in range(2))
    t0 = time.monotonic()
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors, nodes.errors
    assert time.monotonic() - t0 >= 0.9
    assert nodes.results[0].world_size == 2
    late = _handler(server.port, 2, 3, last_call=1)
    version = int(server.add("torch.rendezvous.dyn/v", 0))
    nodes.start(2, lambda i: late.next_rendezvous())
    # The late node's one state write (joining the wait list) bumps the version.
    server.wait([f"torch.rendezvous.dyn/v/{version + 1}"], timedelta(seconds=10))
    assert a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1
    nodes.start(3, lambda i: a.next_rendezvous())
    nodes.start(4, lambda i: b.next_rendezvous())
    nodes.join(30)
    assert not nodes.errors, nodes.errors
    assert {nodes.results[i].world_size for i in (2, 3, 4)} == {3}
    for h in (a, b, late):
        h._stop_heartbeats()


def test_join_timeout_and_close(server, nodes):
    lonely = _handler(server.port, 2, 2, join=1)
    with pytest.raises(RendezvousTimeoutError):
        lonely.next_rendezvous()
    waiter = _handler(server.port, 2, 2, run_id="closing")
    nodes.start(0, lambda i: waiter.next_rendezvous())
    closer = _handler(server.port, 2, 2, run_id="closing")
    assert not closer.is_closed()
    assert closer.shutdown() is True
    nodes.join(10)
    assert isinstance(nodes.errors[0], RendezvousClosedError)
    assert waiter.is_closed()


def test_create_backend_from_params(server):
    params = RendezvousParameters("c10d-v2", f"127.0.0.1:{server.port}", "p", 1, 1,
                                  is_host=False, read_timeout=5)
    backend, store = create_backend(params)
    assert backend.name == "c10d" and store.port == server.port
    with pytest.raises(ValueError, match="only supports file and tcp"):
        create_backend(RendezvousParameters("c10d", "x:1", "p", 1, 1, store_type="hash"))
    with pytest.raises(ValueError, match="positive"):
        create_backend(RendezvousParameters("c10d", "x:1", "p", 1, 1, read_timeout=0))
