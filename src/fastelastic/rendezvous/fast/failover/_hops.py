"""The failover between the ``--rdzv-endpoint`` candidates as typed operations: where a
node's rendezvous is (:class:`LiveStore`) and every way that changes, each a generator of typed
requests, as the round machine's operations are (:mod:`._round`).

- A join fails over as :func:`after` says, until a round forms (:func:`join_anywhere`).
- A start finds the live store (:func:`connect`; the rest of a start is in :mod:`._start`).
- A member that lost the live store moves to the next candidate and leaves a provisional mark
  there (:func:`move`); the epoch rises only with the first round there that passes the
  majority rule (``_round.Machine._publish``).
- A node that carries no world never moves the rendezvous: it follows a committed move, or
  waits for its store (:func:`follow`, :data:`NO_WORLD_RULE`).
- A mover whose round failed the majority rule checks where its world is (:func:`check`):
  it goes back to the store it left (:func:`go_back`), or regroups on an earlier candidate
  (:func:`regroup`).
- A mover fenced by its world's proof drops that world and follows (:func:`drop_world`).
- The proof that lost members are nowhere else (:func:`prove_gone`), and a mover's mark with
  its fence check (:func:`mark`).

The policy alone: it reads an injected clock and does no I/O. :class:`._failover.Candidates`
runs these operations on real stores (``run``), the tests' simulation (``multisim``) on
simulated stores with dead, frozen and cut hosts: the same code. Besides the machine's store
requests (:mod:`._requests`, on the node's current store), they yield the requests below; a
request that fails as a connection error is thrown back into the operation as
:class:`RendezvousConnectionError`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from fastelastic.errors import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreTimeoutError,
)

from .._requests import Request, Set, StopBeats
from .._schema import (
    RunKeys,
    copied_entries,
    counts,
    encode_fence,
    encode_mark,
    encode_number,
    encode_withdrawal,
    fenced,
    incarnation,
    marked_before_fence,
    new_incarnation,
    new_proof_name,
)

if TYPE_CHECKING:
    from .._round import Machine

# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.failover")

T = TypeVar("T")
RETRY_S = 0.2  # seconds between the probes of a node waiting for a candidate
SYNC_RETRY_S = 0.5  # seconds between a standby's attempts to copy the others' lists
MAX_HOPS = 64  # moves and returns of one join (:func:`join_anywhere`)


def prover_quorum(n: int) -> int:
    """How many of ``n`` candidates a proof's fences must be read back from: a majority."""
    return n // 2 + 1


def mover_quorum(n: int) -> int:
    """How many of ``n`` candidates a mover's mark must be read back from: the fewest that
    meet every set of :func:`prover_quorum` candidates (the two add up to more than ``n``)."""
    return n - prover_quorum(n) + 1


QUORUM_RULE = (
    "with several --rdzv-endpoint candidates, a mover carries its world only once its mark is "
    "read back from {m} of the {n} candidates, and members are proven gone only once the "
    "proof's fences are read back from {f} of them; a candidate that refuses the connection "
    "or does not answer counts as no answer, so no failure domain may hold half the "
    "candidates")


@dataclass(frozen=True)
class LiveStore:
    """Where a node's rendezvous is: the live candidate and its committed epoch; after a move
    not yet committed, the epoch this node proposes there and the (candidate, round) it left;
    whether this node was a member of a round there (only then may it close that store)."""

    index: int = -1
    epoch: int = 0
    proposed: int = 0
    left: tuple[int, int] | None = None
    formed: bool = False

    def member(self) -> LiveStore:
        """This node is a member of a round here: any move it proposed was committed."""
        return LiveStore(self.index, max(self.epoch, self.proposed), 0, None, True)


class GoBack(RendezvousConnectionError):
    """The store a mover left answers again: its world went on there without it (it re-joins
    as a new node), or formed no round there since (``rejoin``: it is a member there again)."""

    def __init__(self, message: str, rejoin: bool = False) -> None:
        super().__init__(message)
        self.rejoin = rejoin


class Regroup(RendezvousConnectionError):
    """A mover whose round failed the majority rule, its world's store not answering, moves
    to a candidate earlier in the list (``index``): the movers of a world meet there."""

    def __init__(self, message: str, index: int) -> None:
        super().__init__(message)
        self.index = index


class Fenced(RendezvousConnectionError):
    """A mover's mark on a candidate came after a fence of it from its world: where that
    world formed it was proven gone, so it must not carry that world there (``_majority``).
    It drops that world and, as a node with no world, follows (``NO_WORLD_RULE``)."""


NO_WORLD_RULE = (
    "a node that belongs to no world (starting, or cut from the store during its first "
    "join) does not move the rendezvous: it cannot know whether a world formed there with it "
    "or without it, and a world it formed elsewhere could train beside that one. It follows "
    "only a committed move (a candidate with a higher epoch), or waits for the store it was "
    "on. Bring that store (or its link) back, or restart the job.")


# ---------------------------------------------------------------------- the requests


@dataclass(frozen=True, slots=True)
class Probe:
    """Connects to candidate ``index`` (within ``_failover.PROBE_S``) and reads the counter
    ``key``. Reply: its value (int), or why the candidate did not answer (str). The
    connection stays open for :class:`Adopt` until the next probe of that candidate or the
    operation's end."""

    name: ClassVar[str] = "probe"
    index: int
    key: str
    quick: bool = False  # a start's look before it hosts: a silent host gets ``PRE_PROBE_S``


@dataclass(frozen=True, slots=True)
class MovingList:
    """Appends ``entry`` (if any: a mark, fences or withdrawals) to candidate ``index``'s
    ``moving`` list, then reads the list, on a connection of its own, within ``PROBE_S``
    each. Reply: the list (bytes), None when the connection is refused, or why it did not
    answer (str); the failover's quorums count the last two alike, as no answer."""

    name: ClassVar[str] = "marks"
    index: int
    entry: bytes


@dataclass(frozen=True, slots=True)
class Pause:
    """Reply: None, ``seconds`` later."""

    name: ClassVar[str] = "pause"
    seconds: float


@dataclass(frozen=True, slots=True)
class Adopt:
    """The connection the last probe of candidate ``live.index`` opened is the node's store
    from now on, and ``live`` where its rendezvous is; its previous connection closes (its
    disconnect actions run there). Reply: None."""

    name: ClassVar[str] = "adopt"
    live: LiveStore


@dataclass(frozen=True, slots=True)
class CloseStore:
    """The node closes its store connection (its next request there fails) and its
    rendezvous is at ``live`` from now on. Reply: None."""

    name: ClassVar[str] = "close_store"
    live: LiveStore


@dataclass(frozen=True, slots=True)
class Count:
    """Reads the counter ``key`` on the connection the last probe of candidate ``index``
    opened. Reply: its value (int), or None when that probe got no connection or the read
    failed."""

    name: ClassVar[str] = "count"
    index: int
    key: str


@dataclass(frozen=True, slots=True)
class ReadMoving:
    """Reads the ``moving`` list on the connection the last probe of candidate ``index``
    opened. Reply: the list (bytes, empty when unset), or None as :class:`Count`."""

    name: ClassVar[str] = "read_moving"
    index: int


@dataclass(frozen=True, slots=True)
class HostStandby:
    """Hosts this node's standby store on the first of the candidates ``mine`` (its own) that
    no other process hosts. Reply: that candidate's index, or -1."""

    name: ClassVar[str] = "host_standby"
    mine: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AppendStandby:
    """Appends ``entry`` to the standby's ``moving`` list (its host's own entries and what it
    copied from the others). Reply: None."""

    name: ClassVar[str] = "append_standby"
    entry: bytes


@dataclass(frozen=True, slots=True)
class OnStandby:
    """The store request ``request`` on the standby, ``what`` it does as a warning names it
    when it fails (it is only logged). Reply: its reply, or None."""

    name: ClassVar[str] = "on_standby"
    request: Request
    what: str


@dataclass(frozen=True, slots=True)
class JoinRound:
    """The node joins a round on its store (the machine's ``join``, run by its host). Reply:
    the host's answer (its seat); a connection error or a store timeout is thrown in as it
    is."""

    name: ClassVar[str] = "join_round"


@dataclass(frozen=True, slots=True)
class Where:
    """Reply: where the node's rendezvous is (:class:`LiveStore`); None when its store is no longer
    the one its last :class:`JoinRound` used (another of its threads moved meanwhile)."""

    name: ClassVar[str] = "where"


@dataclass(frozen=True, slots=True)
class Settle:
    """The node's rendezvous is at ``live`` from now on, on the same connection. Reply: None."""

    name: ClassVar[str] = "settle"
    live: LiveStore


FailoverRequest = (Probe | MovingList | Pause | Adopt | CloseStore | Count | ReadMoving
                   | HostStandby | AppendStandby | OnStandby | JoinRound | Where | Settle)
# a failover operation: yields requests, is sent replies
FailoverOp = Generator[Request | FailoverRequest, Any, T]


@dataclass
class FailoverContext:
    """What the operations know of the candidates and of this node."""

    names: list[str]  # each candidate as ``host:port``
    keys: RunKeys
    read_s: float  # a start waits this long for the first candidate (the read timeout)
    run_id: str = ""
    me: str = ""  # this node's identity (``_schema.node_id``), as its records name it
    start_wait: float = 0.0  # a start waits this long (the join timeout) for a committed epoch
    join_s: float = 600.0  # the join timeout (a node with no world follows within it)
    clock: Callable[[], float] = time.monotonic
    say: Callable[..., None] = log.warning  # a move, as the operator reads it
    sync_retry_s: float = SYNC_RETRY_S  # seconds between a standby's attempts to sync
    # a standby store's incarnation (``_schema.encode_started``): unique per start of a store
    nonce: Callable[[], bytes] = new_incarnation

    def name(self, i: int) -> str:
        return self.names[i] if i >= 0 else "?"


# ---------------------------------------------------------------------- finding stores


def probe(p: FailoverContext, exclude: int,
          quick: bool = False) -> FailoverOp[tuple[list[tuple[int, int]], list[str]]]:
    """Every answering candidate but ``exclude``: ``(-epoch, index)``, best first; and what
    the others said."""
    found, errors = [], []
    for i in range(len(p.names)):
        if i != exclude:
            r = yield Probe(i, p.keys.epoch, quick)
            if isinstance(r, str):
                errors.append(r)
            else:
                found.append((-int(r), i))
    found.sort()
    return found, errors


def connect(p: FailoverContext, exclude: int = -1, at_least: int = 0,
            world: bytes = b"") -> FailoverOp[tuple[int, int, int]]:
    """The live store: (candidate index, its committed epoch, the epoch this node proposes
    there or 0); the caller adopts the connection. When the store's epoch is below
    ``at_least`` (this node moves the rendezvous there) it is not raised: the node writes
    only a provisional mark (``moving``) and proposes ``at_least`` in its record.

    At a node's start (``exclude`` -1) the first candidate is waited for up to the read
    timeout, as a single endpoint is; a store that moved (epoch above 0) is taken at once;
    while other candidates answer, empty (the rendezvous may be moving), up to
    ``start_wait``. An empty first candidate whose host restarted after the rendezvous moved
    away (its ``behind`` key, :func:`behind`) is not a job's start: it is passed over.
    A starting node carries no world, so it never starts the rendezvous on
    another candidate (:data:`NO_WORLD_RULE`): cut from the first alone, it would form a
    world of its own there while the others form one on the first.

    A mover that carries ``world`` reads the marks back after its own (:func:`mark`).

    Raises:
        RendezvousConnectionError: No candidate answered within the read timeout (at a
            start: the first did not, and no other holds a committed epoch).
        Fenced: ``world`` declared this node gone before its mark reached the candidate.
    """
    start = p.clock()
    read_end = start + p.read_s
    # each pass probes every candidate; the last pass is the first after the deadline
    deadline = max(read_end, start + (max(p.start_wait, 0.0) if exclude < 0 else 0.0))
    for _ in range(1_000_000):  # bounded by the deadline
        found, errors = yield from probe(p, exclude)
        if exclude < 0 and found and found[0] == (0, 0):  # the first, empty: a job's start?
            behind = yield Probe(0, p.keys.behind)
            if isinstance(behind, int) and behind > 0:  # no: its host restarted (``behind``)
                found = found[1:]
                errors.append(f"{p.name(0)}: restarted after the rendezvous moved to epoch "
                              f"{behind}")
        if found and (exclude >= 0 or found[0][0] != 0 or found[0][1] == 0):
            break
        now = p.clock()
        if now >= deadline and found:  # a start: only empty standbys
            raise RendezvousConnectionError(
                f"The first rendezvous store candidate did not answer within "
                f"{deadline - start:g} seconds ({'; '.join(errors)}), and no other holds a "
                f"committed epoch: {NO_WORLD_RULE}")
        if now >= deadline or (not found and now >= read_end):
            raise RendezvousConnectionError(
                "No rendezvous store candidate could be reached: " + "; ".join(errors))
        yield Pause(RETRY_S)
    else:
        raise RendezvousConnectionError("No rendezvous store candidate could be reached")
    epoch, i = -found[0][0], found[0][1]
    proposed = at_least if epoch < at_least else 0
    if exclude >= 0 or proposed:  # a move: the mark that tells the proof this node is here
        yield from mark(p, i, proposed or epoch, world, exclude)
    return i, epoch, proposed


def behind(p: FailoverContext, standby: int, i: int, epoch: int) -> FailoverOp[None]:
    """A starting node that hosts candidate ``standby`` found the live store at candidate
    ``i`` with the committed ``epoch`` (probing before it hosts, and again at its connect):
    its own store, empty, is behind that (its host restarted after the rendezvous moved
    away). It says so there (``behind``), so that a fresh node that cannot reach ``i`` does
    not take the empty first candidate for a job's start and form a world of its own beside
    the live one. Its requests go to the standby."""
    if standby >= 0 and standby != i and epoch > 0:
        yield OnStandby(Set(p.keys.behind, encode_number(epoch)),
                        f"mark it as behind epoch {epoch}")


def sync_entries(lists: list[bytes | None], n: int, no_world_yet: bool = False) -> bytes | None:
    """What a candidate host whose store (re)started appends to its own ``moving`` list, from
    the other candidates' lists ``lists`` (None: no answer), before its ``s`` entry: their
    marks and proofs' entries, once it has read every other candidate or
    :func:`prover_quorum` of them that count (``_schema.counts``); None until then.
    ``no_world_yet``: the first candidate answered, and no world ever formed there (every
    job's first world does): no mark or fence exists anywhere, and nothing is to be copied.

    A restarted host lost the marks and fences its store held. Every mark (fence) that counted
    was read back from :func:`mover_quorum` (:func:`prover_quorum`) candidates, after all of
    its appends; so the others the host copies from hold each of them, unless more than one
    candidate lost its store at once."""
    answered = [raw for raw in lists if raw is not None]
    if no_world_yet:
        return b"".join(map(copied_entries, answered))
    if len(answered) < n - 1 and sum(map(counts, answered)) < prover_quorum(n):
        return None
    return b"".join(map(copied_entries, answered))


def may_have_lost_state(committed_elsewhere: bool, lists: list[bytes | None],
                        first: bytes | None, no_world: bool) -> bool:
    """Whether a candidate host that starts its store may be restarting one that held marks or
    fences: another candidate holds a committed epoch, or a mark or fence, or the first
    candidate (``first``: its ``moving`` list, None when it is this one or did not answer)
    shows a world formed (``no_world``: :func:`no_world_yet`). Only then does the store start
    not counting, until it is synced. A restarted host that can see none of these (cut from
    every candidate that saw the rendezvous move) counts at once: the hole that a restart
    which cannot reach the live store leaves open anyway (``behind``)."""
    return (committed_elsewhere or any(copied_entries(raw) for raw in lists if raw)
            or (first is not None and not no_world))


def no_world_yet(epoch: int, opened: int, moving: bytes) -> bool:
    """Whether the first candidate, read as its ``epoch``, ``open`` and ``moving`` keys, shows
    that no world formed yet: none formed there (its publisher sets ``open`` with the outcome)
    and none came back (the epoch), and it holds no mark or fence."""
    return epoch == 0 and opened == 0 and not copied_entries(moving)


def begin(m: Machine, i: int, epoch: int, proposed: int) -> LiveStore:
    """Where a started node's rendezvous is (``connect``'s answer); a proposal, when its
    start found only a store it moves the rendezvous to, goes into its machine."""
    m.moved(proposed)
    return LiveStore(i, epoch, proposed)


def mark(p: FailoverContext, i: int, epoch: int, world: bytes, lost: int = -1) -> FailoverOp[None]:
    """A mover's mark (``me`` proposing ``epoch``) on candidate ``i``, where it joins. One that
    carries ``world`` marks :func:`mover_quorum` candidates (``i`` first, ``lost``, the store
    it lost, last), all before it reads any back, and carries its world only once its mark is
    read back from that many that count, in the incarnation it appended to. Until then it
    tries again every ``RETRY_S``, up to the join timeout.

    Raises:
        Fenced: A fence of this node from ``world`` precedes its mark on a candidate.
        RendezvousTimeoutError: The mark was not read back from enough candidates in time.
    """
    entry = encode_mark(epoch, p.me)
    if not world:  # no world to carry: the mark only says where it is
        yield MovingList(i, entry)
        return
    n = len(p.names)
    need = mover_quorum(n)
    order = [i] + [j for j in range(n) if j not in (i, lost)] + ([lost] if lost not in (-1, i)
                                                                  else [])
    until = p.clock() + p.join_s
    why: list[str] = []
    for attempt in range(1_000_000):  # bounded by ``until``
        appended: dict[int, bytes | None] = {}
        why = []
        for j in order:  # every append before any read (see sync_entries)
            if len(appended) >= need:
                break
            raw = yield MovingList(j, entry)
            if isinstance(raw, bytes) and counts(raw):
                appended[j] = incarnation(raw)
            else:
                why.append(raw if isinstance(raw, str) else
                           f"{p.name(j)} refused the connection" if raw is None else
                           f"{p.name(j)} is not synced since its host started")
        read = 0
        for j, nonce in appended.items():
            raw = yield MovingList(j, b"")
            if not isinstance(raw, bytes) or incarnation(raw) != nonce or not counts(raw):
                why.append(f"{p.name(j)} did not answer the read-back")
                continue
            if fenced(raw, p.me, world):
                raise Fenced(f"{p.name(j)} holds a fence of this node from its world "
                             f"{world.decode('utf-8', 'replace')} before its mark: the store "
                             "where that world formed proved it gone first")
            read += 1
        if read >= need:
            return
        if p.clock() >= until:
            break
        if attempt % 50 == 0:  # at once, then every ~10 s
            p.say("rendezvous %s: this node's mark was read back from %d of the %d candidates "
                  "a move needs (%s); it tries again until its join timeout", p.run_id, read,
                  need, "; ".join(why))
        yield Pause(RETRY_S)
    raise RendezvousTimeoutError(
        f"this node's mark (carrying its world) was read back from fewer than {need} of the "
        f"{n} candidates within {p.join_s:g} seconds ({'; '.join(why)}): "
        + QUORUM_RULE.format(m=need, n=n, f=prover_quorum(n)))


def follow_to(p: FailoverContext, live: LiveStore, until: float) -> FailoverOp[LiveStore]:
    """For a node that carries no world whose store was lost (:data:`NO_WORLD_RULE`): the
    candidate with a committed epoch above ``live``'s, or the store it was on once that
    answers again (at its epoch or above); probes every 0.2 s until ``until``.

    Raises:
        RendezvousTimeoutError: Neither happened by ``until``.
    """
    for _ in range(1_000_000):  # bounded by ``until``
        found, _ = yield from probe(p, -1)
        pick = next((f for f in found if -f[0] > live.epoch or (
            f[1] == live.index and -f[0] >= live.epoch)), None)
        if pick is not None:
            return LiveStore(pick[1], -pick[0])
        if p.clock() >= until:
            break
        yield Pause(RETRY_S)
    raise RendezvousTimeoutError(
        f"the rendezvous store at {p.name(live.index)} was lost and did not answer again, "
        f"and no other candidate holds a committed epoch above {live.epoch}: {NO_WORLD_RULE}")


def raise_if_moved(p: FailoverContext, index: int, epoch: int) -> FailoverOp[list[int]]:
    """The candidates other than ``index`` that answer; raises
    ``RendezvousConnectionError`` when one holds an epoch above ``epoch``: the rendezvous
    moved there while this node's store stayed up (a partition, or this node's host frozen
    while the others moved)."""
    found, _ = yield from probe(p, index)
    if found and -found[0][0] > epoch:
        raise RendezvousConnectionError(
            f"the rendezvous moved on to {p.name(found[0][1])} (epoch {-found[0][0]})")
    return sorted(i for _, i in found)


def check(p: FailoverContext, live: LiveStore) -> FailoverOp[None]:
    """For a node whose round failed the majority rule (the machine's ``MovedElsewhere``):
    raises when the rendezvous moved on elsewhere (a higher committed epoch), or
    :class:`GoBack` when the store an uncommitted move left answers again: its world formed a
    round there after the one left (it re-joins as a new node), or none (``rejoin``: it
    re-joins as a member of its world). Movers stranded on different successors (each too few
    for the rule) thus meet again where their world formed, once it answers; every mover of a
    world goes back to the same store, and only one hop (a store that lost its rounds,
    ``open`` 0, is not where its world formed). While that store does not answer, a mover
    regroups on the first candidate in list order that answers (:class:`Regroup`), one hop
    each time and only to a lower index, so the movers of a world meet there."""
    answering = yield from raise_if_moved(p, live.index, live.epoch)
    if live.left is None:
        return
    i, left = live.left
    opened = yield Probe(i, p.keys.open)  # the round after its last complete one
    if isinstance(opened, int) and opened > left + 1:
        raise GoBack(f"the store this node left, {p.name(i)}, is alive and its world "
                     f"formed a round after round {left}")
    if isinstance(opened, int) and opened == left + 1:
        raise GoBack(f"the store this node left, {p.name(i)}, answers again and its "
                     f"world formed no round there after round {left}", rejoin=True)
    lower = [j for j in answering if j < live.index and j != i]
    if lower:
        raise Regroup(f"{p.name(lower[0])} answers, before this node's "
                      f"{p.name(live.index)} in the list", lower[0])


def regroup_to(p: FailoverContext, live: LiveStore, j: int,
               world: bytes = b"") -> FailoverOp[LiveStore]:
    """Candidate ``j`` for a mover that regroups there (see :func:`check`): the same move,
    its proposal and mark carried over (:class:`Fenced` as :func:`connect`)."""
    epoch = yield Probe(j, p.keys.epoch)
    if isinstance(epoch, str):
        raise RendezvousConnectionError(epoch)
    proposed = live.proposed if live.proposed > epoch else 0
    yield from mark(p, j, proposed or epoch, world)
    return LiveStore(j, epoch, proposed, live.left if proposed else None)


# ---------------------------------------------------------------------- a node's moves


def move(p: FailoverContext, m: Machine, live: LiveStore, why: BaseException) -> FailoverOp[None]:
    """The live store's host is lost: the node says ``moved`` there (before any close, so a
    close without it is a death), connects to the next live candidate, proposes an epoch past
    the lost one's with a mark, and starts the rounds over there. Back on the store where its
    world formed (an uncommitted move returning), it is a member there again."""
    member = m.member
    yield StopBeats()
    try:
        yield from m.moving()
    except RendezvousConnectionError:
        pass  # that store is lost: its proof reads the other candidates
    try:
        i, epoch, proposed = yield from connect(
            p, exclude=live.index, at_least=max(live.epoch, live.proposed) + 1,
            world=m.world_id)
    except Fenced as e:
        yield from drop_world(p, m, live, e)
        return
    left = (live.index, member[0]) if member is not None else live.left
    new = LiveStore(i, epoch, proposed, left if proposed and live.index >= 0 else None)
    if live.left is not None and i == live.left[0] and m.returned():
        new = LiveStore(i, epoch)  # back where its world formed
    else:
        m.moved(proposed)
    yield Adopt(new)
    p.say("rendezvous %s: the store at %s was lost (%s); moved to %s (epoch %d%s)", p.run_id,
          p.name(live.index), why, p.name(i), proposed or epoch,
          " proposed: committed once a round forms there" if proposed else "")


def go_back(p: FailoverContext, m: Machine, live: LiveStore, why: GoBack) -> FailoverOp[None]:
    """A mover whose move was not committed finds the store it left answering again: it
    goes back, as a member of its world when no round formed there since (``rejoin``), else
    as a new node.

    Raises:
        RendezvousConnectionError: That store stopped answering meanwhile.
    """
    assert live.left is not None
    yield StopBeats()
    i = live.left[0]
    epoch = yield Probe(i, p.keys.epoch)
    if isinstance(epoch, str):
        raise RendezvousConnectionError(epoch)
    yield Adopt(LiveStore(i, epoch))
    if not (why.rejoin and m.returned()):
        m.back()
    p.say("rendezvous %s: %s; went back to it", p.run_id, why)


def regroup(p: FailoverContext, m: Machine, live: LiveStore, why: Regroup) -> FailoverOp[None]:
    """A mover whose round failed the majority rule regroups on an earlier candidate (its
    world's store not answering): the movers of a world meet there."""
    yield StopBeats()
    try:
        new = yield from regroup_to(p, live, why.index, m.world_id)
    except Fenced as e:
        yield from drop_world(p, m, live, e)
        return
    yield Adopt(new)
    m.moved(new.proposed)
    p.say("rendezvous %s: %s; regrouped there", p.run_id, why)


def follow(p: FailoverContext, m: Machine, live: LiveStore, why: BaseException,
           until: float) -> FailoverOp[None]:
    """A node that carries no world lost its store: it follows a committed move, or
    reconnects to its store once it answers (:func:`follow_to`).

    Raises:
        RendezvousTimeoutError: Neither happened by ``until``.
    """
    yield StopBeats()
    lost = p.name(live.index)
    p.say("rendezvous %s: the store at %s was lost (%s) while this node belonged to no world: "
          "it does not move the rendezvous; it waits up to %.0fs for that store or a "
          "committed move", p.run_id, lost, why, max(0.0, until - p.clock()))
    try:
        new = yield from follow_to(p, live, until)
    except RendezvousTimeoutError as e:
        raise RendezvousTimeoutError(
            f"The rendezvous '{p.run_id}' did not complete within {p.join_s:g} seconds "
            f"({why}): {e}") from e
    yield Adopt(new)
    m.moved()
    p.say("rendezvous %s: the store at %s (lost while this node belonged to no world) is now "
          "at %s (epoch %d)", p.run_id, lost, p.name(new.index), new.epoch)


def drop_world(p: FailoverContext, m: Machine, live: LiveStore, why: Fenced) -> FailoverOp[None]:
    """The store where this node's world formed proved it gone before its mark reached a
    candidate: it drops that world (a new node from now on) and closes its connection, so its
    next request fails and it follows (:func:`follow`) as a node with no world: to a
    committed move, or back to its world's store (not to an uncommitted successor)."""
    m.back()
    where = LiveStore(live.left[0], 0) if live.left is not None else live  # not a successor
    yield CloseStore(where)
    p.say("rendezvous %s: %s; it carries no world from now on: it does not move the "
          "rendezvous, it follows a committed move or waits for %s", p.run_id, why,
          p.name(where.index))


def after(p: FailoverContext, m: Machine, live: LiveStore, why: BaseException, moves: int,
          until: float) -> FailoverOp[int]:
    """What a join that failed with ``why`` on the live store does next: go back or regroup
    (:class:`GoBack`, :class:`Regroup`); with no world, follow; else move, while ``moves``
    (left of this rendezvous) last. Returns the moves left.

    Raises:
        ``why``: No move is left.
    """
    if isinstance(why, GoBack):
        yield from go_back(p, m, live, why)
    elif isinstance(why, Regroup):
        yield from regroup(p, m, live, why)
    elif m.member is None and not m.carried:  # no world: it never moves the rendezvous
        yield from follow(p, m, live, why, until)
    elif moves <= 0:
        raise why
    else:
        yield from move(p, m, live, why)
        return moves - 1
    return moves


def join_anywhere(p: FailoverContext, m: Machine) -> FailoverOp[Any]:
    """The node's join on its live store; when it fails there, what :func:`after` says: go
    back, regroup, follow (a node with no world never moves the rendezvous), or move to the
    next candidate (at most once per candidate). Returns the join's answer.

    Raises:
        RendezvousConnectionError: ``MAX_HOPS`` moves and returns formed no round.
    """
    moves = len(p.names) - 1
    until = p.clock() + p.join_s
    for _ in range(MAX_HOPS):  # bounded: each pass joins, moves (``moves`` at most) or goes back
        try:
            seat = yield JoinRound()
        except (RendezvousConnectionError, StoreTimeoutError) as e:
            live = yield Where()
            if live is not None:  # None: another thread of the node moved since the failure
                moves = yield from after(p, m, live, e, moves, until)
            continue
        live = yield Where()
        if live is not None:
            yield Settle(live.member())
        return seat
    raise RendezvousConnectionError(
        f"The rendezvous '{p.run_id}' moved between its candidates {MAX_HOPS} times "
        "without forming a round.")


# ---------------------------------------------------------------------- the proof


ProofOp = Generator[MovingList, "bytes | str | None", str]


def prove_gone(names: list[str], index: int, idents: list[str], world: bytes,
               proof: bytes = b"") -> ProofOp:
    """Whether the members ``idents`` (their identities) of ``world``, whose connections
    closed on candidate ``index``, are proven to be nowhere else (the candidates are
    ``names``): "" once this prover's fences of them (:func:`encode_fence`) are read back,
    with no mark of them made before a fence stood, from :func:`prover_quorum` candidates
    that count (``index`` first); else why not. A refused connection, a timeout and a store
    not synced since its host started are no answer alike: any of them may hide a live
    store that the movers use.

    A mover's mark counts only once read back from :func:`mover_quorum` candidates, and the
    two quorums meet: on a candidate in both, the one appended first is seen by the other
    (the server's appends are atomic): a mark first blocks this proof, a fence first makes
    the mover drop ``world`` (:func:`mark`). So the proof and a move never both count a
    member, whatever the timing. Every fence is appended before any is read back, and a
    restarted candidate copies the others' lists (:func:`sync_entries`), so a fence read
    back survives its candidate's restart.

    A first pass only reads, so that a proof bound to fail (a mark, too few answers) leaves
    no fences behind; a proof that fails after fencing withdraws the fences it appended
    (``proof`` names them; a random name by default), so that a mover that comes later
    carries its world all the same. A fence whose withdrawal does not get through stays: it
    costs a mover its world, never a second one."""
    proof = proof or new_proof_name()
    n, need = len(names), prover_quorum(len(names))
    fences = b"".join(encode_fence(world, x, proof) for x in idents)
    why: list[str] = []
    chosen: list[int] = []
    for i in [index] + [j for j in range(n) if j != index]:  # read-only: who can count
        if len(chosen) >= need:
            break
        raw = yield MovingList(i, b"")
        if not isinstance(raw, bytes) or not counts(raw):
            why.append(raw if isinstance(raw, str) else f"{names[i]} refused the connection"
                       if raw is None else f"{names[i]} is not synced since its host started")
            if i == index:
                break  # the prover's own store: nothing to prove it on
            continue
        moved = [x for x in idents if marked_before_fence(raw, x, world)]
        if moved:
            return f"{moved} moved: marked on {names[i]} before any fence"
        chosen.append(i)
    if len(chosen) < need:
        return _too_few(n, need, why)
    appended: dict[int, bytes | None] = {}
    verdict = ""
    for i in chosen:  # every fence before any read-back
        raw = yield MovingList(i, fences)
        if not isinstance(raw, bytes):
            verdict = raw or f"{names[i]} refused the connection"
            break
        appended[i] = incarnation(raw)
    for i, nonce in appended.items() if not verdict else ():
        raw = yield MovingList(i, b"")
        if not isinstance(raw, bytes) or incarnation(raw) != nonce or not counts(raw):
            verdict = f"{names[i]} did not answer the read-back"
            break
        moved = [x for x in idents if marked_before_fence(raw, x, world)]
        if moved:
            verdict = f"{moved} moved: marked on {names[i]} before any fence"
            break
    if verdict:
        withdrawals = b"".join(encode_withdrawal(world, x, proof) for x in idents)
        for i in appended:
            yield MovingList(i, withdrawals)  # best effort (see above)
    return verdict


def _too_few(n: int, need: int, why: list[str]) -> str:
    return (f"fewer than {need} of the {n} candidates answer ({'; '.join(why)}), and "
            + QUORUM_RULE.format(m=mover_quorum(n), n=n, f=need))
