"""etcd v3 rendezvous against real etcd servers: fast handler, TLS, torch-shaped backend,
and a 3-member cluster whose leader stops or is SIGKILLed in the middle of an 8-node
rendezvous."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from etcd_cluster import ETCD, Cluster, make_tls

from fastelastic.errors import RendezvousClosedError
from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler

if ETCD is None:
    pytest.skip("!!! etcd server binary not found (install etcd-server): etcd tests cannot run",
                allow_module_level=True)
etcd3gw = pytest.importorskip("etcd3gw", reason="!!! etcd3gw not installed: etcd tests cannot run")


@pytest.fixture
def etcd(tmp_path):
    cluster = Cluster(tmp_path, 1).start()
    yield cluster
    cluster.stop()


def _params(endpoint, n_min, n_max, run_id="job", **conf):
    conf.setdefault("last_call_timeout", 0)
    conf.setdefault("join_timeout", 30)
    return RendezvousParameters("etcd", endpoint, run_id, n_min, n_max, local_addr="127.0.0.1",
                                **conf)


def _form(nodes, params_list):
    handlers = [get_rendezvous_handler(p) for p in params_list]
    for i, h in enumerate(handlers):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    return handlers


def test_etcd_rendezvous_forms_and_hands_out_tcpstore(etcd, nodes):
    from fastelastic.store import PrefixStore

    handlers = _form(nodes, [_params(etcd.endpoints, 3, 3) for _ in range(3)])
    nodes.join(30)
    assert not nodes.errors, nodes.errors
    infos = [nodes.results[i] for i in range(3)]
    assert sorted(x.rank for x in infos) == [0, 1, 2]
    assert {x.world_size for x in infos} == {3}
    assert all(isinstance(x.store, PrefixStore) for x in infos)
    assert len({(x.bootstrap_store_info.master_addr, x.bootstrap_store_info.master_port)
                for x in infos}) == 1
    infos[0].store.set("hello", b"world")
    assert infos[1].store.get("hello") == b"world"
    assert handlers[0].get_backend() == "etcd" and handlers[0].num_nodes_waiting() == 0
    assert handlers[0].store._lease_id is not None  # liveness lease taken while joining
    handlers[0].set_closed()
    assert handlers[2].is_closed()
    with pytest.raises(RendezvousClosedError):
        handlers[1].next_rendezvous()
    for h in handlers:
        h.shutdown()


@pytest.mark.timeout(90)
def test_etcd_dead_node_noticed_by_lease(etcd, nodes):
    """A node whose lease expires mid-join abandons the round; the others re-form."""
    a = get_rendezvous_handler(_params(etcd.endpoints, 2, 3, last_call_timeout=60, lease_ttl=2))
    b = get_rendezvous_handler(_params(etcd.endpoints, 2, 3, last_call_timeout=60, lease_ttl=2))
    nodes.start(0, lambda i: a.next_rendezvous())
    a.store.wait(["fe.rdzv.job/0/n/1"], timedelta(seconds=10))
    # b "dies": its keep-alive stops, as when its process is killed.
    b.store._lease_stop.set()
    nodes.start(1, lambda i: b.next_rendezvous())
    t0 = time.monotonic()
    a.store.wait(["fe.rdzv.job/1/n/1"], timedelta(seconds=15))
    assert time.monotonic() - t0 < 10  # TTL 2 s plus etcd's expiry scan
    assert a.store.get("fe.rdzv.job/0/res").startswith(b"D")
    closer = get_rendezvous_handler(_params(etcd.endpoints, 2, 3))
    closer.set_closed()
    nodes.join(30)
    for h in (a, b, closer):  # b's lease watch would outlive the test (and the etcd server)
        h.shutdown()


def test_etcd_https_with_client_certificates(tmp_path, nodes):
    pytest.importorskip("cryptography",
                        reason="!!! python 'cryptography' missing: cannot make the test CA")
    ca, s_cert, s_key, c_cert, c_key = make_tls(tmp_path)
    cluster = Cluster(tmp_path, 1, tls=(ca, s_cert, s_key)).start()
    try:
        conf = {"protocol": "https", "ca_cert": ca, "ssl_cert": c_cert, "ssl_cert_key": c_key}
        handlers = _form(nodes, [_params(cluster.endpoints, 2, 2, **conf) for _ in range(2)])
        nodes.join(30)
        assert not nodes.errors, nodes.errors
        assert sorted(nodes.results[i].rank for i in range(2)) == [0, 1]
        for h in handlers:
            assert h.shutdown()
        # Without the CA the server certificate is rejected: a clear connection error.
        from fastelastic.errors import RendezvousConnectionError, StoreError

        with pytest.raises((RendezvousConnectionError, StoreError)):
            get_rendezvous_handler(_params(cluster.endpoints, 2, 2, protocol="https",
                                           read_timeout=5))
    finally:
        cluster.stop()


def test_etcd_v2_dynamic_backend(etcd, nodes):
    from fastelastic.rendezvous.etcd_rendezvous_backend import EtcdRendezvousBackend

    params = [RendezvousParameters("etcd-v2", etcd.endpoints, "dyn", 3, 3, local_addr="127.0.0.1",
                                   last_call_timeout=1, join_timeout=30) for _ in range(3)]
    handlers = [get_rendezvous_handler(p) for p in params]
    assert isinstance(handlers[0]._holder._backend, EtcdRendezvousBackend)
    for i, h in enumerate(handlers):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(30)
    assert not nodes.errors, nodes.errors
    assert sorted(nodes.results[i].rank for i in range(3)) == [0, 1, 2]
    handlers[0].shutdown()
    assert handlers[1].is_closed()
    for h in handlers:
        h._stop_heartbeats()


@pytest.mark.timeout(180)
@pytest.mark.slow
@pytest.mark.parametrize("how", ["stop", "kill"])
def test_leader_lost_during_8_node_rendezvous(tmp_path, nodes, how):
    """The leader stops (SIGTERM: it hands leadership over) or is SIGKILLed (an election)
    after 4 of 8 nodes joined: the round completes with all 8."""
    cluster = Cluster(tmp_path, 3).start()
    try:
        eps = [m.endpoint for m in cluster.members]
        # Each node lists all members, starting from a different one.
        params = [_params(",".join(eps[i % 3:] + eps[:i % 3]), 8, 8, lease_ttl=5)
                  for i in range(8)]
        handlers = _form(nodes, params[:4])
        handlers[0].store.wait([f"fe.rdzv.job/0/n/{t}" for t in range(1, 5)],
                               timedelta(seconds=30))
        leader = cluster.leader()
        leader.stop() if how == "stop" else leader.kill()
        handlers += _form_more(nodes, params[4:], start=4)
        nodes.join(120)
        assert not nodes.errors, nodes.errors
        infos = [nodes.results[i] for i in range(8)]
        assert sorted(x.rank for x in infos) == list(range(8))
        assert {x.world_size for x in infos} == {8}
        for h in handlers:
            h.shutdown()
    finally:
        cluster.stop()


def _form_more(nodes, params_list, start):
    handlers = [get_rendezvous_handler(p) for p in params_list]
    for i, h in enumerate(handlers):
        nodes.start(start + i, lambda i, h=h: h.next_rendezvous())
    return handlers
