"""The rendezvous state machine (``_round``) alone: its transition table, and every rule of the
protocol as a scenario on a simulated store and clock (``simstore``), at torch's default
timeouts unless a row says otherwise. No sockets, threads or sleeps: a scenario of minutes of
simulated time runs in milliseconds, the same way every time."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import pytest
from simstore import Sim

from fastelastic.errors import RendezvousError
from fastelastic.rendezvous.fast import _requests as rq
from fastelastic.rendezvous.fast import _schema as sc
from fastelastic.rendezvous.fast._phases import FINAL, TRANSITIONS, Event, Phase, transition

# ---------------------------------------------------------------------- the transition table


def _successors(phase: Phase) -> set[Phase]:
    return {to for (frm, _), to in TRANSITIONS.items() if frm is phase}


def test_every_phase_but_the_final_ones_has_a_way_out_and_the_final_ones_none():
    for phase in Phase:
        assert bool(_successors(phase)) == (phase not in FINAL), phase


def test_the_phases_of_one_attempt_form_no_cycle_so_each_runs_at_most_once():
    # _attempt bounds its loop by the number of phases: that holds only without cycles.
    def visit(phase: Phase, stack: tuple[Phase, ...]) -> None:
        assert phase not in stack, f"cycle {stack + (phase,)}"
        for nxt in _successors(phase):
            visit(nxt, stack + (phase,))

    visit(Phase.TICKET, ())
    reachable, todo = set(), [Phase.TICKET]
    while todo:
        p = todo.pop()
        if p not in reachable:
            reachable.add(p)
            todo += _successors(p)
    assert reachable == set(Phase)


@pytest.mark.parametrize("phase,event,expected", [
    (Phase.TICKET, Event.FULL, Phase.NEXT),
    (Phase.RECORD, Event.PUBLISHER, Phase.PUBLISH_GATE),
    (Phase.RECORD, Event.COORDINATOR, Phase.COORD_GATE),
    (Phase.RECORD, Event.WAITER, Phase.AWAIT),
    (Phase.COORD_GATE, Event.FIRST, Phase.LAST_CALL),
    (Phase.COORD_GATE, Event.OVER, Phase.DRAIN),
    (Phase.SEAL, Event.FULL, Phase.AWAIT),
    (Phase.AWAIT, Event.ABANDONED, Phase.NEXT),
    (Phase.AWAIT, Event.CLOSED, Phase.CLOSED),
    (Phase.SEAT, Event.NOT_ADMITTED, Phase.NEXT),
])
def test_transition(phase, event, expected):
    assert transition(phase, event) is expected


@pytest.mark.parametrize("phase,event", [
    (Phase.TICKET, Event.COMPLETE), (Phase.MEMBER, Event.TICKET), (Phase.SEAL, Event.DRAINED),
])
def test_a_pair_without_a_rule_is_an_error(phase, event):
    with pytest.raises(RendezvousError, match="no rendezvous transition"):
        transition(phase, event)


# ---------------------------------------------------------------------- scenarios

CLOSER = 99  # a node index that only closes the rendezvous


@dataclass
class Case:
    name: str
    nodes: str  # min:max
    starts: list[float]
    script: list[tuple[float, str, int]] = field(default_factory=list)  # (t, action, node)
    conf: dict[str, Any] = field(default_factory=dict)
    until: float = 300.0
    # (world, formed no earlier than, no later than) of each complete round, in order
    rounds: list[tuple[int, float, float]] = field(default_factory=list)
    errors: dict[int, str] = field(default_factory=dict)  # node -> exception type
    restarts: dict[int, int] | None = None  # node -> restarts (None: not checked)
    members: list[set[int]] | None = None  # the nodes of each complete round
    moved: int = 0  # the nodes were members of a world of this size on a lost store
    fresh: list[int] = field(default_factory=list)  # ...except these (new nodes)
    proposed: int = 0  # the epoch the movers propose on this store
    epoch: int | None = None  # the store's committed epoch at the end (None: not checked)


CASES = [
    Case("max nodes at once: no last call", "3:3", [0, 0, 0], rounds=[(3, 0, 0)],
         restarts={0: 0, 1: 0, 2: 0}),
    Case("2:3 with 2 nodes: a world of 2 after the 30 s last call", "2:3", [0, 0],
         rounds=[(2, 30, 30)]),
    Case("1:2 with 1 node", "1:2", [0], rounds=[(1, 30, 30)]),
    Case("2 with 2 nodes", "2:2", [0, 0.5], rounds=[(2, 0.5, 0.5)]),
    Case("a third node joining a running 2:3 job is admitted at the next round", "2:3",
         [0, 0, 60], rounds=[(2, 30, 30), (3, 60, 61)], restarts={0: 1, 1: 1, 2: 0},
         members=[{0, 1}, {0, 1, 2}]),
    Case("a node beyond max waits as a spare: zero restarts; it exits gracefully at the end",
         "1:2", [0, 1.5, 3], [(200, "close", 0)], rounds=[(2, 1.5, 1.5)],
         errors={2: "RendezvousGracefulExitError"}, restarts={0: 0, 1: 0, 2: 0}),
    Case("a spare whose job ends before a wait's first slice passes still exits gracefully",
         "1:2", [0, 1.5, 3], [(3.2, "close", 0)], rounds=[(2, 1.5, 1.5)],
         errors={2: "RendezvousGracefulExitError"}, restarts={0: 0, 1: 0}),
    Case("spares that decide nothing (a waiter, a ticket beyond max) exit gracefully too",
         "2:3", [0, 0, 0, 3, 3.5, 4, 4.5], [(200, "close", 0)], rounds=[(3, 0, 0)],
         errors={i: "RendezvousGracefulExitError" for i in (3, 4, 5, 6)},
         restarts={0: 0, 1: 0, 2: 0}),
    Case("a node that comes after the job ended is told it is closed, as torch's is", "1:2",
         [0, 1.5, 300], [(200, "close", 0)], until=400, rounds=[(2, 1.5, 1.5)],
         errors={2: "RendezvousClosedError"}),
    Case("a spare takes a killed member's seat at once", "1:2", [0, 1.5, 3],
         [(100, "kill", 1)], rounds=[(2, 1.5, 1.5), (2, 100, 101)],
         members=[{0, 1}, {0, 2}]),
    Case("a spare takes a frozen member's seat within half the window", "1:2", [0, 1.5, 3],
         [(100, "freeze", 1)], rounds=[(2, 1.5, 1.5), (2, 100, 103.5)],
         members=[{0, 1}, {0, 2}]),
    Case("a SIGKILLed member: the survivors re-form at once, without a last call", "3:4",
         [0, 0, 0, 0], [(100, "kill", 2)], rounds=[(4, 0, 0), (3, 100, 101)],
         members=[{0, 1, 2, 3}, {0, 1, 3}]),
    Case("a frozen member is dropped within the 5 s window", "3:4", [0, 0, 0, 0],
         [(100, "freeze", 2)], rounds=[(4, 0, 0), (3, 103, 105.5)]),
    Case("a frozen member, torch's keep-alive (5 s x 3): within 15 s, not before 10 s",
         "3:4", [0, 0, 0, 0], [(100, "freeze", 2)], conf={"ka_interval": 5.0, "ka_max": 3},
         rounds=[(4, 0, 0), (3, 105, 116)]),
    Case("a cut link: silent at once, dropped within the window, long before TCP gives up",
         "3:4", [0, 0, 0, 0], [(100, "cut", 2)], rounds=[(4, 0, 0), (3, 103, 105.5)]),
    Case("reform_last_call=1 keeps torch's wait when a round re-forms", "3:4", [0, 0, 0, 0],
         [(100, "kill", 2)], conf={"reform_last_call": True},
         rounds=[(4, 0, 0), (3, 130, 131)]),
    Case("the coordinator dies during the last call: the round is abandoned and re-formed",
         "2:4", [0, 0, 0], [(10, "kill", 1)], rounds=[(2, 40, 41)], members=[{0, 2}]),
    Case("the coordinator freezes during the last call: abandoned within the window",
         "2:4", [0, 0, 0], [(10, "freeze", 1)], rounds=[(2, 43, 46)], members=[{0, 2}]),
    Case("a ticket without a record (a stray) is dropped after the window", "2:3",
         [0.1, 0.1], [(0, "stray", 0)], rounds=[(2, 5, 5.2)]),
    Case("the whole machine stalls 8 s (longer than the window): nobody is dropped", "3:3",
         [0, 0, 0], [(100, "stall", 0)], rounds=[(3, 0, 0)], restarts={0: 0, 1: 0, 2: 0}),
    Case("closed while a round forms: every node is told", "2:3", [0, 0],
         [(10, "close", CLOSER)],
         errors={0: "RendezvousClosedError", 1: "RendezvousClosedError"}),
    Case("too few nodes: the join timeout (600 s) ends it", "3:3", [0, 0], until=700,
         errors={0: "RendezvousTimeoutError", 1: "RendezvousTimeoutError"}),
    Case("a member that finished is no loss: the others are not restarted", "2:2", [0, 0],
         [(100, "done", 0)], rounds=[(2, 0, 0)], restarts={1: 0}),
    # after the rendezvous store's host was lost, on the successor (``Machine.moved``)
    Case("moved: every survivor of a world of 4 back, sealed at once (no last call)", "1:4",
         [0, 0, 0.5], moved=4, rounds=[(3, 0.5, 0.5)]),
    Case("moved: a majority (3 of 5) but one survivor missing: sealed after the last call",
         "1:5", [0, 0, 0], moved=5, rounds=[(3, 30, 30)]),
    Case("moved: a minority (2 of 4) never trains, whatever min_nodes allows", "1:4", [0, 0],
         moved=4, until=700,
         errors={0: "RendezvousTimeoutError", 1: "RendezvousTimeoutError"}),
    Case("moved: a new node's record cannot lower the majority the others carry", "1:4",
         [0, 0, 0], moved=4, fresh=[2], until=700,
         errors={i: "RendezvousTimeoutError" for i in range(3)}),
    Case("moved: a minority finds the rendezvous moved on (a higher epoch) and follows it",
         "1:4", [0, 0], [(100, "moved_on", 0)], moved=4, conf={"can_move": True},
         errors={0: "RendezvousConnectionError", 1: "RendezvousConnectionError"}),
    Case("moved: a late mover is a new node to the world formed here: admitted next round",
         "1:4", [0, 0, 0, 60], moved=4, conf={"can_move": True},
         rounds=[(3, 0, 30), (4, 60, 61)], members=[{0, 1, 2}, {0, 1, 2, 3}]),
    # the epoch is a commit: it rises with the first round on the successor that passes the
    # majority rule, in the publisher's multi_set (see test_the_epoch_rises_only_with_a_round)
    Case("moved: a majority of the world commits the epoch it proposed with its first round",
         "1:4", [0, 0, 0.5], moved=4, proposed=2, conf={"can_move": True},
         rounds=[(3, 0.5, 0.5)], epoch=2),
    Case("moved: a node that moved alone (a cut link) never commits its epoch", "1:4", [0],
         moved=4, proposed=1, conf={"can_move": True}, until=700,
         errors={0: "RendezvousTimeoutError"}, epoch=0),
    Case("moved: a fresh node publishing the movers' first round commits their epoch",
         "1:4", [0, 0, 0, 0], moved=4, proposed=1, fresh=[0], conf={"can_move": True},
         rounds=[(4, 0, 30)], epoch=1),
    Case("moved: a new job's round commits no epoch", "1:4", [0, 0, 0, 0],
         conf={"can_move": True}, rounds=[(4, 0, 0)], epoch=0),
    # where the last world formed, when the rendezvous can move (``_majority.away``)
    Case("split: the host's side alone (1 of 4, the 3 others cut) never trains alone", "1:4",
         [0, 0, 0, 0], [(100, "cut", i) for i in (1, 2, 3)], conf={"can_move": True},
         until=800, rounds=[(4, 0, 0)], errors={0: "RendezvousTimeoutError"}),
    Case("split at torch's keep-alive (5 s x 3): the host's side alone never trains alone",
         "1:4", [0, 0, 0, 0], [(100, "cut", i) for i in (1, 2, 3)],
         conf={"can_move": True, "ka_interval": 5.0, "ka_max": 3}, until=800,
         rounds=[(4, 0, 0)], errors={0: "RendezvousTimeoutError"}),
    Case("split, one endpoint (nothing can move): the host alone goes on, as torch's does",
         "1:4", [0, 0, 0, 0], [(100, "cut", i) for i in (1, 2, 3)], rounds=[(4, 0, 0),
                                                                            (1, 103, 106)]),
    Case("split: 2 of 4 cut are no majority elsewhere: the other 2 go on", "1:4",
         [0, 0, 0, 0], [(100, "cut", 2), (100, "cut", 3)], conf={"can_move": True},
         rounds=[(4, 0, 0), (2, 103, 106)], members=[{0, 1, 2, 3}, {0, 1}]),
    Case("split: a world of 2 losing 1: the other goes on (1 is no majority of 2)", "1:2",
         [0, 0], [(100, "cut", 1)], conf={"can_move": True}, rounds=[(2, 0, 0), (1, 103, 106)]),
    Case("split: 3 of 4 preempted (they quit): the last one goes on", "1:4", [0, 0, 0, 0],
         [(100, "quit", i) for i in (1, 2, 3)], conf={"can_move": True},
         rounds=[(4, 0, 0), (1, 100, 101)]),
    Case("split: 2 of 4 SIGTERMed while re-joining (left, then quit) are nowhere else: the "
         "survivor goes on", "1:4", [0, 0, 0, 0],
         [(100, "kill", 0), (110, "quit", 2), (110, "quit", 3)],
         conf={"can_move": True, "reform_last_call": True}, until=400,
         rounds=[(4, 0, 0), (1, 110, 145)], members=[{0, 1, 2, 3}, {1}]),
    Case("split: 3 of 4 closed (crashed, or moved while the host was frozen): no round; the "
         "host finds where they went", "1:4", [0, 0, 0, 0],
         [(100, "kill", i) for i in (1, 2, 3)] + [(100, "moved_on", 0)],
         conf={"can_move": True}, rounds=[(4, 0, 0)],
         errors={0: "RendezvousConnectionError"}),
    # a majority lost at once (a rack): proven gone where their connections closed, if every
    # other candidate refuses or has no mark of them ("proven"); else blocked (the default)
    Case("rack loss: 3 of 4 killed at once, proven gone: the host goes on, then a world of 4 "
         "with 3 replacements", "1:4", [0, 0, 0, 0, 110, 110, 110],
         [(100, "kill", i) for i in (1, 2, 3)] + [(0, "proven", 0)], conf={"can_move": True},
         rounds=[(4, 0, 0), (1, 100, 101), (4, 110, 111)],
         members=[{0, 1, 2, 3}, {0}, {0, 4, 5, 6}]),
    Case("rack loss, proof blocked (a candidate does not answer): nobody trains until the join "
         "timeout", "1:4", [0, 0, 0, 0, 110, 110, 110], [(100, "kill", i) for i in (1, 2, 3)],
         conf={"can_move": True}, until=800, rounds=[(4, 0, 0)],
         errors={i: "RendezvousTimeoutError" for i in (0, 4, 5, 6)}),
    Case("3 of 4 said they moved before their connections closed: no proof, no round",
         "1:4", [0, 0, 0, 0], [(100, "moves", i) for i in (1, 2, 3)] + [(0, "proven", 0)],
         conf={"can_move": True}, until=800, rounds=[(4, 0, 0)],
         errors={0: "RendezvousTimeoutError"}),
    Case("split: a spare beside a majority of the world away does not make it a majority",
         "1:4", [0, 0, 0, 0, 1], [(100, "cut", i) for i in (1, 2, 3)],
         conf={"can_move": True}, until=800, rounds=[(4, 0, 0)],
         errors={0: "RendezvousTimeoutError", 4: "RendezvousTimeoutError"}),
]


def _run(case: Case) -> Sim:
    lo, hi = (int(x) for x in case.nodes.split(":"))
    sim = Sim(lo, hi, **case.conf)
    nodes = [sim.start(t, node_rank=i, moved_from=0 if i in case.fresh else case.moved,
                       proposed=0 if i in case.fresh else case.proposed)
             for i, t in enumerate(case.starts)]
    closer = sim.start(10**9)  # never launched: only closes
    for t, action, i in case.script:
        node = closer if i == CLOSER else nodes[i]
        if action == "kill":
            sim.kill(t, node)
        elif action == "freeze":
            sim.freeze(t, node)
        elif action == "cut":
            sim.cut(t, node, closes_after=60)
        elif action == "stall":
            for n in nodes:
                sim.freeze(t, n, until=t + 8)
        elif action == "close":
            sim.close(t, node)
        elif action == "done":
            sim.at(t, lambda n=node: sim.call(n, n.m.mark_done()))
            sim.kill(t + 0.5, node)
        elif action == "quit":  # SIGTERM: the handler's leave(), then the process exits
            sim.at(t, lambda n=node: sim.quit(n))
            sim.kill(t + 0.1, node)
        elif action == "moved_on":
            sim.at(t, lambda: setattr(sim, "moved_on", True))
        elif action == "proven":
            sim.elsewhere = ""
        elif action == "moves":  # it says it moves, then closes its connection
            sim.at(t, lambda n=node: (sim._stop(n), sim.call(n, n.m.moving())))
            sim.kill(t + 0.1, node)
        elif action == "stray":
            sim.at(t, lambda: sim.data.__setitem__("fe.rdzv.sim/0/t", b"1"))
        else:
            raise AssertionError(action)
    sim.run(case.until)
    return sim


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_scenario(case):
    sim = _run(case)
    rounds = sim.rounds()
    assert [w for _, w, _ in rounds] == [w for w, _, _ in case.rounds], rounds
    for (_, world, when), (_, lo, hi) in zip(rounds, case.rounds, strict=True):
        assert lo <= when <= hi, f"a world of {world} formed at {when:.2f}s, not in [{lo}, {hi}]"
    errors = {n.id: type(n.error).__name__ for n in sim.nodes if n.error is not None}
    assert errors == case.errors
    if case.epoch is not None:
        assert int(sim.data.get("fe.rdzv.sim/epoch", b"0")) == case.epoch
    if case.restarts is not None:
        assert {i: sim.nodes[i].restarts for i in case.restarts} == case.restarts
    if case.members is not None:
        by_round: dict[int, set[int]] = {}
        for n in sim.nodes:
            for _, seat in n.seats:
                by_round.setdefault(seat.round, set()).add(n.id)
        assert [by_round[r] for r, _, _ in rounds] == case.members
        for r, world, _ in rounds:  # every member of a round has a unique rank
            ranks = sorted(s.rank for n in sim.nodes for _, s in n.seats if s.round == r)
            assert ranks == list(range(world))


def test_the_roles_take_their_paths():
    sim = Sim(2, 3)
    nodes = [sim.start(0) for _ in range(3)]
    sim.run(10)
    paths = {tuple(p) for n in nodes for p in n.paths}
    assert ("TICKET", "RECORD", "PUBLISH_GATE", "PUBLISH", "AWAIT", "SEAT", "MEMBER") in paths
    assert ("TICKET", "RECORD", "AWAIT", "SEAT", "MEMBER") in paths
    coord = [p for p in paths if "COORD_GATE" in p]
    assert coord and coord[0][:4] == ("TICKET", "RECORD", "COORD_GATE", "LAST_CALL")


def test_a_re_forming_coordinator_drains_and_seals_without_a_last_call():
    sim = Sim(2, 3)
    nodes = [sim.start(0) for _ in range(3)]
    sim.kill(50, nodes[2])
    sim.run(60)
    last = [n.paths[-1] for n in nodes[:2]]
    coord = [p for p in last if "COORD_GATE" in p]
    assert coord == [["TICKET", "RECORD", "COORD_GATE", "DRAIN", "LAST_CALL", "SEAL", "PUBLISH",
                      "AWAIT", "SEAT", "MEMBER"]]
    assert sim.rounds()[-1][1:] == (2, 50.0)  # sealed the moment both were back: no wait


def test_a_killed_member_is_reported_dead_with_its_address_and_pid():
    sim = Sim(2, 3)
    nodes = [sim.start(0) for _ in range(3)]
    sim.kill(50, nodes[1])
    sim.run(60)
    rank = [s for _, s in nodes[1].seats][0].rank
    assert nodes[0].lost_seen[0] == [(rank, "node 10.0.0.1 (pid 1001) dead: its connection "
                                            "closed")]


@pytest.mark.parametrize("n", [4, 64, 512])
def test_store_requests_per_node_are_constant_in_the_number_of_nodes(n):
    sim = Sim(n, n)
    for _ in range(n):
        sim.start(0)
    sim.run(5)
    assert sim.worlds() == [n]
    per_node = [node.join_requests[0] for node in sim.nodes[:n]]
    # a waiter: open, ticket, disconnect action, record, outcome, disconnect actions (its
    # seat is its ticket: nothing to read); a decider adds its gate and decision
    assert statistics.median(per_node) == 6, statistics.median(per_node)
    assert max(per_node) <= 12, max(per_node)


def test_when_ranks_follow_tickets_no_seat_is_written_or_read():
    sim = Sim(3, 3)
    for _ in range(3):
        sim.start(0)
    sim.run(5)
    assert {v for k, v in sim.data.items() if "/rank/" in k} == {b"-1"}  # placeholders only
    assert sorted(n.seats[0][1].rank for n in sim.nodes[:3]) == [0, 1, 2]
    res = sim.data["fe.rdzv.sim/0/res"]
    assert b"\n=\nw1." in res and res.endswith(b"\n"), res  # identity, then the world's id


def test_when_preferred_ranks_reorder_the_seats_every_node_reads_its_own():
    sim = Sim(3, 3)
    nodes = [sim.start(0, node_rank=2 - i) for i in range(3)]
    sim.run(5)
    assert [n.seats[0][1].rank for n in nodes] == [2, 1, 0]
    assert b"-1" not in {v for k, v in sim.data.items() if "/rank/" in k}
    assert not sim.data["fe.rdzv.sim/0/res"].endswith(b"\n=\n")
    for n in nodes:  # each watches the next ranks' keep-alive counters
        rank = n.seats[0][1].rank
        peers = {nodes[j].seats[0][1].rank for j in range(3) if j != n.id}
        assert {(rank + 1) % 3, (rank + 2) % 3} == peers


def test_gone_quit_or_done_wins_over_a_reason_that_says_the_node_may_be_elsewhere():
    from fastelastic.rendezvous.fast._schema import parse_gone

    raw = b"2:left;2:quit;3:closed;3:left;4:silent;4:done;5:quit;5:closed;6:done;6:quit;"
    assert parse_gone(raw) == {2: "quit", 3: "closed", 4: "done", 5: "quit", 6: "done"}


def test_a_close_after_any_reason_but_moved_makes_a_proof_candidate():
    """What the proof that lost members are gone starts from (``_majority.proof_candidates``):
    a connection that closed here, first reason or not, and no word of a move."""
    from fastelastic.rendezvous.fast._schema import closed_unmoved

    raw = (b"1:closed;2:left;2:closed;3:left;3:moved;3:closed;4:moved;4:closed;5:silent;"
           b"5:closed;6:left;7:quit;7:closed;x:closed;8:closedx;")
    assert closed_unmoved(raw) == {1, 2, 5, 7}
    # a member that died before it read its seat: known by its ticket (rank 4 moved: no)
    raw += b"t12:closed;t13:closed;t14:closed;"
    assert closed_unmoved(raw, {9: "12", 4: "13", 10: "15"}) == {1, 2, 5, 7, 9}


def test_the_epoch_rises_only_with_a_round():
    """The epoch is written by one request only: the multi_set that publishes the first round
    on the successor (its members' ``who`` entries), just before that round's outcome."""
    sim = Sim(1, 4, can_move=True)
    for i in range(3):
        sim.start(0, node_rank=i, moved_from=4, proposed=3)
    sim.run(60)
    assert sim.worlds() == [3]
    epoch_writes = [(t, keys) for t, _, keys in sim.writes if "fe.rdzv.sim/epoch" in keys]
    assert len(epoch_writes) == 1, epoch_writes
    assert any("/0/who/" in k for k in epoch_writes[0][1])
    assert sim.data["fe.rdzv.sim/epoch"] == b"3"


def test_the_epoch_stands_when_the_round_that_raised_it_is_abandoned_before_its_outcome():
    """The epoch rises after the majority rule passed and before the compare_set that decides
    the round. A joiner lost in between (its disconnect action abandons the round first) leaves
    the epoch raised with no world: the store is live (a majority of the moved world is there,
    as the rule found), and the next round passes the rule again before it forms."""
    sim = Sim(1, 4, can_move=True)
    for i in range(3):
        sim.start(0, node_rank=i, moved_from=4, proposed=3)
    apply, raced = sim._apply, []

    def abandon_first(node, op):  # a joiner's connection closes just before the outcome
        if isinstance(op, rq.CompareSet) and op.key.endswith("/0/res") and not raced:
            raced.append(sim.data.get("fe.rdzv.sim/epoch"))
            sim.data[op.key] = sc.ABANDONED
        return apply(node, op)
    sim._apply = abandon_first  # type: ignore[method-assign]
    sim.run(60)
    assert raced == [b"3"]  # raised before the outcome was decided
    assert sc.parse_outcome(sim.data["fe.rdzv.sim/0/res"]).kind is sc.OutcomeKind.ABANDONED
    assert sim.rounds()[0][:2] == (1, 3), sim.rounds()  # the next round: the same 3 movers
    assert sim.data["fe.rdzv.sim/epoch"] == b"3"


def test_a_blocked_proof_names_the_rule_and_the_way_out():
    sim = Sim(1, 4, can_move=True)
    nodes = [sim.start(0, node_rank=i) for i in range(4)]
    for i in (1, 2, 3):
        sim.kill(100, nodes[i])
    sim.run(800)
    err = str(nodes[0].error)
    assert "did not complete within 600 seconds: ranks [1, 2, 3] of round 0" in err, err
    assert "a candidate did not answer" in err and "majority rule" in err, err
    assert "restart the job with the nodes that are left" in err, err


def test_a_blocked_round_says_its_objection_once_as_an_error_with_the_way_out(caplog):
    """Every round of the 600 s join timeout fails the rule (a warning each), but the node
    says why, with the way out, once: soon after the loss, not only when the job ends."""
    sim = Sim(1, 4, can_move=True)
    nodes = [sim.start(0, node_rank=i) for i in range(4)]
    for i in (1, 2, 3):
        sim.kill(100, nodes[i])
    with caplog.at_level("WARNING", logger="fastelastic.rendezvous.fast_rendezvous.round"):
        sim.run(800)
    said = [r for r in caplog.records if "no round can form while" in r.getMessage()]
    per_round = [r for r in caplog.records if "abandoning the round" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "ERROR", [r.getMessage() for r in said]
    assert len(per_round) > 10, len(per_round)  # the rule failed round after round
    msg = said[0].getMessage()
    assert "ranks [1, 2, 3] of round 0" in msg and "majority rule" in msg, msg
    assert "restart the job with the nodes that are left" in msg, msg


def test_the_simulated_stores_reject_a_request_that_is_not_a_typed_op():
    from multisim import MultiSim

    def legacy():
        yield ("add", "k", 1)  # the tuples of before the typed requests

    for sim in (Sim(1, 1), MultiSim(1, 1, 2)):
        node = sim.start()
        with pytest.raises(TypeError, match=r"not a rendezvous store request: \('add'"):
            sim.call(node, legacy())


def test_outcome_kinds_are_an_enum_and_their_bytes_on_the_wire_are_those_of_before():
    from fastelastic.rendezvous.fast import _schema as sc

    # the bytes the strings "M"/"C"/"D" wrote (a store written by an older node reads the same)
    assert sc.encode_outcome(3, b"10.0.0.1:29500", True) == b"M3\n10.0.0.1:29500\n=\n"
    assert sc.encode_outcome(12, b"h:1", False) == b"M12\nh:1\n"
    assert (sc.ABANDONED, sc.NO_QUORUM, sc.CLOSED) == (b"D;", b"DQ;", b"C;")
    assert sc.encode_no_quorum("a\nb") == b"DQ;\na b\n"
    assert sc.BROKEN_CLOSED == b"C"
    K = sc.OutcomeKind
    cases = {
        b"M3\n10.0.0.1:29500\n=\n": (K.COMPLETE, 3, b"10.0.0.1:29500", True, False, ""),
        b"M12\nh:1\n": (K.COMPLETE, 12, b"h:1", False, False, ""),
        b"D;": (K.ABANDONED, 0, b"", False, False, ""),
        b"D;D;": (K.ABANDONED, 0, b"", False, False, ""),
        b"DQ;\nwhy\nD;": (K.ABANDONED, 0, b"", False, True, "why"),
        b"C;": (K.CLOSED, 0, b"", False, False, ""),
        b"D;C;": (K.CLOSED, 0, b"", False, False, ""),
    }
    for raw, want in cases.items():
        assert tuple(sc.parse_outcome(raw))[:6] == want, raw
    assert [k.value for k in sc.OutcomeKind] == [b"M", b"C", b"D"]
    with pytest.raises(RendezvousError, match="corrupt"):
        sc.parse_outcome(b"X;")


def test_the_other_values_the_machine_writes_have_their_bytes_and_parse_back():
    """Every value the machine and the etcd liveness link write is built in ``_schema``;
    these are their bytes on the wire (a server, a peer of another version and the traces
    read them)."""
    assert sc.encode_gone(3, "closed") == b"3:closed;"
    assert sc.parse_gone(sc.encode_gone(2, "left") + sc.encode_gone(2, "quit")) == {2: "quit"}
    assert sc.encode_who(4, b"-1|h|7|h:1|0") == b"4|-1|h|7|h:1|0"
    assert sc.who_parts(sc.encode_who(4, b"-1|h|7|h:1|0")) == ("4", "h", "7")
    assert (sc.encode_number(-1), sc.encode_number(12)) == (b"-1", b"12")
    assert (sc.tickets_taken(3), sc.tickets_taken(sc.SEAL + 3), sc.SEAL) == (3, 3, 1 << 40)
    assert (sc.PRESENT, sc.UNSEATED, sc.FIRST_BEAT) == (b"1", b"-1", b"0")
    assert (sc.LEFT_SILENT, sc.LEFT_HUNG) == (b"silent", b"hung")
    assert sc.parse_seat(sc.UNSEATED) == (-1, [])
    assert sc.encode_wstore("10.0.0.1", 29500) == b"10.0.0.1:29500"
    assert sc.parse_wstore(sc.encode_wstore("fe80::1", 7)) == ("fe80::1", 7)
    assert sc.broken_by_close(b"1" + sc.BROKEN_CLOSED) and not sc.broken_by_close(b"1")
    assert sc.parse_lease(sc.encode_lease(42)) == 42
    lost = sc.encode_lost_lease(5) + sc.encode_lost_lease(9) + sc.encode_lost_lease(5)
    assert lost == b"5;9;5;"
    assert sc.parse_lost_leases(lost) == {5, 9}
    with pytest.raises(ValueError):
        sc.parse_lost_leases(b"5;x;")


def test_a_successor_counts_only_carriers_of_the_newest_world():
    """Finding C's rule (``_majority.moved_short``): records name the world they carry; the
    first round on a successor needs a majority of the newest one (highest generation);
    carriers of an older world count as new nodes. Before, two carriers of different worlds
    (one of a world of 3, one of its successor, a world of 2) made "2, the largest quorum"."""
    from fastelastic.rendezvous.fast import _schema as sc
    from fastelastic.rendezvous.fast.failover._majority import moved_short

    def rec(quorum: int, wid: bytes) -> bytes:
        return sc.encode_record(-1, "10.0.0.1", 1, b"", quorum, -1, 1, wid)

    old, new = b"4.aa", b"5.bb"
    assert moved_short([rec(2, old), rec(2, new)]) == (1, 2)       # the two-cuts split
    assert moved_short([rec(2, old), rec(2, old)]) is None          # a majority of one world
    assert moved_short([rec(2, new), rec(2, new), rec(2, old)]) is None
    assert moved_short([rec(2, old), rec(2, old), rec(2, new)]) == (1, 2)  # older: new nodes
    assert moved_short([rec(0, b""), rec(0, b"")]) is None          # nobody carries a world
    assert sc.record_world(b"0|a|1|w|0|-1|0") == b""                # a 7-field record
    out = sc.parse_outcome(sc.encode_outcome(3, b"h:1", True, b"7.cafe") + b"C;")
    assert (out.kind, out.world, out.identity, out.wid) == (sc.OutcomeKind.COMPLETE, 3, True,
                                                            b"7.cafe")
    assert sc.parse_outcome(b"M3\nh:1\n").wid == b""               # an older publisher's
