"""The fence of finding G on real handlers and loopback stores: the proof that lost members
are gone appends a fence of each to every other candidate's ``moving`` list, then reads it; a
mover reads the list after its mark. A mark before the fence blocks the proof; a mover whose
mark comes after it drops its world and does not count as a carrier on the successor."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest
from loopback import free_port as _free_port
from loopback import store as _store

from fastelastic.errors import RendezvousTimeoutError
from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous.fast import _schema as sc
from fastelastic.rendezvous.fast.failover._failover import Candidates, Fenced, LiveStore
from fastelastic.rendezvous.fast.fast_rendezvous import create_fast_handler
from fastelastic.store import TCPStore

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
    listens on s2 (refused: no answer). Three candidates: a mover's mark and a proof's fences
    each count once read back from two. Mover A marks s1 and s0 (s2 refuses) before any proof:
    the proof of A is blocked and, bound to fail, leaves no fence (its first pass only reads).
    The proof of B passes and leaves B's fence; B's mark after it raises ``Fenced`` (on a move
    and on a regroup), while a mover of another world (a stale fence) is not fenced. Before the
    fence, a proof that read s1 before B's mark passed and B carried the world there all the
    same."""
    s0, s1 = _store(), _store()
    try:
        ports = [s0.port, s1.port, _free_port()]
        prover = _candidates(ports, "10.0.0.1|1")
        a, b = _candidates(ports, "10.0.0.2|2"), _candidates(ports, "10.0.0.3|3")
        client, i, _, proposed = a.connect(exclude=0, at_least=1, world=W)
        client.close()
        assert (i, proposed) == (1, 1)
        why = prover.gone_elsewhere(0, ["10.0.0.2|2", "10.0.0.3|3"], W)
        assert why == f"['10.0.0.2|2'] moved: marked on 127.0.0.1:{s0.port} before any fence", why
        assert s1.get(K + "moving") == b"1|10.0.0.2|2;"  # no fence left by a failing proof
        assert s0.get(K + "moving") == b"1|10.0.0.2|2;"  # the mover's second mark
        assert prover.gone_elsewhere(0, ["10.0.0.3|3"], W) == ""
        assert re.fullmatch(rb"1\|10\.0\.0\.2\|2;x1\.0badf00d/[0-9a-f]{8}\|10\.0\.0\.3\|3;",
                            s1.get(K + "moving"))  # the fence: world id / the proof's name
        with pytest.raises(Fenced, match="proved it gone first"):
            b.connect(exclude=0, at_least=1, world=W)
        assert re.search(rb"x1\.0badf00d/[0-9a-f]{8}\|10\.0\.0\.3\|3;1\|10\.0\.0\.3\|3;$",
                         s1.get(K + "moving"))
        # the fenced mark is after the fence: the proof, asked again, still finds B gone
        assert prover.gone_elsewhere(0, ["10.0.0.3|3"], W) == ""
        with pytest.raises(Fenced):                # a regroup there carrying W: the same
            b.regroup(LiveStore(2, 0, 1, (0, 4)), 1, W)
        client, _, _, _ = b.connect(exclude=0, at_least=1, world=b"2.feedface")
        client.close()                             # another world's member: not fenced
        client, _, _, _ = a.connect(exclude=0, at_least=1, world=W)
        client.close()                             # A marked before the fence: not fenced
    finally:
        s0.shutdown_server()
        s1.shutdown_server()


def test_a_withdrawal_lifts_its_own_proof_s_fence_and_only_from_then_on():
    """The order in ``moving``, as every reader judges it: a fence stands from its append until
    the same proof withdraws it; a mark made while any fence of its mover from that world
    stands is fenced (its mover drops the world, and no proof counts it as moved), whatever
    comes after. Another proof's fence, another world's and an older writer's (no proof
    name) are judged alike."""
    me, other = "10.0.0.3|3", "10.0.0.4|4"

    def order(*entries: bytes) -> tuple[bool, bool]:  # (the mover is fenced, the prover
        raw = b"".join(entries)                          # finds it moved in time)
        return sc.fenced(raw, me, W), sc.marked_before_fence(raw, me, W)

    fence = sc.encode_fence(W, me, b"p1")
    lifted = sc.encode_withdrawal(W, me, b"p1")
    mark = sc.encode_mark(1, me)
    assert order(mark) == (False, True)
    assert order(fence, mark) == (True, False)
    assert order(fence, lifted, mark) == (False, True)
    assert order(fence, mark, lifted) == (True, False)  # lifted too late for that mark
    assert order(fence, mark, lifted, mark) == (False, True)  # its next mark counts
    assert order(fence, sc.encode_fence(W, me, b"p2"), lifted, mark) == (True, False)
    assert order(fence, sc.encode_withdrawal(W, me, b"p2"), mark) == (True, False)
    assert order(fence, sc.encode_withdrawal(W, other, b"p1"), mark) == (True, False)
    assert order(sc.encode_fence(b"2.feedface", me, b"p1"), mark) == (False, True)
    assert order(b"x%s|%s;" % (W, me.encode()), mark) == (True, False)  # an older writer's
    assert order(mark, fence, mark) == (True, True)  # moved in time once: the proof fails


@pytest.mark.timeout(60)
def test_a_candidate_whose_host_restarts_after_a_proof_carries_its_fences():
    """Real stores: the world trains on candidate 1 (the rendezvous moved there); candidates 0
    and 2 answer. A proof passes there: its fences are read back from candidates 1 and 0.
    Candidate 0's host restarts: its new store starts not counting (its ``u`` entry), and
    counts once its host has copied the other candidates' lists (every other one answers), so
    it holds the proof's fence again. Member B, declared gone (cut from candidate 1, say), then
    moves to candidate 0 carrying its world: it is fenced there. A member not declared gone
    carries its world there. Without the copy, candidate 0 came back with no fence, and a cut
    majority could carry its world there while the world the proof let form trained.

    With candidate 2 down too, the restarted store cannot copy enough (one of two others):
    it does not count, and a mover's mark there is no answer."""
    live, s0, s2 = _store(), _store(), _store()
    restarted = None
    try:
        ports = [s0.port, live.port, s2.port]
        prover = _candidates(ports, "10.0.0.1|1")
        assert prover.gone_elsewhere(1, ["10.0.0.3|3"], W) == ""
        assert sc.fenced(bytes(s0.get(K + "moving")) + sc.encode_mark(1, "10.0.0.3|3"),
                         "10.0.0.3|3", W)  # the fence on candidate 0 before its restart
        s0.shutdown_server()                      # candidate 0's host restarts
        restarted = Candidates(RUN, [("127.0.0.1", p) for p in ports], True,
                               timedelta(seconds=2))
        assert restarted.standby_index == 0
        own = bytes(restarted.standby.get(K + "moving"))
        assert sc.counts(own) and sc.fenced(own + sc.encode_mark(1, "10.0.0.3|3"),
                                            "10.0.0.3|3", W), own  # copied from candidate 1
        b = _candidates(ports, "10.0.0.3|3")
        with pytest.raises(Fenced, match="proved it gone first"):
            b.connect(exclude=1, at_least=1, world=W)
        client, i, _, _ = _candidates(ports, "10.0.0.4|4").connect(exclude=1, at_least=1,
                                                                   world=W)
        client.close()  # a member not declared gone carries its world there
        assert i == 0
        restarted.close()
        restarted = None
        s2.shutdown_server()                      # candidates 0 and 2 lost: 0 restarts again
        restarted = Candidates(RUN, [("127.0.0.1", p) for p in ports], True,
                               timedelta(seconds=2))
        own = bytes(restarted.standby.get(K + "moving"))
        assert sc.incarnation(own) is not None and not sc.counts(own), own
        why = prover.gone_elsewhere(1, ["10.0.0.5|5"], W)
        assert "fewer than 2 of the 3 candidates answer" in why and "not synced" in why, why
    finally:
        if restarted is not None:
            restarted.close()
        live.shutdown_server()
        for s in (s0, s2):
            with contextlib.suppress(Exception):
                s.shutdown_server()


def _params(ports: list[int], addr: str, defaults: bool = False) -> RendezvousParameters:
    endpoint = ",".join(f"127.0.0.1:{p}" for p in ports)
    if defaults:  # torch's: last call 30 s, join 600 s, keep-alive 5 s x 3
        return RendezvousParameters("c10d", endpoint, RUN, 2, 4, is_host=False,
                                    local_addr=addr)
    return RendezvousParameters("c10d", endpoint, RUN, 2, 4, is_host=False, local_addr=addr,
                                read_timeout=2, last_call_timeout=1, join_timeout=6)


def _wait_stopped(pid: int) -> None:
    """Until ``pid`` is stopped (``T`` in /proc): kill() returns before the stop takes effect,
    and a server thread running on the other CPU could answer one more request."""
    for _ in range(1000):  # at most ~10 s
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rpartition(")")[2].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop")


class _FrozenStore:
    """A store in a process of its own, to freeze (SIGSTOP) and thaw."""

    def __init__(self) -> None:
        code = ("import sys; from datetime import timedelta; from fastelastic.store import "
                "TCPStore; s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False,"
                " multi_tenant=True, timeout=timedelta(seconds=30)); print(s.port, flush=True);"
                " sys.stdin.read()")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        self.port = int(self.proc.stdout.readline())

    def close(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)
        self.proc.kill()
        self.proc.wait(10)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("fence", ["none", "fenced", "withdrawn", "withdrawn-defaults"])
def test_a_fenced_mover_does_not_count_as_a_carrier_on_the_successor(nodes, fence):
    """Real handlers: a world of 2 forms on s0, s0's host is lost, both move to s1. Without a
    fence they are 2 carriers of 2 and form their world there (the control). With node 1
    fenced on s1 first (as the proof on s0 leaves it), node 1 drops its world when its mark
    comes after the fence: it takes no ticket on s1, carries nothing, and waits for s0 or a
    committed move; node 0 alone is 1 of the 2 needed, so no world forms on s1 (before the
    fence, node 1 counted there while s0's proof counted it gone).

    Withdrawn (three candidates): the proof fences node 1 on s0 and s1, then s1's process is
    frozen (SIGSTOP) before the proof reads its fence back, so the proof fails; s1 thaws, the
    proof withdraws its fences, and the world of 2 forms there as in the control. Without the
    withdrawal, that fence stayed: node 1 was fenced by a proof that had failed, and with s0
    lost nobody could make the world's majority again until the join timeout."""
    frozen = _FrozenStore() if fence.startswith("withdrawn") else None
    s0 = _store()
    s1: Any = _store() if frozen is None else TCPStore(
        "127.0.0.1", frozen.port, timeout=timedelta(seconds=30))
    s2 = _store() if frozen is not None else None
    hs = []
    try:
        ports = [s0.port, frozen.port if frozen else s1.port] + ([s2.port] if s2 else [])
        hs = [create_fast_handler(_params(ports, f"127.0.0.{i + 1}", fence.endswith("defaults")))
              for i in range(2)]
        for i in range(2):
            nodes.start(i, lambda i: hs[i].next_rendezvous())
        nodes.join(45)  # torch's last call: 30 s
        assert not nodes.errors, nodes.errors
        wid = hs[0]._m.world_id
        assert wid and hs[1]._m.world_id == wid
        prover = _candidates(ports, "127.0.0.1|0")
        me = hs[1]._candidates.plan.me
        if fence == "fenced":
            assert prover.gone_elsewhere(0, [me], wid) == ""
        elif frozen is not None:
            marks, fenced_s1 = prover._marks, []

            def freeze_s1_before_its_read_back(i: int, entry: bytes) -> bytes | str | None:
                if i == 1 and entry.startswith(b"x"):
                    fenced_s1.append(True)
                elif i == 1 and not entry and fenced_s1:  # the read-back after its fence
                    os.kill(frozen.proc.pid, signal.SIGSTOP)
                    _wait_stopped(frozen.proc.pid)
                elif i == 1 and entry.startswith(b"y"):  # the withdrawal: thawed by then
                    os.kill(frozen.proc.pid, signal.SIGCONT)
                return marks(i, entry)
            prover._marks = freeze_s1_before_its_read_back  # type: ignore[method-assign]
            why = prover.gone_elsewhere(0, [me], wid)
            assert why == f"127.0.0.1:{frozen.port} did not answer the read-back", why
            os.kill(frozen.proc.pid, signal.SIGCONT)
            assert not sc.fenced(bytes(s1.get(K + "moving")) + sc.encode_mark(1, me), me, wid)
        s0.shutdown_server()                       # the world's store is lost
        for i in range(2):                         # the agent's check notices it, and moves
            lost = hs[i].lost_members()
            assert len(lost) == 1 and lost[0][0] == -1, lost
            said = ("proven gone from its world" if fence == "fenced" and i == 1 else
                    "the rendezvous moved to")
            assert said in lost[0][1], lost
        for i in range(2):
            nodes.start(10 + i, lambda i: hs[i - 10].next_rendezvous())
        nodes.join(30)
        if fence != "fenced":
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
        assert out.kind is not sc.OutcomeKind.COMPLETE, out
        assert not s1.check([K + "epoch"]) or s1.get(K + "epoch") == b"0"
        assert sc.fenced(bytes(s1.get(K + "moving")), me, wid)  # its mark after the fence
    finally:
        for h in hs:
            h._close_owned(linger=False)
        if frozen is not None:
            s1.close()
            frozen.close()
        else:
            s1.shutdown_server()
        if s2 is not None:
            s2.shutdown_server()
