"""Finding the live candidate at a node's start (``_failover.Candidates.connect``) on loopback:
the first candidate is waited for up to the read timeout; after it, the probe that comes
first takes the best other one."""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import pytest

from fastelastic.errors import RendezvousConnectionError
from fastelastic.rendezvous import _failover
from fastelastic.rendezvous._failover import Candidates
from fastelastic.store import TCPStore

RUN = "job"


@pytest.fixture(autouse=True)
def _quick_probes(monkeypatch):
    """A refused candidate fails its probe at once (a client retries its connect up to its
    timeout, PROBE_S), so the 0.2 s passes between probes are what the tests see."""
    monkeypatch.setattr(_failover, "PROBE_S", 0.05)


def _standby() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                    timeout=timedelta(seconds=30))


def _refused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: a connection is refused
    return port


def test_the_first_candidate_is_taken_at_once():
    first, second = _standby(), _standby()
    try:
        c = Candidates(RUN, [("127.0.0.1", first.port), ("127.0.0.1", second.port)], False,
                       timedelta(seconds=5))
        t0 = time.monotonic()
        client, index, epoch, proposed = c.connect()
        client.close()
        assert (index, epoch, proposed) == (0, 0, 0)
        assert time.monotonic() - t0 < 2.5
    finally:
        first.shutdown_server()
        second.shutdown_server()


def test_an_empty_standby_is_taken_only_after_the_read_timeout_and_proposes_epoch_1():
    second = _standby()
    try:
        c = Candidates(RUN, [("127.0.0.1", _refused_port()), ("127.0.0.1", second.port)],
                       False, timedelta(seconds=1.0))
        t0 = time.monotonic()
        client, index, epoch, proposed = c.connect()
        took = time.monotonic() - t0
        client.close()
        assert (index, epoch, proposed) == (1, 0, 1)
        # patient until the read timeout (probes 0.2 s apart), then the first probe after it
        assert 1.0 <= took < 3.0, took
        assert second.get(f"fe.rdzv.{RUN}/moving").startswith(b"1|")  # the move's mark
    finally:
        second.shutdown_server()


def test_no_candidate_is_an_error_after_the_read_timeout():
    c = Candidates(RUN, [("127.0.0.1", _refused_port()), ("127.0.0.1", _refused_port())],
                   False, timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="No rendezvous store candidate"):
        c.connect()
    assert 0.5 <= time.monotonic() - t0 < 3.0
