"""``rendezvous.etcd_server.EtcdServer`` starts a real etcd whose v3 endpoint the etcd
rendezvous uses, and cleans up after itself."""

from __future__ import annotations

import os

import pytest
from etcd_cluster import ETCD

from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous.etcd_server import EtcdServer
from fastelastic.rendezvous.registry import get_rendezvous_handler

if ETCD is None:
    pytest.skip("!!! etcd server binary not found (install etcd-server): EtcdServer cannot run",
                allow_module_level=True)
pytest.importorskip("etcd3gw", reason="!!! etcd3gw not installed: EtcdServer tests cannot run")


@pytest.mark.timeout(120)
def test_etcd_server_serves_a_rendezvous_and_cleans_up(tmp_path, nodes):
    server = EtcdServer(str(tmp_path / "etcd-data"))
    server.start(timeout=60)
    try:
        host, port = server.get_host(), server.get_port()
        assert server.get_endpoint() == f"{host}:{port}" and port > 0
        client = server.get_client()  # etcd3gw: the v3 API
        client.put("probe", "1")
        assert client.get("probe") == [b"1"]
        params = [
            RendezvousParameters("etcd", server.get_endpoint(), "es", 2, 2, local_addr="127.0.0.1",
                                 last_call_timeout=0, join_timeout=30)
            for _ in range(2)
        ]
        handlers = [get_rendezvous_handler(p) for p in params]
        for i, h in enumerate(handlers):
            nodes.start(i, lambda i, h=h: h.next_rendezvous())
        nodes.join(60)
        assert not nodes.errors, nodes.errors
        assert sorted(nodes.results[i].rank for i in range(2)) == [0, 1]
        for h in handlers:
            assert h.shutdown()
        proc = server._get_etcd_server_process()
    finally:
        server.stop()
    assert proc.poll() is not None
    assert not os.path.exists(tmp_path / "etcd-data")


def test_etcd_server_reports_a_bad_binary(tmp_path, monkeypatch):
    bad = tmp_path / "etcd"
    bad.write_text("#!/bin/sh\nexit 3\n")
    bad.chmod(0o755)
    monkeypatch.setenv("TORCHELASTIC_ETCD_BINARY_PATH", str(bad))
    server = EtcdServer(str(tmp_path / "d"))
    with pytest.raises(RuntimeError, match="exited with the code: 3"):
        server.start(timeout=10, num_retries=2)
    assert not os.path.exists(tmp_path / "d")
    with pytest.raises(RuntimeError):
        EtcdServer()._get_etcd_server_process()
