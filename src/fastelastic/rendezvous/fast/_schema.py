"""The fast rendezvous's key schema: every key it writes, what each holds, and their codecs.

All keys live under ``fe.rdzv.<run_id>/``; a round ``r``'s keys under ``<r>/``.

Run-wide:

* ``open``: the round new nodes should join (set by each round's publisher; a hint).
* ``closed``: exists once the rendezvous is closed.
* ``epoch``: how many times the rendezvous moved to a successor store (several
  ``--rdzv-endpoint`` candidates); the live store is the reachable one with the highest epoch.
  It rises only with the first round there that passed the majority rule (the epoch its
  movers proposed; ``_round.Machine._publish``), so a node that moved alone never makes a
  store look live.
* ``moving``: the provisional marks of the nodes that moved here, ``<epoch it proposes>|<node>;``
  each (``<node>``: the node's identity, :func:`node_id`); no node follows them. Where a world
  formed, a member whose connection closed and whom no other candidate has a mark of is proven
  gone (``_majority``). The prover appends
  a fence ``x<world id>/<proof>|<node>;`` there first: a mark while it stands is too late
  to count, and its mover drops that world (:func:`marked_before_fence`, :func:`fenced`). A
  proof that fails after fencing withdraws its fences (``y<world id>/<proof>|<node>;``,
  ``<proof>`` naming that proof's fences alone), so a failed proof costs no mover its world.
  A candidate's host writes two entries of its own there (``u`` and ``s``, see
  :func:`counts`): from its store's start until it has copied the other candidates' lists, the
  store does not count toward the failover's quorums (a host that restarted lost its marks).
* ``behind``: on a standby store whose host restarted after the rendezvous moved away, the
  committed epoch its new agent found elsewhere: while it is above the store's own ``epoch``
  the store is not live, and a start does not take it as the first candidate's (an empty
  first candidate is otherwise a job's start).

Round ``r``:

* ``t`` (:py:attr:`RoundKeys.tickets`): the ticket counter. A node's ``add(t, 1)`` is its join;
  a ticket above ``max_nodes`` means the round is full and the node waits in ``r + 1``. The
  coordinator seals the round with ``add(t, SEAL)``: the value it gets back minus ``SEAL`` is
  the final count, and every later ticket is above ``SEAL``.
* ``n/<ticket>`` (:py:meth:`RoundKeys.record`): the node's record,
  ``pref|addr|pid|wstore|quorum|from|epoch|world|node`` (preferred rank, address, pid, its
  workers' store address, the fewest members it accepts: a majority of its last world after a
  move, else 0; the round of this store it was a member of, -1 for none; the epoch it proposes
  after a move, else 0; the id of the world it is a member of or carries, ``<gen>.<nonce>``,
  empty for none: see :func:`world_gen`; the node's identity, :func:`node_id`). Fields past the
  5th are read tolerantly (absent: none). Address and pid only inform: pods share both
  (``""`` and 1), so the rules name a node by its identity alone.
* ``rank/<ticket>`` (:py:meth:`RoundKeys.seat`): the node's seat, ``<rank>|<tickets of the
  peers it watches>``; ``-1`` until the publisher writes it (and for a node not admitted).
* ``who/<rank>`` (:py:meth:`RoundKeys.who`): ``<ticket>|<record>`` of each member, by rank.
* ``hb/t<ticket>`` (:py:meth:`RoundKeys.beat`): the node's keep-alive counter, bumped every
  keep-alive interval from the moment it took its ticket.
* ``res`` (:py:attr:`RoundKeys.outcome`): the round's outcome, decided by one compare-and-set
  from absent: ``M<world>\\n<rank 0's workers' store address>\\n`` (complete; a third line
  ``=`` when every rank is the ticket minus one, so nobody needs to read a seat; then
  ``w<world id>``, read tolerantly) or ``D;``
  (abandoned: everyone re-joins ``r + 1``; also appended by the server when a joined node's
  connection closes). A ``C;`` appended by ``set_closed`` means closed. Text after the first
  newline is not part of the verdict, so late appends never corrupt a complete outcome.
* ``gone`` (:py:attr:`RoundKeys.gone`): ``<rank>:<why>;`` entries (and ``t<ticket>:closed;``,
  :func:`ticket_closed`, for a node whose connection closed before it read its seat), the
  first one per rank wins
  but ``quit`` and ``done`` win over the others (:func:`parse_gone`):
  ``closed`` (the server, when a member's connection closed), ``done`` (its workers finished;
  its later exit is no loss), ``left`` (it re-joins), ``quit`` (it leaves for good: preempted),
  ``silent`` (a peer saw its counter stand still for the detection window), ``moved`` (it
  moves to another candidate on purpose: said before it closes anything, so a ``closed``
  without it is a death, see :func:`.failover._majority.proof_candidates`), ``host`` (after its
  ``done``: it hosts the store, which goes when it ends; :func:`host_finished`).
* ``left/<rank>`` (:py:meth:`RoundKeys.left`): the member left the round (re-joined, left,
  died, or was found silent). The next round is sealed once every member has left.
* ``broken`` (:py:attr:`RoundKeys.broken`): the round is over (a member left or was lost); ``C``
  is appended when the rendezvous closes. Spares wait for it.
* ``wstore``: rank 0's workers' store address, for rounds decided without it in ``res``.

In the round store the agents get (``torch.rendezvous.<run_id>.<r>/``), for
:mod:`fastelastic.checkpoint`:

* ``fe.ckpt/held/<group rank>``: what that agent's checkpoint memory holds at the round's
  start (:func:`encode_held`): its era, and per shard the global rank, the world size, the step,
  the era and generation, own or a copy held for another node; plus the newest step whole on
  the disk it wrote. Every agent reads all of them and applies :func:`restore_rule`, so the
  round's restore step is re-derived from the agents at every round (a failed-over store
  starts empty) and is the same for every rank.
"""

from __future__ import annotations

import enum
import os
import time
import zlib
from dataclasses import dataclass
from typing import NamedTuple

from fastelastic.errors import RendezvousStateError

__all__ = ["SEAL", "RoundKeys", "RunKeys", "assign_ranks"]

SEAL = 1 << 40


def tickets_taken(counter: int) -> int:
    """The tickets a round's counter ``t`` counts, whether sealed (``SEAL`` added) or not."""
    return counter - SEAL if counter >= SEAL else counter


class RunKeys:
    """The run-wide keys, and each round's (:py:meth:`round`)."""

    def __init__(self, run_id: str) -> None:
        self.base = f"fe.rdzv.{run_id}/"
        self.open = self.base + "open"
        self.closed = self.base + "closed"
        self.epoch = self.base + "epoch"
        self.moving = self.base + "moving"
        self.behind = self.base + "behind"

    def round(self, r: int) -> RoundKeys:
        return RoundKeys(self.base, r)


class RoundKeys:
    """The keys of round ``r`` (see the module docstring for what each holds)."""

    __slots__ = ("broken", "gone", "outcome", "p", "r", "tickets", "wstore")

    def __init__(self, base: str, r: int) -> None:
        self.r = r
        self.p = p = f"{base}{r}/"
        self.tickets = p + "t"
        self.outcome = p + "res"
        self.gone = p + "gone"
        self.broken = p + "broken"
        self.wstore = p + "wstore"

    def record(self, ticket: int | str) -> str:
        return f"{self.p}n/{ticket}"

    def seat(self, ticket: int | str) -> str:
        return f"{self.p}rank/{ticket}"

    def beat(self, ticket: int | bytes | str) -> str:
        if isinstance(ticket, bytes):
            ticket = ticket.decode()
        return f"{self.p}hb/t{ticket}"

    def who(self, rank: int) -> str:
        return f"{self.p}who/{rank}"

    def left(self, rank: int) -> str:
        return f"{self.p}left/{rank}"


# ---------------------------------------------------------------------- values

PRESENT = b"1"  # a key whose presence alone counts (``closed``, ``left/<rank>``, ``broken``)
UNSEATED = b"-1"  # ``rank/<ticket>`` until the publisher writes the seat
FIRST_BEAT = b"0"  # ``hb/t<ticket>`` as its holder writes it with its record
LEFT_SILENT = b"silent"  # ``left/<rank>`` of a member a peer found silent (else PRESENT)
LEFT_HUNG = b"hung"  # ``left/<rank>`` of a member the drain found silent


def encode_number(n: int) -> bytes:
    """A value that is one decimal integer: ``open`` (a round), ``epoch``, ``behind``, a
    keep-alive counter's bump, a ticket in a seat's peer list. The store's ``add`` reads and
    writes the same form."""
    return b"%d" % n


def parse_wstore(raw: bytes) -> tuple[str, int]:
    """A workers' store address, ``<host>:<port>`` (an IPv6 host keeps its colons)."""
    host, _, port = raw.decode().rpartition(":")
    return host, int(port)


def encode_wstore(host: str, port: int) -> bytes:
    """The inverse of :func:`parse_wstore`: in a record, in ``res`` and in ``wstore``."""
    return f"{host}:{port}".encode()


def node_id(host: str, pid: int, nonce: int) -> str:
    """A node's identity in every record, ``who`` entry, mark and fence:
    ``<host>:<pid>:<nonce>`` (``nonce`` 64 random bits, drawn once per launcher). The nonce
    alone makes it unique per launcher incarnation: pods share pid 1 and often the address,
    and pids collide across hosts; host and pid are there for the operator. Characters the
    wire formats use (``|;/``) and any other outside ``[A-Za-z0-9._-]`` become ``_``."""
    safe = "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in host)
    return f"{safe[:64] or '?'}:{pid}:{nonce & (1 << 64) - 1:016x}"


def encode_record(pref: int, addr: str, pid: int, wstore: bytes, quorum: int = 0,
                  member_of: int = -1, epoch: int = 0, world: bytes = b"",
                  node: str = "") -> bytes:
    return b"%d|%s|%d|%s|%d|%d|%d|%s|%s" % (pref, addr.encode(), pid, wstore, quorum,
                                            member_of, epoch, world, node.encode())


def record_node(raw: bytes) -> str:
    """The identity of the node whose record this is (:func:`node_id`); for a record written
    without one, ``<addr>|<pid>``, as such a writer named itself in its marks."""
    parts = raw.split(b"|")
    if len(parts) > 8 and parts[8]:
        return parts[8].decode("utf-8", "replace")
    return b"|".join(parts[1:3]).decode("utf-8", "replace")


def record_world(raw: bytes) -> bytes:
    """The id of the world the node is a member of, or carries after a move (b"": none, or
    a record written before worlds were named); see :func:`world_gen`."""
    parts = raw.split(b"|")
    return parts[7] if len(parts) > 7 else b""


def world_gen(wid: bytes) -> int:
    """A world id's generation, ``<gen>.<nonce>``: one more than the highest generation of the
    last world on the store where it formed and of any world the records of its round named
    (0: no world). A world formed after another on the same store, or from (some of) its
    members elsewhere, has a higher generation than it."""
    try:
        return int(wid.partition(b".")[0]) if wid else 0
    except ValueError as e:
        raise RendezvousStateError(f"corrupt world id {wid[:40]!r}") from e


def world_id(gen: int, *salt: object) -> bytes:
    """A new world's id: its generation and a nonce (from ``salt``, the publisher's identity,
    and the wall clock: unique across stores and restarts)."""
    return b"%d.%08x" % (gen, zlib.crc32(repr((salt, time.time_ns())).encode()))


def record_epoch(raw: bytes) -> int:
    """The epoch a node that moved here proposes (0: none): committed with the first round
    here that passes the majority rule."""
    parts = raw.split(b"|")
    try:
        return int(parts[6]) if len(parts) > 6 else 0
    except ValueError as e:
        raise RendezvousStateError(f"corrupt node record {raw[:40]!r}") from e


def record_member_of(raw: bytes) -> int:
    """The round of this store the node was a member of when it took its ticket (-1: none;
    its preferred rank is then its rank there)."""
    parts = raw.split(b"|")
    try:
        return int(parts[5]) if len(parts) > 5 else -1
    except ValueError as e:
        raise RendezvousStateError(f"corrupt node record {raw[:40]!r}") from e


def record_quorum(raw: bytes) -> int:
    """The fewest members the node accepts in a round (0: no rule): a majority of the last
    world it was a member of, once the rendezvous moved to a successor store."""
    parts = raw.split(b"|")
    try:
        return int(parts[4]) if len(parts) > 4 else 0
    except ValueError as e:
        raise RendezvousStateError(f"corrupt node record {raw[:40]!r}") from e


def record_pref(raw: bytes) -> int:
    """The preferred rank in a node's record."""
    try:
        return int(raw.split(b"|", 1)[0])
    except ValueError as e:
        raise RendezvousStateError(f"corrupt node record {raw[:40]!r}") from e


def record_wstore(raw: bytes) -> bytes:
    """The workers' store address in a node's record (b"" for none)."""
    parts = raw.split(b"|")
    return parts[3] if len(parts) > 3 else b""


def encode_who(ticket: int, record: bytes) -> bytes:
    """A member's ``who/<rank>`` entry: ``<ticket>|<record>`` (:func:`encode_record`)."""
    return b"%d|%s" % (ticket, record)


def who_parts(raw: bytes) -> tuple[str, str, str]:
    """A member's ``who`` entry: (ticket, address, pid), as text ("" when absent)."""
    ticket, _, addr, pid = (raw.decode("utf-8", "replace").split("|") + ["", "", ""])[:4]
    return ticket, addr, pid


def who_node(raw: bytes) -> str:
    """A member's ``who`` entry (``<ticket>|<record>``): its identity (:func:`record_node`)."""
    return record_node(raw.partition(b"|")[2])


@dataclass
class Seat:
    """A node's place in a complete round."""

    round: int
    rank: int
    world: int
    peers: list[bytes]  # tickets of the peers whose keep-alives it watches
    wstore: bytes  # rank 0's workers' store address (b"" if not in the outcome)


class Membership(NamedTuple):
    """A node's membership of a complete round, a value replaced as a whole."""

    round: int
    rank: int
    world: int


def encode_seat(rank: int, peers: list[int]) -> bytes:
    return b"%d|%s" % (rank, b",".join(b"%d" % t for t in peers))


def parse_seat(raw: bytes) -> tuple[int, list[bytes]]:
    """A node's seat: (rank or -1, tickets of the peers it watches)."""
    head, _, peers = raw.partition(b"|")
    try:
        return int(head), peers.split(b",") if peers else []
    except ValueError as e:
        raise RendezvousStateError(f"corrupt rank {raw[:40]!r}") from e


class OutcomeKind(enum.Enum):
    """What became of a round: the first byte of its outcome (``res``) on the wire."""

    COMPLETE = b"M"
    CLOSED = b"C"
    ABANDONED = b"D"


# each kind's byte, read once (an enum's ``value`` is a descriptor call: parse_outcome is hot)
_COMPLETE, _CLOSED, _ABANDONED = (OutcomeKind.COMPLETE.value, OutcomeKind.CLOSED.value,
                                  OutcomeKind.ABANDONED.value)


def encode_outcome(world: int, wstore: bytes, identity: bool, wid: bytes = b"") -> bytes:
    return b"%s%d\n%s\n%s%s" % (_COMPLETE, world, wstore, IDENTITY if identity else b"",
                                b"w%s\n" % wid if wid else b"")


ABANDONED = _ABANDONED + b";"
NO_QUORUM = _ABANDONED + b"Q;"  # abandoned by a majority rule (_round.Machine.moved, _publish)
CLOSED = _CLOSED + b";"
IDENTITY = b"=\n"  # third line of a complete outcome: rank = ticket - 1, no seats written
BROKEN_CLOSED = b"C"  # in a round's ``broken``: it is over because the rendezvous closed


class Outcome(NamedTuple):
    kind: OutcomeKind
    world: int = 0
    wstore: bytes = b""  # rank 0's workers' store address
    identity: bool = False  # every node's rank is its ticket - 1 (no seat to read)
    no_quorum: bool = False  # abandoned by a majority rule (a moved world, or a split)
    why: str = ""  # the majority rule's objection (its second line), for the timeout's error
    wid: bytes = b""  # a complete round's world id (see world_gen; b"" from older publishers)


def encode_no_quorum(why: str) -> bytes:
    """``DQ;`` with the objection on its own line (appends that follow stay after it)."""
    return NO_QUORUM + b"\n" + why.replace("\n", " ").encode("utf-8", "replace") + b"\n"


def parse_outcome(raw: bytes) -> Outcome:
    """``res``: complete (world, workers' store, identity), closed or abandoned."""
    head, _, rest = raw.partition(b"\n")
    if head.startswith(_COMPLETE):
        try:
            world = int(head[1:])
        except ValueError as e:
            raise RendezvousStateError(f"corrupt rendezvous outcome {raw[:40]!r}") from e
        wstore, nl, rest = rest.partition(b"\n")
        identity = rest.startswith(IDENTITY)
        rest = rest[len(IDENTITY):] if identity else rest
        wid, wnl, _ = rest.partition(b"\n")  # a line of its own: later appends follow it
        wid = wid[1:] if wid.startswith(b"w") and wnl else b""
        return Outcome(OutcomeKind.COMPLETE, world, wstore if nl else b"", identity, wid=wid)
    if _CLOSED in head:  # closed wins over an abandon it was appended to
        return Outcome(OutcomeKind.CLOSED)
    if head.startswith(_ABANDONED):
        no_quorum = head.startswith(NO_QUORUM[:2])
        why = rest.partition(b"\n")[0].decode("utf-8", "replace") if no_quorum else ""
        return Outcome(OutcomeKind.ABANDONED, no_quorum=no_quorum, why=why)
    raise RendezvousStateError(f"corrupt rendezvous outcome {raw[:40]!r}")


FOR_GOOD = ("quit", "done")  # ``gone`` reasons of a member that is nowhere else


def parse_gone(raw: bytes) -> dict[int, str]:
    """``gone``'s ``<rank>:<why>;`` entries: for each rank the first reason given, except
    that a later ``quit`` or ``done`` (it is nowhere else) wins over ``left``, ``closed`` or
    ``silent`` (it may be): a node SIGTERMed while it re-joins has written ``left`` first."""
    out: dict[int, str] = {}
    for entry in raw.split(b";"):
        rank, _, why = entry.partition(b":")
        try:
            r = int(rank)
        except ValueError:
            continue
        reason = why.decode("ascii", "replace")
        if r not in out or (reason in FOR_GOOD and out[r] not in FOR_GOOD):
            out[r] = reason
    return out


def encode_gone(rank: int, why: str) -> bytes:
    """One ``gone`` entry, ``<rank>:<why>;`` (``why``: ``closed``, ``done``, ``left``,
    ``quit``, ``silent``, ``moved`` or ``host``; see the module doc)."""
    return b"%d:%s;" % (rank, why.encode("ascii"))


def broken_by_close(raw: bytes) -> bool:
    """True when a round's ``broken`` says the rendezvous closed (:data:`BROKEN_CLOSED`)."""
    return BROKEN_CLOSED in raw


def host_finished(raw: bytes) -> bool:
    """True when ``gone`` says the store's host finished its work (its ``host`` entry,
    written with its ``done``): the store going away after that is the job's end there, not
    a lost host."""
    return any(entry.partition(b":")[2] == b"host" for entry in raw.split(b";"))


def ticket_closed(ticket: int) -> bytes:
    """The ``gone`` entry the server appends when the connection of the node holding
    ``ticket`` closes, registered with its record: a member that died before it read its seat
    (so before its rank's own entry was registered) is known closed all the same."""
    return b"t%d:closed;" % ticket


def closed_unmoved(raw: bytes, tickets: dict[int, str] | None = None) -> set[int]:
    """The ranks in ``gone`` whose connection closed (``closed``, whatever they said before:
    a member that left to re-join and died while it did; or, for the ranks in ``tickets``
    (rank -> its ticket), the entry of :func:`ticket_closed`) and that never said ``moved``."""
    by_ticket = {b"t" + t.encode(): rank for rank, t in (tickets or {}).items() if t}
    closed: set[int] = set()
    moved: set[int] = set()
    for entry in raw.split(b";"):
        who, _, why = entry.partition(b":")
        if why not in (b"closed", b"moved"):
            continue
        rank = int(who) if who.isdigit() else by_ticket.get(who, -1)
        if rank >= 0:
            (closed if why == b"closed" else moved).add(rank)
    return closed - moved


def encode_mark(epoch: int, ident: str) -> bytes:
    """A mover's entry in ``moving``: the epoch it proposes (or the store's) and who it is."""
    return b"%d|%s;" % (epoch, ident.encode())


def encode_fence(wid: bytes, ident: str, proof: bytes = b"") -> bytes:
    """A prover's entry in ``moving``: ``ident`` is about to be declared gone from world
    ``wid`` by the proof named ``proof``; a mark of it while this stands comes too late (see
    ``_majority``)."""
    return b"x%s/%s|%s;" % (wid, proof, ident.encode())


def new_proof_name() -> bytes:
    """A proof's name in its fences and withdrawals: random, so two proofs never share one."""
    return os.urandom(4).hex().encode()


def encode_withdrawal(wid: bytes, ident: str, proof: bytes) -> bytes:
    """A failed proof's entry in ``moving``: its fence of ``ident`` (same ``wid`` and ``proof``)
    no longer stands; a later mark counts again."""
    return b"y%s/%s|%s;" % (wid, proof, ident.encode())


def _entries(raw: bytes) -> list[tuple[bytes, str]]:
    """``moving``'s entries in append order: (first field, the node's identity)."""
    out = []
    for entry in raw.split(b";"):
        head, sep, ident = entry.partition(b"|")
        if sep:
            out.append((head, ident.decode("utf-8", "replace")))
    return out


def new_incarnation() -> bytes:
    """A candidate store's incarnation nonce (its host's ``u`` and ``s`` entries): random, so
    each start of a store has its own."""
    return os.urandom(8).hex().encode()


def encode_started(nonce: bytes) -> bytes:
    """A candidate host's first entry in its new store's ``moving`` list: this incarnation
    (``nonce``) does not count toward the failover's quorums until it is synced."""
    return b"u%s|;" % nonce


def encode_synced(nonce: bytes) -> bytes:
    """The entry its host appends, with the entries it copied from the other candidates, once
    it has copied enough of them (``_hops.sync_entries``): the incarnation counts from then on."""
    return b"s%s|;" % nonce


def incarnation(raw: bytes) -> bytes | None:
    """The nonce of the store's incarnation (its host's ``u`` entry), or None: a store that no
    candidate host started (an external or a test's store), which always counts."""
    for head, _ in _entries(raw):
        if head[:1] == b"u":
            return head[1:]
    return None


def counts(raw: bytes) -> bool:
    """Whether a candidate whose ``moving`` list is ``raw`` counts toward a quorum: it has no
    host's ``u`` entry, or its host has synced it (an ``s`` entry of the same incarnation)."""
    nonce = incarnation(raw)
    return nonce is None or any(head == b"s" + nonce for head, _ in _entries(raw))


def copied_entries(raw: bytes) -> bytes:
    """The entries of a ``moving`` list that a restarted candidate copies (marks, fences and
    withdrawals), in append order: not the other host's own ``u`` and ``s`` entries."""
    return b"".join(entry + b";" for entry in raw.split(b";")
                    if b"|" in entry and entry[:1] not in (b"u", b"s"))


def marks(raw: bytes) -> list[tuple[int, str]]:
    """``moving``'s marks in append order: (the epoch proposed, the mover's identity)."""
    return [(int(head), who) for head, who in _entries(raw) if head.isdigit()]


def proof_entries(raw: bytes) -> bytes:
    """The proofs' entries of a ``moving`` list (fences and withdrawals), in append order."""
    return b"".join(entry + b";" for entry in raw.split(b";")
                    if entry[:1] in (b"x", b"y") and b"|" in entry)


def _marks_fenced(raw: bytes, ident: str, wid: bytes) -> list[bool]:
    """For each mark of ``ident`` in ``moving``, in append order: whether a fence of it from
    world ``wid`` stood when it was appended (appended before it, and not withdrawn before it
    by the proof that appended it). The list only grows at its end (the server's appends are
    atomic), so every reader judges a mark alike, whenever it reads."""
    fence, withdrawal = b"x" + wid, b"y" + wid
    standing: set[bytes] = set()
    out = []
    for head, who in _entries(raw):
        if who != ident:
            continue
        if head.isdigit():
            out.append(bool(standing))
            continue
        kind, _, proof = head.partition(b"/")  # no "/": a fence of an older writer
        if kind == fence:
            standing.add(proof)
        elif kind == withdrawal:
            standing.discard(proof)
    return out


def marked_before_fence(raw: bytes, ident: str, wid: bytes) -> bool:
    """The prover's reading of ``moving``: a mark of ``ident`` was appended while no fence of
    it from world ``wid`` stood: it moved here in time (carrying that world), so it is not
    gone."""
    return not all(_marks_fenced(raw, ident, wid))


def fenced(raw: bytes, ident: str, wid: bytes) -> bool:
    """The mover's reading of ``moving`` after its mark: a fence of it from its world ``wid``
    stood when its last mark was appended, so that world declared it gone and it must not
    carry it here."""
    marks = _marks_fenced(raw, ident, wid)
    return bool(marks) and marks[-1]


def assign_ranks(prefs: list[int], world_size: int) -> list[int]:
    """Assigns ranks 0..world_size-1 to nodes listed in join order.

    A node keeps its preferred rank when that rank is in range and no earlier node took it;
    the others take the free ranks in join order.

    Args:
        prefs: Preferred rank of each node in join order (-1 for none).
        world_size: Number of nodes; ``len(prefs)``.

    Returns:
        The rank of each node, in join order.
    """
    ranks = [-1] * world_size
    taken = [False] * world_size
    for i, pref in enumerate(prefs):
        if 0 <= pref < world_size and not taken[pref]:
            ranks[i] = pref
            taken[pref] = True
    free = (r for r in range(world_size) if not taken[r])
    for i in range(world_size):
        if ranks[i] < 0:
            ranks[i] = next(free)
    return ranks



# ------------------------------------------------ the etcd liveness link (on the hub's store)


def encode_lease(lease: int) -> bytes:
    """``fe.etcd.hub``: the hub's etcd lease (:mod:`..etcd_impl.etcd_liveness`)."""
    return b"%d" % lease


def parse_lease(raw: bytes) -> int:
    """The inverse of :func:`encode_lease`.

    Raises:
        ValueError: not a lease.
    """
    return int(raw)


def encode_lost_lease(lease: int) -> bytes:
    """A member's entry in ``fe.etcd.lost``, appended by the hub's store when its connection
    closes: ``<lease>;``."""
    return b"%d;" % lease


def parse_lost_leases(raw: bytes) -> set[int]:
    """The leases in ``fe.etcd.lost`` (:func:`encode_lost_lease` entries).

    Raises:
        ValueError: an entry that is not a lease.
    """
    return {int(x) for x in raw.split(b";") if x.strip()}


# ------------------------------------------- checkpoint memory: the one-step rule across nodes


HELD_PREFIX = "fe.ckpt/held/"  # + the agent's group rank, in the round store


class HeldShard(NamedTuple):
    """One shard an agent holds: global ``rank`` of a world of ``world`` ranks, its ``step``,
    the ``era`` of the round that saved it and the saver's ``gen``; ``copy``: held for
    another node."""
    rank: int
    world: int
    step: int
    era: int
    gen: int
    copy: bool = False


class Held(NamedTuple):
    """An agent's publication: its era (of the last round it fixed), its shards, the
    newest step whole on the disk it wrote as ``(step, world)`` (or None), and the
    ``host:port`` of its copy port (empty: none)."""
    era: int
    shards: tuple[HeldShard, ...] = ()
    disk: tuple[int, int] | None = None
    addr: str = ""


class RestorePick(NamedTuple):
    """The round's restore: ``step`` (None: nothing to restore) of ``step_era``'s shards, a
    world of ``world``; ``sources[rank]`` = (index of the agent in the list, copy); ``disk``:
    the step comes from the disk; ``era``: this round's era, which its saves carry."""
    step: int | None
    era: int
    step_era: int = -1
    world: int = 0
    sources: dict[int, tuple[int, bool]] = {}
    disk: bool = False


def encode_held(held: Held) -> bytes:
    """``e<era>`` then ``;a<host:port>`` (its copy port), ``;d<step>,<world>`` (the disk) and
    ``;o|c<rank>,<world>,<step>,<era>,<gen>`` per shard (``o``: its own, ``c``: a copy)."""
    if ";" in held.addr:
        raise ValueError(f"a copy port's address with a ';': {held.addr!r}")
    parts = [b"e%d" % held.era]
    if held.addr:
        parts.append(b"a" + held.addr.encode())
    if held.disk is not None:
        parts.append(b"d%d,%d" % held.disk)
    for s in held.shards:
        parts.append(b"%s%d,%d,%d,%d,%d" % (b"c" if s.copy else b"o", s.rank, s.world, s.step,
                                            s.era, s.gen))
    return b";".join(parts)


def parse_held(raw: bytes) -> Held:
    """The inverse of :func:`encode_held`.

    Raises:
        ValueError: not a publication of :func:`encode_held` (a bad shard entry included: an
            agent's shards are taken whole or not at all).
    """
    parts = raw.split(b";")
    if not parts[0].startswith(b"e"):
        raise ValueError(f"checkpoint holdings without an era: {raw[:40]!r}")
    era = int(parts[0][1:])
    disk = None
    addr = ""
    shards = []
    for p in parts[1:]:
        if p[:1] == b"a":
            addr = p[1:].decode()
            continue
        kind, fields = p[:1], [int(x) for x in p[1:].split(b",")]
        if kind == b"d" and len(fields) == 2:
            disk = (fields[0], fields[1])
        elif kind in (b"o", b"c") and len(fields) == 5:
            rank, world, step, sera, gen = fields
            if not 0 <= rank < world:
                raise ValueError(f"checkpoint shard of rank {rank} in a world of {world}")
            shards.append(HeldShard(rank, world, step, sera, gen, kind == b"c"))
        else:
            raise ValueError(f"bad checkpoint holdings entry {p[:40]!r}")
    return Held(era, tuple(shards), disk, addr)


def restore_rule(helds: list[Held | None]) -> RestorePick:
    """The one-step rule across nodes: the newest step for which the live agents' memory (own
    shards or copies) holds every shard of one world, all of one era (a step saved again after
    a restore to an older one is another era's: the two are never mixed), or else the disk
    holds it whole. A step in memory beats the same step on disk (the faster source); for one
    step, the newer era wins. ``helds[i]`` is the agent of group rank ``i`` (None: it published
    nothing readable, and holds nothing). The same list gives every agent the same pick.
    """
    era = max((h.era for h in helds if h is not None), default=0) + 1
    have: dict[tuple[int, int, int], dict[int, tuple[int, bool, int]]] = {}
    for i, h in enumerate(helds):
        if h is None:
            continue
        for s in h.shards:
            ranks = have.setdefault((s.step, s.era, s.world), {})
            best = ranks.get(s.rank)
            # an agent's own shard first, then the newest generation, then the lowest agent
            cand = (i, s.copy, s.gen)
            if best is None or (not cand[1], cand[2], -cand[0]) > (not best[1], best[2], -best[0]):
                ranks[s.rank] = cand
    whole = [(step, sera, world) for (step, sera, world), ranks in have.items()
             if len(ranks) == world]
    disk = max((h.disk for h in helds if h is not None and h.disk is not None), default=None)
    if whole:
        step, sera, world = max(whole)
        if disk is None or disk[0] <= step:
            srcs = {r: (i, c) for r, (i, c, _g) in sorted(have[(step, sera, world)].items())}
            return RestorePick(step, era, sera, world, srcs)
    if disk is not None:
        return RestorePick(disk[0], era, -1, disk[1], {}, True)
    return RestorePick(None, era)
