"""The failover rules of issue 27's property test, on real handlers and loopback stores: a node
that carries no world never moves the rendezvous (finding A, and the start path), and a mover
whose round fails the majority rule goes back to the store where its world formed once that
answers (finding F)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from loopback import free_port as _free_port
from loopback import store as _store

from fastelastic.errors import RendezvousConnectionError, RendezvousTimeoutError
from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous.fast.failover._failover import Candidates, GoBack, LiveStore, Regroup
from fastelastic.rendezvous.fast.fast_rendezvous import create_fast_handler

RUN = "rules"
K = f"fe.rdzv.{RUN}/"


def _params(ports: list[int], min_nodes: int = 2, **conf: object) -> RendezvousParameters:
    endpoint = ",".join(f"127.0.0.1:{p}" for p in ports)
    return RendezvousParameters("c10d", endpoint, RUN, min_nodes, 4, is_host=False,
                                read_timeout=2, last_call_timeout=1, join_timeout=30, **conf)


@pytest.mark.timeout(60)
def test_a_node_with_no_world_that_loses_its_store_follows_only_a_committed_move(nodes):
    """Finding A on real handlers: a node waiting in its first round (no world) loses the live
    store. Before, it moved to the next candidate at once, marked it and took a ticket there,
    proposing epoch 1 (alone, with min_nodes 1, it would have formed a world there beside one
    that formed on the first store without it). Now it writes nothing on the other candidate
    and waits; once a world commits epoch 1 there, it follows and joins that world."""
    s0, s1 = _store(), _store()
    h = h2 = None
    try:
        h = create_fast_handler(_params([s0.port, s1.port]))
        assert h._live.index == 0
        nodes.start(0, lambda i: h.next_rendezvous())
        deadline = time.monotonic() + 10
        while not s0.check([K + "0/n/1"]) and time.monotonic() < deadline:
            time.sleep(0.02)
        s0.shutdown_server()                       # its store is lost while it has no world
        time.sleep(1.5)                            # far more than a move takes
        assert not s1.check([K + "moving"]), s1.get(K + "moving")
        assert not s1.check([K + "0/t"]), "it took a ticket on the other candidate"
        s1.set(K + "epoch", b"1")                  # a world's move commits there
        h2 = create_fast_handler(_params([_free_port(), s1.port]))
        nodes.start(1, lambda i: h2.next_rendezvous())
        nodes.join(20)
        assert not nodes.errors, nodes.errors
        assert [nodes.results[i].world_size for i in (0, 1)] == [2, 2]
        assert h._live.index == 1 and h._live.epoch == 1
        assert not s1.check([K + "moving"])       # nobody proposed anything
    finally:
        for x in (h, h2):
            if x is not None:
                x._close_owned(linger=False)
        s1.shutdown_server()


@pytest.mark.timeout(30)
def test_a_node_with_no_world_whose_store_never_comes_back_gets_the_rule_at_its_join_timeout():
    """The liveness cost of finding A's rule, said: the first store lost for good before any
    world formed. The node waits (nothing is written elsewhere) and its join timeout's error
    names the rule and the way out, instead of forming a world on the next candidate."""
    s0, s1 = _store(), _store()
    h = None
    try:
        params = _params([s0.port, s1.port])
        params.config["join_timeout"] = 3
        h = create_fast_handler(params)
        s0.shutdown_server()
        t0 = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="belongs to no world") as e:
            h.next_rendezvous()
        assert "did not complete within 3 seconds" in str(e.value), e.value
        assert "restart the job" in str(e.value) and time.monotonic() - t0 < 10
        assert not s1.check([K + "moving"]) and not s1.check([K + "0/t"])
    finally:
        if h is not None:
            h._close_owned(linger=False)
        s1.shutdown_server()


@pytest.mark.timeout(30)
def test_a_starting_node_never_starts_the_rendezvous_on_another_candidate():
    """The start path of finding A: the first candidate never answers (here: nothing listens)
    and the others hold no committed epoch. Before, the node took the second after the read
    timeout and proposed epoch 1 there (a node cut from the first alone would form a world of
    its own). Now the read timeout's error names the rule; a committed epoch is followed."""
    s1 = _store()
    try:
        params = _params([_free_port(), s1.port])
        params.config["join_timeout"] = 3          # others answer: it waits the join timeout
        t0 = time.monotonic()
        with pytest.raises(RendezvousConnectionError, match="belongs to no world") as e:
            create_fast_handler(params)
        assert "did not answer within 3 seconds" in str(e.value), e.value
        assert 2.5 < time.monotonic() - t0 < 10, e.value
        assert not s1.check([K + "moving"])
        s1.set(K + "epoch", b"2")
        h = create_fast_handler(_params([_free_port(), s1.port]))
        try:
            assert (h._live.index, h._live.epoch, h._live.proposed) == (1, 2, 0)
        finally:
            h._close_owned(linger=False)
    finally:
        s1.shutdown_server()


@pytest.mark.timeout(30)
def test_a_mover_whose_round_fails_goes_back_to_its_world_or_regroups_earlier():
    """Finding F on real stores (``Candidates.check``): a mover alone on the third candidate,
    its move not committed, its world formed on the first (round 2 there). Before, it went
    back only when a newer round had formed there, so movers stranded on different
    successors never met. Now: the first answering again with no round since, it goes back
    as a member of its world (``rejoin``); with one since, as a new node; while the first
    does not answer (or answers empty: its rounds lost), it regroups on the second, the first
    answering candidate in list order, where the other movers of its world are."""
    s0, s1, s2 = _store(), _store(), _store()
    try:
        c = Candidates(RUN, [("127.0.0.1", s.port) for s in (s0, s1, s2)], False,
                       timedelta(seconds=2))
        c.plan.me = "10.0.0.9|99"
        live = LiveStore(2, 0, 1, (0, 2))
        s0.set(K + "open", b"3")                   # round 2 was the last complete one
        with pytest.raises(GoBack) as e:
            c.check(live)
        assert e.value.rejoin, e.value
        s0.set(K + "open", b"4")                   # its world went on without it
        with pytest.raises(GoBack) as e:
            c.check(live)
        assert not e.value.rejoin, e.value
        port = s0.port
        s0.shutdown_server()
        for _ in range(2):                         # nothing answers there, then empty
            with pytest.raises(Regroup) as g:
                c.check(live)
            assert g.value.index == 1, g.value
            s0 = _store(port)
        client, moved = c.regroup(live, 1)
        client.close()
        assert (moved.index, moved.proposed, moved.left) == (1, 1, (0, 2))
        assert s1.get(K + "moving") == b"1|10.0.0.9|99;"  # its mark, as a move writes
        c.check(moved)                             # the first in the list: it stays
    finally:
        for s in (s0, s1, s2):
            s.shutdown_server()
