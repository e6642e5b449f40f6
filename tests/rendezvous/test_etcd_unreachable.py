"""An unreachable etcd: requests retry within the rendezvous timeouts, saying what they wait for.

The endpoint is a loopback port bound without listening: every connect is refused at once.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fastelastic.errors import RendezvousConnectionError, StoreConnectionError
from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler

etcd3gw = pytest.importorskip("etcd3gw", reason="!!! etcd3gw not installed: etcd tests cannot run")


@contextmanager
def closed_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        yield s.getsockname()[1]


def _waiting_notes(caplog, port):
    return [r.getMessage() for r in caplog.records
            if "waiting for etcd" in r.getMessage() and f"127.0.0.1:{port}" in r.getMessage()]


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
@pytest.mark.parametrize("conf", [{"join_timeout": "2"}, {"read_timeout": "2"}],
                         ids=["join_timeout", "read_timeout"])
def test_unreachable_etcd_fails_within_the_rendezvous_timeouts(backend, conf, caplog):
    with closed_port() as port:
        params = RendezvousParameters(backend, f"127.0.0.1:{port}", "job", 1, 1, **conf)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fastelastic.rendezvous.etcd_kv"):
            with pytest.raises(RendezvousConnectionError, match=f"127.0.0.1:{port}"):
                get_rendezvous_handler(params)
        elapsed = time.monotonic() - t0
    assert 1.5 <= elapsed < 6, elapsed  # retried for the 2 s allowed, not 30 s
    notes = _waiting_notes(caplog, port)
    assert notes, [r.getMessage() for r in caplog.records]
    assert "/kv/range" in notes[0] and "retrying for up to" in notes[0]


@pytest.mark.slow
def test_retrying_request_says_so_every_few_seconds_and_stops_at_its_bound(caplog):
    from fastelastic.rendezvous.etcd_impl.etcd_kv import EtcdKV

    with closed_port() as port:
        kv = EtcdKV([etcd3gw.client(host="127.0.0.1", port=port, timeout=5)], "/t/",
                    retry_s=6.0)
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="fastelastic.rendezvous.etcd_kv"):
            with pytest.raises(StoreConnectionError, match="answered in"):
                kv.set("k", "v")
        elapsed = time.monotonic() - t0
        assert 5.5 <= elapsed < 9, elapsed
        assert len(_waiting_notes(caplog, port)) == 2  # at 0 s and 5 s
        assert EtcdKV([etcd3gw.client(host="127.0.0.1", port=port)], "/t/",
                      retry_s=3600).retry_s == 30.0  # never more than 30 s
