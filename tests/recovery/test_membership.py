"""Membership watch of a complete round, in one process over a real loopback store."""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest

from fastelastic.errors import RendezvousMemberLostError
from fastelastic.rendezvous.fast.fast_rendezvous import FastRendezvousHandler
from fastelastic.rendezvous.timeouts import RendezvousTimeout
from fastelastic.store import TCPStore


class Counting:
    """Counts the requests made through a store client."""

    def __init__(self, store):
        self._store = store
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **k)

        return counted


def _handlers(port: int, n: int, ka: float = 0.2, ka_max: int = 3) -> list[FastRendezvousHandler]:
    timeout = RendezvousTimeout(join=timedelta(seconds=20), last_call=timedelta(seconds=0.05))
    return [FastRendezvousHandler("m", TCPStore("127.0.0.1", port, timeout=timedelta(seconds=20)),
                                  "c10d", n, n, timeout, local_addr=f"10.0.0.{i}",
                                  keep_alive_interval=ka, keep_alive_max_attempt=ka_max)
            for i in range(n)]


def _join(handlers):
    infos = [None] * len(handlers)

    def go(i):
        infos[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert all(infos), infos
    return infos


@pytest.fixture
def port():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield server.port
    server.shutdown_server()


def test_nothing_lost_costs_one_request(port):
    hs = _handlers(port, 3)
    _join(hs)
    counted = Counting(hs[0]._store)
    hs[0]._store = counted
    for _ in range(5):
        assert hs[0].lost_members() == []
    assert counted.calls == {"multi_get": 5}
    for h in hs:
        h.shutdown()


def test_dead_and_silent_members_are_named(port):
    hs = _handlers(port, 3)
    infos = _join(hs)
    rank = {i: infos[i].rank for i in range(3)}
    hs[2]._store.close()  # process death: the server runs its disconnect actions
    lost = hs[0].lost_members()
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        lost = hs[0].lost_members()
    assert lost == [(rank[2], f"node 10.0.0.2 (pid {os.getpid()}) dead: its connection closed")]
    assert hs[0].lost_members() == []  # reported once
    hs[1]._stop_heartbeats()  # hung: connected, silent
    t0 = time.monotonic()
    lost = []
    while not lost and time.monotonic() - t0 < 5:
        lost = hs[0].lost_members()
        time.sleep(0.02)
    took = time.monotonic() - t0
    assert [r for r, _ in lost] == [rank[1]] and "silent" in lost[0][1], lost
    assert 0.5 <= took < 1.5, took  # window 0.2 s x 3
    # the others learn it from the round's gone list, without their own window
    assert sorted(r for r, _ in hs[1].lost_members()) == sorted([rank[2], rank[1]])


def test_wait_members_raises_when_a_member_is_lost(port):
    hs = _handlers(port, 2)
    _join(hs)
    hs[1]._stop_heartbeats()
    t0 = time.monotonic()
    with pytest.raises(RendezvousMemberLostError, match="silent"):
        hs[0].wait_members(hs[0]._store, ["never/written"], time.monotonic() + 10)
    assert time.monotonic() - t0 < 3


def test_a_finished_node_leaving_is_no_loss(port):
    hs = _handlers(port, 3)
    _join(hs)
    hs[2].mark_done()  # its workers succeeded; then it leaves (exit barrier timed out)
    hs[2]._stop_heartbeats()
    hs[2]._store.close()
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # > the 0.6 s window: neither dead nor silent
        assert hs[0].lost_members() == []
        time.sleep(0.05)
    hs[1]._store.close()  # a real loss is still reported
    deadline = time.monotonic() + 5
    lost = []
    while not lost and time.monotonic() < deadline:
        lost = hs[0].lost_members()
    assert [why.split(") ", 1)[1] for _, why in lost] == ["dead: its connection closed"]
