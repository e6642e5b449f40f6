"""Finding the live candidate at a node's start (``_failover.Candidates.connect``) on loopback:
the first candidate is waited for up to the read timeout; a store the rendezvous moved to is
taken at once, an empty standby never (``NO_WORLD_RULE``)."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

from fastelastic.errors import RendezvousConnectionError
from fastelastic.rendezvous.fast.failover import _failover
from fastelastic.rendezvous.fast.failover._failover import Candidates
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


def test_an_empty_standby_is_not_taken_at_a_start_but_a_moved_store_is_at_once():
    second = _standby()
    try:
        c = Candidates(RUN, [("127.0.0.1", _refused_port()), ("127.0.0.1", second.port)],
                       False, timedelta(seconds=1.0))
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="no other holds a committed epoch"):
            c.connect()  # patient until the read timeout (probes 0.2 s apart), then gives up
        assert 1.0 <= time.monotonic() - t0 < 3.0
        second.set(f"fe.rdzv.{RUN}/epoch", b"2")  # the rendezvous moved there
        t0 = time.monotonic()
        client, index, epoch, proposed = c.connect()
        client.close()
        assert (index, epoch, proposed) == (1, 2, 0)
        assert time.monotonic() - t0 < 1.0
    finally:
        second.shutdown_server()


def test_no_candidate_is_an_error_after_the_read_timeout():
    c = Candidates(RUN, [("127.0.0.1", _refused_port()), ("127.0.0.1", _refused_port())],
                   False, timedelta(seconds=0.5))
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="No rendezvous store candidate"):
        c.connect()
    assert 0.5 <= time.monotonic() - t0 < 3.0


def test_a_restarted_first_candidate_is_not_taken_for_a_jobs_start():
    """Issue 27's known hole, on real stores: the rendezvous moved to the second candidate
    (epoch 1 committed there), then the first candidate's host restarted, and its new agent
    hosts an empty standby there again. A fresh node that cannot reach the second (a refused
    port stands for its cut link) took the empty first for a job's start and would form a
    world of its own beside the live one (checked: it failed so before). Now the restarted
    agent probes the other candidates before it hosts its standby and, finding epoch 1,
    marks the standby ``behind`` as soon as it serves (before its own connect): the fresh
    node passes it over and, after the read timeout, says why. A node that reaches the live
    store takes it, and once a move commits a newer epoch on the first, it is live again."""
    live = _standby()
    live.set(f"fe.rdzv.{RUN}/epoch", b"1")
    first = _refused_port()  # free: the restarted agent hosts its standby there
    restarted = Candidates(RUN, [("127.0.0.1", first), ("127.0.0.1", live.port)], True,
                           timedelta(seconds=5))
    try:
        assert restarted.standby_index == 0
        assert restarted.standby.get(f"fe.rdzv.{RUN}/behind") == b"1"  # before its connect
        client, index, epoch, proposed = restarted.connect()
        client.close()
        assert (index, epoch, proposed) == (1, 1, 0)
        fresh = Candidates(RUN, [("127.0.0.1", first), ("127.0.0.1", _refused_port())], False,
                           timedelta(seconds=1.0))
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError,
                           match="restarted after the rendezvous moved to epoch 1"):
            fresh.connect()
        assert 1.0 <= time.monotonic() - t0 < 3.0
        reaches = Candidates(RUN, [("127.0.0.1", first), ("127.0.0.1", live.port)], False,
                             timedelta(seconds=5))
        client, index, epoch, proposed = reaches.connect()
        client.close()
        assert (index, epoch, proposed) == (1, 1, 0)
        restarted.standby.set(f"fe.rdzv.{RUN}/epoch", b"3")  # a later move committed there
        client, index, epoch, proposed = fresh.connect()
        client.close()
        assert (index, epoch, proposed) == (0, 3, 0)
    finally:
        restarted.close()
        live.shutdown_server()


def test_hosting_a_standby_does_not_wait_for_candidates_that_refuse(monkeypatch):
    """Found by this stop's measuring session: the host of a candidate asked every candidate
    for a committed epoch before hosting its standby, and a client retries a refused connect
    until its timeout, so each candidate that listened nowhere yet (its own, and the others
    at a job's start) cost ``PROBE_S``: every job with candidates started 6 s later (failed
    so before: 6.0 s here). A refused connection now answers that question at once."""
    monkeypatch.setattr(_failover, "PROBE_S", 2.0)  # as shipped: the module fixture shortens it
    ports = [_refused_port() for _ in range(3)]
    t0 = time.monotonic()
    c = Candidates(RUN, [("127.0.0.1", p) for p in ports], True, timedelta(seconds=5))
    try:
        took = time.monotonic() - t0
        assert c.standby_index == 0
        assert took < 1.0, f"hosting the standby took {took:.2f}s"
    finally:
        c.close()


def test_a_start_does_not_wait_for_candidates_that_refuse(monkeypatch):
    """A start probes every candidate, and a client retries a refused connect until its
    timeout: each candidate whose host was lost cost ``PROBE_S``, so a rack's replacements
    (two of three candidates' hosts lost) reached the rendezvous 4 s late (4.0 s here before).
    A refused connection now answers the probe at once."""
    monkeypatch.setattr(_failover, "PROBE_S", 2.0)  # as shipped: the module fixture shortens it
    live = _standby()
    c = Candidates(RUN, [("127.0.0.1", live.port)] + [("127.0.0.1", _refused_port())
                                                        for _ in range(2)],
                   False, timedelta(seconds=5))
    try:
        live.set(f"fe.rdzv.{RUN}/epoch", b"1")  # the rendezvous moved here: taken at once
        t0 = time.monotonic()
        client, i, epoch, proposed = c.connect()
        took = time.monotonic() - t0
        client.close()
        assert (i, epoch, proposed) == (0, 1, 0)
        assert took < 1.0, f"the start's connect took {took:.2f}s"
    finally:
        c.close()
        live.close()


def _silent_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A listener whose accept queue is full: the kernel drops every new SYN (silent, as a
    host behind a DROP rule), until :func:`_heal` accepts what is queued."""
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(0)
    queued = []
    for _ in range(16):  # bounded: a backlog of 0 holds one or two
        s = socket.socket()
        s.settimeout(0.3)
        try:
            s.connect(lst.getsockname())
        except TimeoutError:
            s.close()
            return lst, queued
        queued.append(s)
    raise AssertionError("the listener's accept queue never filled")


def test_a_silent_candidate_that_heals_during_a_probe_is_seen_by_a_fresh_connect(monkeypatch):
    """A probe of a silent candidate makes a fresh connect every QUICK_S (each a new SYN),
    not one connect for the whole PROBE_S: that one's SYN is retransmitted by the kernel
    only 1 s after the first, so a link healed meanwhile was seen up to 1 s later (a lone
    node's re-form after a heal waited for it: benchmarks/results/pods_vs_distinct36.md)."""
    monkeypatch.setattr(_failover, "PROBE_S", 2.0)  # as shipped
    lst, queued = _silent_listener()
    tries: list[float] = []
    real = socket.create_connection

    def counted(addr, timeout=None, *a, **k):
        tries.append(timeout)
        return real(addr, timeout, *a, **k)

    monkeypatch.setattr(_failover.socket, "create_connection", counted)
    c = Candidates(RUN, [lst.getsockname(), ("127.0.0.1", _refused_port())], False,
                   timedelta(seconds=5))
    try:
        assert c._listens(0, 0.5) == f"{c.name(0)} did not answer (timed out)"
        assert len(tries) >= 2 and max(tries) <= _failover.QUICK_S, tries  # one SYN each
        tries.clear()
        done: list[bool | str] = []
        probe = threading.Thread(target=lambda: done.append(c._listens(0, 2.0)))
        probe.start()
        wait_until = time.monotonic() + 5
        while len(tries) < 2 and time.monotonic() < wait_until:  # it is retrying: heal
            time.sleep(0.01)
        for _ in queued:
            lst.accept()[0].close()
        probe.join(5)
        assert done == [True], done
        assert max(tries) <= _failover.QUICK_S, tries
    finally:
        for s in queued:
            s.close()
        lst.close()
