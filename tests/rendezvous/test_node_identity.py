"""A node's identity in the rendezvous: unique per launcher, whatever its address, pid or
hostname (pods: no ``--local-addr``, the launcher is PID 1, hostnames may repeat)."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

from loopback import store as _store

from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous.fast import _requests as rq
from fastelastic.rendezvous.fast import _schema as sc
from fastelastic.rendezvous.fast import fast_rendezvous as fr
from fastelastic.rendezvous.fast.failover import _majority

RUN = "ident"
K = sc.RunKeys(RUN)


def _pods(monkeypatch: Any, n: int) -> list[str]:
    """``n`` launchers as pods start them: one hostname, pid 1."""
    monkeypatch.setattr(socket, "gethostname", lambda: "pod")
    monkeypatch.setattr(os, "getpid", lambda: 1)
    ids = [fr.new_node_id() for _ in range(n)]
    monkeypatch.undo()
    return ids


def _drive(gen: rq.RequestGen[Any], data: dict[str, bytes],
           elsewhere: Callable[[rq.GoneElsewhere], str] = lambda op: "") -> Any:
    """Runs a majority-rule operation on a dict (every key it reads is there); ``elsewhere``
    answers its ``GoneElsewhere`` (the other candidates' proof)."""
    reply: Any = None
    for _ in range(100):
        try:
            op = gen.send(reply)
        except StopIteration as e:
            return e.value
        match op:
            case rq.Get(key, _):
                reply = data[key]
            case rq.MultiGet(keys):
                reply = [data[k] for k in keys]
            case rq.Check(keys):
                reply = all(k in data for k in keys)
            case rq.Add(key, amount):
                data[key] = b"%d" % (int(data.get(key, b"0")) + amount)
                reply = int(data[key])
            case rq.GoneElsewhere():
                reply = elsewhere(op)
            case _:
                raise AssertionError(f"unexpected request {op!r}")
    raise AssertionError("an operation that never ends")


def _world(ids: list[str], wid: bytes) -> dict[str, bytes]:
    """Round 0 complete on this store: a world of ``len(ids)`` pods ("" address, pid 1)."""
    k = K.round(0)
    data = {k.outcome: sc.encode_outcome(len(ids), b":29500", True, wid), k.gone: b""}
    for rank, node in enumerate(ids):
        data[k.who(rank)] = b"%d|%s" % (rank + 1, sc.encode_record(rank, "", 1, b"", node=node))
    return data


def test_pods_with_one_hostname_and_pid_and_no_address_get_distinct_identities(monkeypatch):
    ids = _pods(monkeypatch, 3)
    assert len(set(ids)) == 3, ids
    assert all(x.startswith("pod:1:") and len(x.rsplit(":", 1)[1]) == 16 for x in ids), ids
    rec = sc.encode_record(0, "", 1, b"", node=ids[0])
    assert sc.record_node(rec) == ids[0] and sc.who_node(b"7|" + rec) == ids[0]
    mark = sc.encode_mark(2, ids[0]) + sc.encode_fence(b"1.ab", ids[1], b"p")
    assert sc.marks(mark) == [(2, ids[0])]
    assert sc.fenced(mark + sc.encode_mark(2, ids[1]), ids[1], b"1.ab")
    assert not sc.fenced(mark + sc.encode_mark(2, ids[2]), ids[2], b"1.ab")


def test_a_hostname_with_the_wire_formats_separators_cannot_break_a_record():
    node = sc.node_id("a|b;c/d é", 7, 1 << 70 | 5)
    assert node == "a_b_c_d__:7:0000000000000005", node
    assert sc.record_node(sc.encode_record(0, "", 7, b"", node=node)) == node
    assert sc.node_id("", 1, 1).startswith("?:1:")


def test_the_majority_rule_counts_pods_that_share_a_hostname_pid_and_address(monkeypatch):
    """A world of 3 pods formed here; one of them (a new node here: it came back by another
    store) is in this round's records. The two others are away, a majority: the round must not
    form. Named by address and pid, all three were ``|1``: the one back hid the two away."""
    ids = _pods(monkeypatch, 3)
    wid = b"1.0badf00d"
    back = [sc.encode_record(-1, "", 1, b"", node=ids[0])]
    why = _drive(_majority.objection(back, (0, 3), True, K, 1), _world(ids, wid))
    assert why.startswith("ranks [1, 2] of round 0 (a world of 3) may be alive elsewhere"), why
    assert "did not close their connections here" in why, why
    # Those two back as well: nobody is away, the round may form.
    back += [sc.encode_record(-1, "", 1, b"", node=x) for x in ids[1:]]
    assert _drive(_majority.objection(back, (0, 3), True, K, 1), _world(ids, wid)) == ""


def test_the_proof_asks_the_other_candidates_about_each_pod_by_its_identity(monkeypatch):
    """Two of the three closed their connections here: the proof that they are gone asks the
    other candidates about exactly those two identities (not ``|1``, which names all three)."""
    ids = _pods(monkeypatch, 3)
    data = _world(ids, b"1.0badf00d")
    data[K.round(0).gone] = b"1:closed;2:closed;"
    asked: list[tuple[list[str], bytes]] = []

    def proven(op: rq.GoneElsewhere) -> str:
        asked.append((list(op.idents), op.world))
        return ""

    back = [sc.encode_record(-1, "", 1, b"", node=ids[0])]
    assert _drive(_majority.objection(back, (0, 3), True, K, 1), data, proven) == ""
    assert asked == [(ids[1:], b"1.0badf00d")], asked


def test_two_launchers_in_one_pid_with_no_address_move_as_two_nodes(nodes):
    """Two handlers of one process (one hostname and pid), no ``local_addr``, two candidates:
    each names itself by an identity of its own in its records, ``who`` entries and marks, and
    when the first store is lost both carry their world of 2 to the second, where it needs
    both of them."""
    s0, s1 = _store(), _store()
    hs: list[fr.FastRendezvousHandler] = []
    try:
        endpoint = f"127.0.0.1:{s0.port},127.0.0.1:{s1.port}"
        hs = [fr.create_fast_handler(RendezvousParameters(
            "c10d", endpoint, RUN, 2, 2, is_host=False, read_timeout=2, last_call_timeout=1,
            join_timeout=10)) for _ in range(2)]
        mine = [h._node for h in hs]
        assert len(set(mine)) == 2 and all(h._candidates.plan.me == h._node for h in hs)
        host = sc.node_id(socket.gethostname(), os.getpid(), 0).rsplit(":", 1)[0]
        assert all(x.startswith(host + ":") for x in mine), (mine, host)
        for i in range(2):
            nodes.start(i, lambda i: hs[i].next_rendezvous())
        nodes.join(30)
        assert not nodes.errors, nodes.errors

        def who(store: Any) -> list[bytes]:
            return [bytes(store.get(K.round(0).who(r))) for r in range(2)]
        assert sorted(map(sc.who_node, who(s0))) == sorted(mine)
        assert {sc.who_parts(w)[1:] for w in who(s0)} == {("", str(os.getpid()))}
        s0.shutdown_server()                       # the world's store is lost
        for h in hs:                               # each notices it, and moves
            lost = h.lost_members()
            assert len(lost) == 1 and "the rendezvous moved to" in lost[0][1], lost
        assert sorted(x for _, x in sc.marks(bytes(s1.get(K.moving)))) == sorted(mine)
        for i in range(2):
            nodes.start(10 + i, lambda i: hs[i - 10].next_rendezvous())
        nodes.join(30)
        assert not nodes.errors, nodes.errors
        assert [nodes.results[10 + i].world_size for i in range(2)] == [2, 2]
        assert sorted(map(sc.who_node, who(s1))) == sorted(mine)
        assert s1.get(K.epoch) == b"1"             # the move committed
    finally:
        for h in hs:
            h._close_owned(linger=False)
        s1.shutdown_server()


def test_a_lost_pod_is_reported_by_its_identity_when_it_has_no_address():
    from simstore import Sim

    sim = Sim(2, 3)
    nodes = [sim.start(0) for _ in range(3)]
    nodes[1].addr = ""  # a pod: no --local-addr
    sim.kill(50, nodes[1])
    sim.run(60)
    rank = [s for _, s in nodes[1].seats][0].rank
    assert nodes[0].lost_seen[0] == [(rank, "node h1:1001:0000000000000001 (pid 1001) dead: "
                                            "its connection closed")], nodes[0].lost_seen
