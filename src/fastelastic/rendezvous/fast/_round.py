"""The fast rendezvous as a transport-free state machine.

A node's attempt at a round moves through the phases of :class:`Phase`; :func:`transition` is
the one rule saying which phase follows which event (both in :mod:`._phases`). Each phase's
work is a generator that yields typed store requests (``Add(key, 1)``, ...: :mod:`._requests`),
is sent their replies and reads an injected clock: :mod:`.fast_rendezvous` runs it on a store,
the tests on a simulated store and clock. Keys and what they hold: :mod:`._schema`.

Roles come from the ticket, so nobody races: ticket ``max_nodes`` publishes once the last
complete round is over; ticket ``min_nodes`` coordinates: waits until that round is over and
every member of it left (drain), waits ``last_call`` for more nodes in a new job's round (or
with ``reform_last_call``), seals the ticket counter and publishes; everyone else waits for the
outcome while watching that the deciders are alive.
"""

from __future__ import annotations

import logging
import math
import re
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

from fastelastic._waits import Slices
from fastelastic.errors import (
    RendezvousError,
    RendezvousTimeoutError,
)

from . import _schema as sc
from ._config import Config
from ._liveness import DeciderWatch, MemberWatch, SilenceDetector
from ._members import MemberOps
from ._phases import FINAL, E, Event, P, Phase, transition
from ._requests import (
    Add,
    Append,
    Beat,
    Check,
    CompareSet,
    Get,
    MovedElsewhere,
    MultiGet,
    MultiSet,
    OnDisconnect,
    RequestGen,
    Set,
    StopBeats,
    Wait,
)
from ._schema import Membership, OutcomeKind, Seat
from .failover import _majority

__all__ = ["Config", "Event", "Machine", "Phase", "Seat", "transition"]

# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.round")
MAX_SAID = 16  # distinct majority-rule objections a node logs as errors (_say_objection)

SLICE = 1.0  # seconds: how often a blocked decider re-checks whether the round was decided
MAX_WALK = 10_000  # bound on rounds walked forward/back
MAX_WATCHED = 8  # peers whose keep-alive counters a member reads per membership check
MAX_SPARE_WAITS = 1_000_000  # join timeouts a spare waits behind a running round (years)
# A node whose rounds fail the majority rule looks for its majority's world (MovedElsewhere)
# every min(last_call, LOOK_S) s, plus up to a quarter of that as jitter from its identity:
# one probe per other candidate each time (a refusal costs nothing, a silent one PROBE_S).
LOOK_S = 2.0


@dataclass
class _Attempt:
    """One node's attempt at round ``k.r``: what its phases found so far."""

    k: sc.RoundKeys
    deadline: float
    ticket: int = 0
    count: int = 0
    last: tuple[int, int] | None = None  # the last complete round: (round, world)
    res: sc.Outcome | None = None  # the round's outcome, once awaited
    seat: Seat | None = None


def _watched(world: int) -> int:
    """How many peers each member watches (the next ranks, round-robin)."""
    return min(world - 1, MAX_WATCHED)


class Machine(MemberOps):
    """One node's side of the protocol: its state between rounds and the generators of each
    operation (``join`` here; ``lost_members``, ``set_closed``, ... in :mod:`._members`)."""

    def __init__(self, cfg: Config, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.clock = clock
        self.keys = sc.RunKeys(cfg.run_id)
        self.member: Membership | None = None  # of the last round it joined here
        self.watch: MemberWatch | None = None
        self.prev_watch: MemberWatch | None = None  # the last round's, for the drain
        self.last_seen: tuple[int, int] | None = None  # see _last_complete
        self.last_gen = 0  # the generation of last_seen's world (sc.world_gen)
        self.waited_as_spare = False  # this node waited behind a full, running round
        self.leaving = False  # tell the last round it left, once the new ticket is counted
        self.spare_ready = False  # a node waits behind this node's full round
        self.path: list[Phase] = []  # the phases of the last attempt, for reports and tests
        self.carried = 0  # the world this node had before the rendezvous moved (see moved)
        self.proposed = 0  # the epoch this node proposes here after a move (see moved)
        self.no_quorum = False  # a round here failed the majority rule: no early seal now
        self.objected = ""  # why the last round this node waited for failed that rule
        self._said: set[str] = set()  # the objections logged as errors (see _say_objection)
        self.home: Membership | None = None  # its world before it moved (returned)
        self.world_id = b""  # of the world it is a member of, or carries (_majority)
        self._phases: dict[Phase, Callable[[_Attempt], RequestGen[Event]]] = {
            P.TICKET: self._ticket, P.RECORD: self._record, P.PUBLISH_GATE: self._full_gate,
            P.COORD_GATE: self._gate, P.DRAIN: self._drain, P.LAST_CALL: self._last_call,
            P.SEAL: self._seal, P.PUBLISH: self._publish, P.AWAIT: self._await,
            P.SEAT: self._seat,
        }
        self._identity = (-1, "", 0, b"", "")

    def moved(self, proposed: int = 0,
              member: Membership | None = None) -> None:
        """The rendezvous moved to a successor store (its host was lost): rounds start over
        there, and this node carries its world. The first round there needs a majority of it
        (:mod:`.failover._majority`), is sealed once all of it but the lost host is back, and
        commits ``proposed`` as the store's epoch (``_publish``). ``member``: its membership
        on the lost store, when not the last round it joined through this machine."""
        if member is not None:
            self.member = member
        if self.member is not None:
            self.carried = self.member[2]
            self._identity = (self.member[1], *self._identity[1:])
            self.home = self.member
        self.proposed = max(self.proposed, proposed)
        self.member = self.watch = self.prev_watch = self.last_seen = None
        self.leaving = self.spare_ready = False

    def back(self) -> None:
        """A mover went back to the store it left, where its world went on without it: it
        joins there as a new node (no world carried, no epoch proposed)."""
        self.moved()
        self.carried = self.proposed = 0
        self.no_quorum, self.home, self.world_id = False, None, b""

    def returned(self) -> bool:
        """A mover came back to the store where its world formed (that store is live again,
        with the highest epoch): it is a member of that world there again, so the round
        after it counts it back (``_majority.away``), instead of a new node whose world "may
        be alive elsewhere". False when it has no such world (it stays a mover)."""
        if self.home is None:
            return False
        self.member, self.home = self.home, None
        self.carried = self.proposed = 0
        self.no_quorum, self.objected = False, ""
        self.watch = self.prev_watch = self.last_seen = None  # the successor's, not this store's
        return True

    @property
    def quorum(self) -> int:
        """The fewest members this node accepts in a round: a majority of its moved world."""
        return self.carried // 2 + 1 if self.carried else 0

    # ------------------------------------------------------------------ joining

    def join(self, node_rank: int, addr: str, pid: int, wstore: bytes,
             node: str) -> RequestGen[Seat]:
        """Joins the next round this node can be a member of; its :class:`Seat`. ``node``:
        this node's identity (:func:`._schema.node_id`, as its marks name it), which the
        majority rules count by; ``addr`` and ``pid`` only inform.

        Raises:
            RendezvousClosedError / RendezvousGracefulExitError: closed (the latter for a
                node that waited as a spare).
            RendezvousTimeoutError: the join timeout passed first.
        """
        deadline = self.clock() + self.cfg.join
        yield StopBeats()
        self.waited_as_spare = self.spare_ready = False
        self.prev_watch, self.watch = self.watch, None
        if self.carried:  # moved: keep the rank it had
            node_rank = self._identity[0]
        self._identity = (node_rank, addr, pid, wstore, node)
        # No ``closed`` check (a round trip): ``set_closed`` marks C in every round a node can
        # join next, so a node joining a closed rendezvous learns it from the round's outcome.
        if self.member is not None:
            r = self.member.round + 1
            self.leaving = True
        else:
            r = int((yield Add(self.keys.open, 0)))
        for _ in range(MAX_WALK):
            if self.clock() > deadline:
                break
            a = _Attempt(self.keys.round(r), deadline)
            seat = yield from self._attempt(a)
            deadline = a.deadline  # a spare's join timeout starts when its round is over
            if seat is not None:
                assert a.res is not None  # a seat comes with the round's outcome
                self.member = Membership(r, seat.rank, seat.world)
                self.carried = self.proposed = 0
                self.home, self.world_id = None, a.res.wid
                self.no_quorum, self.objected = False, ""
                k = a.k
                if self.cfg.hooks:  # our death: we left, the round is over, and why
                    yield OnDisconnect([k.left(seat.rank), k.broken, k.gone],
                                       [sc.PRESENT, sc.PRESENT,
                                        sc.encode_gone(seat.rank, "closed")])
                self.watch = MemberWatch(k, seat.rank, seat.world, seat.peers,
                                         self.cfg.window, self.cfg.ka_interval / 2)
                return seat
            r += 1
        raise self.timeout_error()

    def timeout_error(self) -> RendezvousTimeoutError:
        """The join timeout passed; when rounds failed the majority rule, it says why and
        what to do (instead of a bare "did not complete")."""
        cfg = self.cfg
        text = f"The rendezvous '{cfg.run_id}' did not complete within {cfg.join:g} seconds"
        if self.objected:
            return RendezvousTimeoutError(f"{text}: {self.objected}. {_majority.WAY_OUT}")
        return RendezvousTimeoutError(text + ".")

    def _attempt(self, a: _Attempt) -> RequestGen[Seat | None]:
        phase = P.TICKET
        self.path = []
        for _ in range(len(Phase)):  # each phase runs at most once per attempt
            self.path.append(phase)
            if phase in FINAL:
                break
            event = yield from self._phases[phase](a)
            phase = transition(phase, event)
        else:
            raise RendezvousError(f"no final phase after {self.path}")
        if phase is P.CLOSED:
            raise self.closed_error()
        if phase is P.MEMBER:
            return a.seat
        return None

    def _ticket(self, a: _Attempt) -> RequestGen[Event]:
        a.ticket = int((yield Add(a.k.tickets, 1)))
        # Only now that our ticket is counted: a coordinator that sees every member of the
        # last round back seals at once, and must not seal before our ticket.
        yield from self.leave()
        return E.FULL if a.ticket > self.cfg.max_nodes else E.TICKET

    def _record(self, a: _Attempt) -> RequestGen[Event]:
        k, t, cfg = a.k, a.ticket, self.cfg
        if cfg.hooks:  # our death abandons the round while it forms, and says we are gone
            yield OnDisconnect([k.outcome, k.gone], [sc.ABANDONED, sc.ticket_closed(t)])
        node_rank, addr, pid, wstore, node = self._identity
        member_of, pref = (-1, node_rank) if self.member is None else (
            self.member.round, self.member.rank)
        # The record; a placeholder for our seat, which the publisher overwrites before it
        # decides res; and the keep-alive counter, bumped from the ticket on.
        rec = sc.encode_record(pref, addr, pid, wstore, self.quorum, member_of, self.proposed,
                               self.world_id, node)
        yield MultiSet([k.record(t), k.seat(t), k.beat(t)], [rec, sc.UNSEATED, sc.FIRST_BEAT])
        yield Beat(k.beat(t))
        if t == cfg.max_nodes:
            a.count = t
            return E.PUBLISHER
        if t == cfg.min_nodes:
            return E.COORDINATOR
        yield from self._note_spare(a.k.r)
        return E.WAITER

    def _full_gate(self, a: _Attempt) -> RequestGen[Event]:
        # A full round has no room for the last round's members still coming, so it waits
        # for nobody once that round is over.
        return E.OVER if (yield from self._after_last_round(a)) else E.DECIDED

    def _gate(self, a: _Attempt) -> RequestGen[Event]:
        if not (yield from self._after_last_round(a)):
            return E.DECIDED
        return E.FIRST if a.last is None else E.OVER

    def _last_call(self, a: _Attempt) -> RequestGen[Event]:
        # A round that re-forms after a complete one needs no last call: every member of
        # that round is back (or lost), and a node that comes later joins the next round.
        wait = min(self.cfg.last_call, a.deadline - self.clock())
        if a.last is None and self.carried and not (self.cfg.reform_last_call or self.no_quorum):
            # the first round on a successor: everyone of the last world but its lost host
            if wait >= 0.001:
                yield Wait([a.k.record(max(1, self.carried - 1))], wait)
            return E.DECIDED if (yield Check([a.k.outcome])) else E.CALL_OVER
        if a.last is None or self.cfg.reform_last_call or self.no_quorum:
            if wait >= 0.001 and (yield from self._wait_looking([a.k.outcome], wait)):
                return E.DECIDED  # max reached, closed or abandoned meanwhile
        return E.CALL_OVER

    def _seal(self, a: _Attempt) -> RequestGen[Event]:
        a.count = sc.tickets_taken(int((yield Add(a.k.tickets, sc.SEAL))))
        return E.SEALED if a.count < self.cfg.max_nodes else E.FULL

    def _await(self, a: _Attempt) -> RequestGen[Event]:
        a.res, a.deadline = yield from self._wait_outcome(a.k, a.deadline, mine=True,
                                                          ticket=a.ticket)
        kind = a.res.kind
        if kind is OutcomeKind.ABANDONED:
            self.no_quorum |= a.res.no_quorum
            if a.res.no_quorum:  # not before the last call: a full round would spin
                self.objected = a.res.why or self.objected
                self._say_objection(a.res.why)
                if self.cfg.can_move:  # did the majority move (on)? (raises if so)
                    yield MovedElsewhere()
                yield from self._wait_looking(
                    [self.keys.round(a.k.r + 1).outcome],
                    max(0.001, min(self.cfg.last_call, a.deadline - self.clock())))
            log.info("rendezvous %s round %d abandoned; re-joining", self.cfg.run_id, a.k.r)
            return E.ABANDONED
        return E.COMPLETE if kind is OutcomeKind.COMPLETE else E.CLOSED

    def _look_every(self) -> float:
        """Seconds between two looks for the majority's world (see ``LOOK_S``); inf when this
        node has no round that failed the majority rule, or nowhere else to look."""
        if not (self.no_quorum and self.cfg.can_move):
            return math.inf
        base = min(self.cfg.last_call, LOOK_S)
        jitter = zlib.crc32(self._identity[4].encode()) % 1024 / 4096  # [0, 0.25)
        return max(0.001, base * (1 + jitter))

    def _wait_looking(self, keys: list[str], wait: float) -> RequestGen[bool]:
        """``Wait(keys, wait)``; a node whose rounds fail the majority rule looks for its
        majority's world between pieces of at most ``_look_every`` s (``MovedElsewhere``
        raises when it moved on, or its store answers again), so it follows that world
        within a look of a heal whatever the last call. The look only reads: what it finds
        is decided by the failover's rules (:mod:`.failover._hops`), as in ``_await``."""
        every = self._look_every()
        end = self.clock() + wait
        for _ in range(MAX_WALK):
            step = min(every, end - self.clock())
            if step < 0.001:
                return False
            if (yield Wait(keys, step)):
                return True
            if math.isfinite(every) and end - self.clock() >= 0.001:
                yield MovedElsewhere()
        return False

    def _say_objection(self, why: str) -> None:
        """Logs, once per kind, why rounds fail the majority rule and the way out: the
        publisher's warning comes every round (a spam an operator learns to skip), and the
        join timeout's error comes only when it ends the job, up to 600 s later. A kind is
        the text without its parenthesised details (each candidate's answer, which vary from
        round to round) and numbers; at most ``MAX_SAID`` kinds are said per node."""
        kind = why
        for _ in range(8):  # nested parentheses, innermost first
            kind, n = re.subn(r"\([^()]*\)", "", kind)
            if not n:
                break
        kind = re.sub(r"\d+", "#", kind)
        if not why or kind in self._said or len(self._said) >= MAX_SAID:
            return
        self._said.add(kind)
        log.error("rendezvous %s: no round can form while %s. %s", self.cfg.run_id, why,
                  _majority.WAY_OUT)

    def _seat(self, a: _Attempt) -> RequestGen[Event]:
        res = a.res
        assert res is not None  # _await set it
        world = res.world
        if res.identity:  # the fast path: no request
            rank = a.ticket - 1 if a.ticket <= world else -1
            peers = [sc.encode_number((rank + i) % world + 1)
                     for i in range(1, _watched(world) + 1)]
        else:
            rank, peers = sc.parse_seat(bytes((yield Get(a.k.seat(a.ticket), None))))
        if rank < 0:  # not admitted (round full, or our record came too late)
            return E.NOT_ADMITTED
        a.seat = Seat(a.k.r, rank, world, peers, res.wstore)
        return E.ADMITTED

    # ------------------------------------------------------------------ deciding

    def _wait_outcome(self, k: sc.RoundKeys, deadline: float, mine: bool = True,
                      ticket: int = 0) -> RequestGen[tuple[sc.Outcome, float]]:
        """Round ``k.r``'s outcome, and the deadline kept.

        A node holding ``ticket`` checks every quarter window that the holders of the deciding
        tickets are alive, and abandons the round when one is not. A spare's join timeout
        starts only when the full round it waits behind is over.
        """
        cfg = self.cfg
        watch = DeciderWatch(cfg, self.clock, k, ticket) if ticket else None
        slices = Slices(deadline, math.inf if watch is None else cfg.window / 4,
                        clock=self.clock, floor=0.001)
        for _ in range(MAX_SPARE_WAITS):  # a spare's join timeout starts over while it is one
            for step in slices:
                raw = yield Get(k.outcome, step)  # one round trip either way
                if raw is not None:
                    return sc.parse_outcome(bytes(raw)), slices.deadline
                if watch is not None and (yield from watch.stalled()):
                    yield CompareSet(k.outcome, "", sc.ABANDONED)
            if not (mine and (yield from self._spare(k.r))):
                break
            self.waited_as_spare = True
            slices.deadline = self.clock() + cfg.join
        if mine:  # give up our ticket: nobody may count this node in any more
            yield Append(k.outcome, sc.ABANDONED)
        raise self.timeout_error()

    def _spare(self, r: int) -> RequestGen[bool]:
        """True while the last round before ``r`` is complete, full and not over: a node
        waiting for ``r`` is then a spare (torch's redundancy list), whom no join timeout
        applies to."""
        last = yield from self._last_complete(r, self.clock() + SLICE)
        if last is None or last[1] < self.cfg.max_nodes:
            return False
        return not (yield Check([self.keys.round(last[0]).broken]))

    def _last_complete(self, r: int,
                       deadline: float | None) -> RequestGen[tuple[int, int] | None]:
        """Walks back from ``r - 1`` to the last complete round: (round, world). Waits for
        each round's outcome until ``deadline``; with None, waits for none and walks past a
        round still forming."""
        cached = self.last_seen
        if cached is not None and r - 1 <= cached[0] < r:
            return cached
        for q in range(r - 1, max(-1, r - 1 - MAX_WALK), -1):
            k = self.keys.round(q)
            if deadline is None:
                raw = yield Get(k.outcome, 0.001)
                if raw is None:
                    continue
                res = sc.parse_outcome(bytes(raw))
            else:
                res, _ = yield from self._wait_outcome(k, deadline, mine=False)
            if res.kind is OutcomeKind.COMPLETE:
                self.last_seen, self.last_gen = (q, res.world), sc.world_gen(res.wid)
                return self.last_seen
            if res.kind is OutcomeKind.CLOSED:
                raise self.closed_error()
        return None

    def _note_spare(self, r: int) -> RequestGen[None]:
        """Marks a new node a spare (torch's redundancy list) when the last complete round
        before ``r`` is full and still running: decided as it starts waiting, without waiting
        (the job may end before a wait's first slice passes, and it is a spare all the same).
        A member of the last round that joins again is no spare."""
        if self.member is not None or self.waited_as_spare:
            return
        last = yield from self._last_complete(r, None)
        if last is not None and last[1] >= self.cfg.max_nodes:
            self.waited_as_spare = not (yield Check([self.keys.round(last[0]).broken]))

    def _after_last_round(self, a: _Attempt) -> RequestGen[bool]:
        """Before a decider decides: waits until the last complete round is over.

        While it runs, everyone waiting for this round is a spare, and a round of spares must
        not form beside it (two worlds); it is over once a member of it left or was lost
        (``broken``). Sets ``a.last`` (None if there is none) and the deadline to keep; False
        if the round got decided meanwhile. A spare's join timeout counts from the moment the
        round it waited behind is over.
        """
        yield from self._note_spare(a.k.r)
        a.last = yield from self._last_complete(a.k.r, a.deadline)
        if a.last is None:
            return True
        lk = self.keys.round(a.last[0])
        waited = False
        for step in Slices(math.inf, SLICE, clock=self.clock, passes=MAX_WALK * 1000):
            why = yield Get(lk.broken, step)  # wait, and read why (C: closed)
            if why is not None:
                break
            waited = self.waited_as_spare = True
            if (yield Check([a.k.outcome])):
                return False
        else:
            raise RendezvousTimeoutError("waited too long behind a running round")
        if waited:
            # The job ended (closed, or a member finished its work): spares go home before
            # the job's store does.
            gone = sc.parse_gone(bytes((yield Get(lk.gone, None))))
            if sc.broken_by_close(bytes(why)) or "done" in gone.values():
                raise self.closed_error()
            a.deadline = self.clock() + self.cfg.join
        return True

    def _drain(self, a: _Attempt) -> RequestGen[Event]:
        """Waits until every member of the last complete round left.

        A member whose keep-alive counter stands still for the detection window is dropped
        (frozen, hung or cut off); when this node watched it during that round, the window
        counts from the last change it saw then. Each check is one ``multi_get`` (the round's
        ``gone`` and the missing members' counters), whatever the number of members.
        """
        assert a.last is not None
        cfg, (q, world) = self.cfg, a.last
        lk = self.keys.round(q)
        missing = list(range(world))
        beats = SilenceDetector(cfg.window, cfg.ka_interval / 2)
        prev = self.prev_watch
        if prev is not None and prev.k.p == lk.p:
            beats.since.update(prev.beats.since)
        every = max(0.05, min(cfg.window / 4, cfg.ka_interval / 2))
        tickets: list[str] | None = None
        for step in Slices(a.deadline, every, clock=self.clock):
            if (yield Wait([lk.left(i) for i in missing], step)):
                break
            if (yield Check([a.k.outcome])):
                return E.DECIDED
            if tickets is None:  # once: the members' tickets, for their keep-alive counters
                who = yield MultiGet([lk.who(i) for i in range(world)])
                tickets = [sc.who_parts(bytes(v))[0] for v in who]
            vals = [bytes(v) for v in (yield MultiGet(
                [lk.gone] + [lk.beat(tickets[i]) for i in missing]))]
            gone = sc.parse_gone(vals[0])
            counters = {i: v for i, v in zip(missing, vals[1:], strict=True) if i not in gone}
            for rank, still in beats.observe(counters, self.clock()).items():
                log.warning("rendezvous %s: member rank %d of round %d was lost (silent: no "
                            "keep-alive for %.1fs); dropping it", cfg.run_id, rank, q, still)
                yield MultiSet([lk.left(rank), lk.broken], [sc.LEFT_HUNG, sc.PRESENT])
                gone[rank] = "silent"
            missing = [i for i in missing if i not in gone]
            if not missing:
                break
        else:
            return E.DECIDED  # the wait for the outcome reports the timeout
        return E.DRAINED

    def _publish(self, a: _Attempt) -> RequestGen[Event]:
        """Decides the round with ``a.count`` tickets: ranks, seats, then one compare_set."""
        k, cfg = a.k, self.cfg
        tickets = list(range(1, a.count + 1))
        drop_at = min(a.deadline, self.clock() + cfg.window)
        for step in Slices(drop_at, SLICE, clock=self.clock):
            if (yield Wait([k.record(i) for i in tickets], step)):
                break
            if (yield Check([k.outcome])):  # a joiner died before writing its record
                return E.DONE
        else:  # tickets without a record: lost after their add, or strays
            have = []
            for i in tickets:
                if (yield Check([k.record(i)])):
                    have.append(i)
            log.warning("rendezvous %s round %d: dropping tickets %s (no record within "
                        "%gs)", cfg.run_id, k.r, sorted(set(tickets) - set(have)),
                        cfg.window)
            tickets = have
        records = [bytes(v) for v in (yield MultiGet([k.record(i) for i in tickets]))]
        last_gen = self.last_gen if a.last is not None else 0
        why = yield from _majority.objection(records, a.last, cfg.can_move, self.keys, last_gen)
        if why or len(tickets) < cfg.min_nodes:
            log.warning("rendezvous %s round %d: %d nodes (%s); abandoning the round",
                        cfg.run_id, k.r, len(tickets), why or f"min_nodes is {cfg.min_nodes}")
            yield CompareSet(k.outcome, "",
                             sc.encode_no_quorum(why) if why else sc.ABANDONED)
            return E.DONE
        world = len(tickets)
        ranks = sc.assign_ranks([sc.record_pref(raw) for raw in records], world)
        by_rank = [0] * world
        for ticket, rank in zip(tickets, ranks, strict=True):
            by_rank[rank] = ticket
        # O(1) for each node to read: its seat (rank and the tickets of the peers it watches;
        # none when every rank is the ticket minus one) and, by rank, each member's ticket and
        # record (for reports and the next drain).
        identity = by_rank == list(range(1, world + 1))
        record_of = dict(zip(tickets, records, strict=True))
        keys, vals = [k.gone], [b""]
        epoch = max(map(sc.record_epoch, records), default=0)
        if epoch and a.last is not None:  # movers back on a store with history: commit too
            epoch = epoch if epoch > int((yield Add(self.keys.epoch, 0))) else 0
        # The move commits with the members of the first round that passed the majority rule,
        # before its outcome: abandoned in between, the epoch stands with no world (harmless:
        # the rule found a majority here, and every later round passes the rule too).
        if epoch:
            keys.append(self.keys.epoch)
            vals.append(sc.encode_number(epoch))
        for rank, ticket in enumerate(by_rank):
            keys.append(k.who(rank))
            vals.append(sc.encode_who(ticket, record_of[ticket]))
            if not identity:
                keys.append(k.seat(ticket))
                vals.append(sc.encode_seat(rank, [by_rank[(rank + i) % world]
                                                  for i in range(1, _watched(world) + 1)]))
        yield MultiSet(keys, vals)
        gen = 1 + max(last_gen, *(sc.world_gen(sc.record_world(raw)) for raw in records))
        wid = sc.world_id(gen, self._identity[4], k.p, self.clock())
        blob = sc.encode_outcome(world, sc.record_wstore(record_of[by_rank[0]]), identity, wid)
        if bytes((yield CompareSet(k.outcome, "", blob))) == blob:
            yield Set(self.keys.open, sc.encode_number(k.r + 1))
        return E.DONE
