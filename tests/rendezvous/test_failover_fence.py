"""The fence of finding G on real handlers and loopback stores: the proof that lost members
are gone appends a fence of each to every other candidate's ``moving`` list, then reads it; a
mover reads the list after its mark. A mark before the fence blocks the proof; a mover whose
mark comes after it drops its world and does not count as a carrier on the successor."""

from __future__ import annotations

from datetime import timedelta

import pytest
from loopback import free_port as _free_port
from loopback import store as _store

from fastelastic.errors import RendezvousTimeoutError
from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous import _schema as sc
from fastelastic.rendezvous._failover import Candidates, Fenced, Live
from fastelastic.rendezvous.fast_rendezvous import create_fast_handler

RUN = "fence"
K = f"fe.rdzv.{RUN}/"
W = b"1.0badf00d"  # a world id (``<gen>.<nonce>``)


def _candidates(ports: list[int], me: str) -> Candidates:
    c = Candidates(RUN, [("127.0.0.1", p) for p in ports], False, timedelta(seconds=2))
    c.plan.me = me
    return c


@pytest.mark.timeout(30)
def test_a_mark_before_the_fence_blocks_the_proof_and_a_mark_after_it_is_fenced():
    """On real stores (``Candidates``): s0 is where the world formed, s1 answers, nothing
    listens on s2 (refused: skipped). Mover A marks s1 before any proof: the proof of A is
    blocked and, bound to fail, leaves no fence (its first pass only reads). The proof of B
    passes and leaves B's fence; B's mark after it raises ``Fenced`` (on a move and on a
    regroup), while a mover of another world (a stale fence) is not fenced. Before the fence,
    a proof that read s1 before B's mark passed and B carried the world there all the same."""
    s0, s1 = _store(), _store()
    try:
        ports = [s0.port, s1.port, _free_port()]
        prover = _candidates(ports, "10.0.0.1|1")
        a, b = _candidates(ports, "10.0.0.2|2"), _candidates(ports, "10.0.0.3|3")
        client, i, _, proposed = a.connect(exclude=0, at_least=1, world=W)
        client.close()
        assert (i, proposed) == (1, 1)
        why = prover.gone_elsewhere(0, ["10.0.0.2|2", "10.0.0.3|3"], W)
        assert why == f"['10.0.0.2|2'] moved to 127.0.0.1:{s1.port}", why
        assert s1.get(K + "moving") == b"1|10.0.0.2|2;"  # no fence left by a failing proof
        assert prover.gone_elsewhere(0, ["10.0.0.3|3"], W) == ""
        assert s1.get(K + "moving") == b"1|10.0.0.2|2;x1.0badf00d|10.0.0.3|3;"
        with pytest.raises(Fenced, match="proved it gone first"):
            b.connect(exclude=0, at_least=1, world=W)
        assert s1.get(K + "moving").endswith(b"x1.0badf00d|10.0.0.3|3;1|10.0.0.3|3;")
        # the fenced mark is after the fence: the proof, asked again, still finds B gone
        assert prover.gone_elsewhere(0, ["10.0.0.3|3"], W) == ""
        with pytest.raises(Fenced):                # a regroup there carrying W: the same
            b.regroup(Live(2, 0, 1, (0, 4)), 1, W)
        client, _, _, _ = b.connect(exclude=0, at_least=1, world=b"2.feedface")
        client.close()                             # another world's member: not fenced
        client, _, _, _ = a.connect(exclude=0, at_least=1, world=W)
        client.close()                             # A marked before the fence: not fenced
    finally:
        s0.shutdown_server()
        s1.shutdown_server()


def _params(ports: list[int], addr: str) -> RendezvousParameters:
    endpoint = ",".join(f"127.0.0.1:{p}" for p in ports)
    return RendezvousParameters("c10d", endpoint, RUN, 2, 4, is_host=False, local_addr=addr,
                                read_timeout=2, last_call_timeout=1, join_timeout=6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fence", [False, True], ids=["no fence", "fenced"])
def test_a_fenced_mover_does_not_count_as_a_carrier_on_the_successor(nodes, fence):
    """Real handlers: a world of 2 forms on s0, s0's host is lost, both move to s1. Without a
    fence they are 2 carriers of 2 and form their world there (the control). With node 1
    fenced on s1 first (as the proof on s0 leaves it), node 1 drops its world when its mark
    comes after the fence: it takes no ticket on s1, carries nothing, and waits for s0 or a
    committed move; node 0 alone is 1 of the 2 needed, so no world forms on s1 (before the
    fence, node 1 counted there while s0's proof counted it gone)."""
    s0, s1 = _store(), _store()
    hs = []
    try:
        ports = [s0.port, s1.port]
        hs = [create_fast_handler(_params(ports, f"127.0.0.{i + 1}")) for i in range(2)]
        for i in range(2):
            nodes.start(i, lambda i: hs[i].next_rendezvous())
        nodes.join(20)
        assert not nodes.errors, nodes.errors
        wid = hs[0]._m.world_id
        assert wid and hs[1]._m.world_id == wid
        if fence:
            prover = _candidates(ports, "127.0.0.1|0")
            me = hs[1]._candidates.plan.me
            assert prover.gone_elsewhere(0, [me], wid) == ""
        s0.shutdown_server()                       # the world's store is lost
        for i in range(2):                         # the agent's check notices it, and moves
            lost = hs[i].lost_members()
            assert len(lost) == 1 and lost[0][0] == -1, lost
            said = "proven gone from its world" if fence and i == 1 else "the rendezvous moved to"
            assert said in lost[0][1], lost
        for i in range(2):
            nodes.start(10 + i, lambda i: hs[i - 10].next_rendezvous())
        nodes.join(30)
        if not fence:
            assert not nodes.errors, nodes.errors
            assert [nodes.results[10 + i].world_size for i in range(2)] == [2, 2]
            assert s1.get(K + "epoch") == b"1"     # the move committed
            return
        assert set(nodes.errors) == {10, 11}, nodes.errors
        assert isinstance(nodes.errors[11], RendezvousTimeoutError), nodes.errors[11]
        assert "belongs to no world" in str(nodes.errors[11]), nodes.errors[11]
        assert hs[1]._m.carried == 0 and hs[1]._m.world_id == b""
        records = [bytes(s1.get(K + f"0/n/{t}")) for t in range(1, 5)
                   if s1.check([K + f"0/n/{t}"])]
        assert records and all(r.split(b"|")[1] == b"127.0.0.1" for r in records), records
        out = sc.parse_outcome(bytes(s1.get(K + "0/res")))
        assert out.kind is not sc.Kind.COMPLETE, out
        assert not s1.check([K + "epoch"]) or s1.get(K + "epoch") == b"0"
        assert sc.fenced(bytes(s1.get(K + "moving")), me, wid)  # its mark after the fence
    finally:
        for h in hs:
            h._close_owned(linger=False)
        s1.shutdown_server()
