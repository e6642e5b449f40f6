"""A rendezvous store that outlives its host: the candidate endpoints of ``--rdzv-endpoint
h1:p1,h2:p2,...``, a standby store on this node's candidate, and the choice of the live one.

Every node that owns a candidate (its host is this machine; at most one candidate per node)
hosts a store on it from the start, empty. All nodes meet on the live store: the reachable
candidate with the highest ``epoch`` key, the first in the list among equals. When the live
store's host is lost, the survivors move to the next one, raise its ``epoch`` past the old
one's, and join there afresh (the rendezvous state is soft: the members re-create it). A node
started later probes the candidates the same way and finds where the others went. What keeps
the two sides of a partition from both training is the majority rule of ``_round.Machine.moved``.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from collections.abc import Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from fastelastic._waits import Slices
from fastelastic.errors import RendezvousConnectionError, RendezvousTimeoutError, StoreError

from ._requests import Append, Get, Proto
from ._schema import Keys, encode_fence, encode_mark, fenced, marked_before_fence
from .utils import _matches_machine_hostname, parse_rendezvous_endpoint


def _is_mine(host: str) -> bool:
    """Whether ``host`` is an address of this node (of its network namespace): a literal
    address is tried with a bind, which no lookup can get wrong; a name is looked up."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return _matches_machine_hostname(host)
    with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET) as s:
        try:
            s.bind((str(addr), 0))
            return True
        except OSError:
            return False

# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.failover")

PROBE_S = 2.0  # seconds a candidate has to accept and answer a probe
_RETRY_S = 0.2  # seconds between the probes of a node waiting for a candidate


def parse_candidates(endpoint: str, default_port: int) -> list[tuple[str, int]]:
    """``h1:p1,h2:p2,...`` as ``[(host, port), ...]``; at least two, no duplicates.

    Raises:
        ValueError: A malformed or repeated candidate.
    """
    out = [parse_rendezvous_endpoint(e, default_port) for e in endpoint.split(",")]
    if any(not e.strip() for e in endpoint.split(",")):
        raise ValueError(f"The rendezvous endpoint list {endpoint!r} has an empty entry.")
    if len(set(out)) != len(out):
        raise ValueError(f"The rendezvous endpoint list {endpoint!r} repeats a candidate.")
    return out


@dataclass(frozen=True)
class Live:
    """Where a node's rendezvous is: the live candidate and its committed epoch; after a move
    not yet committed, the epoch this node proposes there and the (candidate, round) it left;
    whether this node was a member of a round there (only then may it close that store)."""

    index: int = -1
    epoch: int = 0
    proposed: int = 0
    left: tuple[int, int] | None = None
    formed: bool = False

    def member(self) -> Live:
        """This node is a member of a round here: any move it proposed was committed."""
        return Live(self.index, max(self.epoch, self.proposed), 0, None, True)


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


Proof = Generator[tuple[int, bytes], "bytes | str | None", str]


def prove_gone(names: list[str], index: int, idents: list[str], world: bytes) -> Proof:
    """Whether the members ``idents`` (``<addr>|<pid>``) of ``world``, whose connections
    closed on candidate ``index``, are proven to be nowhere else (the candidates are
    ``names``): "" when every other candidate refuses the connection, or answers and, after
    this prover's fences of them (:func:`encode_fence`, one append), holds no mark of them
    before their fence; else why not (a timeout or no route blocks the proof, as does a
    mark). A mover that marks a candidate after the fence drops ``world`` there
    (:meth:`Candidates._mark`), so the proof and the move cannot both count it, whatever the
    timing. A first pass only reads, so that a proof bound to fail (a mark, a timeout) leaves
    no fences behind.

    The policy alone, run on real stores by :meth:`Candidates.gone_elsewhere` and by the
    tests' simulation: it yields ``(candidate, fence)``, "append ``fence`` (if any) to that
    candidate's ``moving`` list, then read it", and is sent the list (bytes), None when
    nothing listens there (refused), or why it did not answer (str)."""
    fences = b"".join(encode_fence(world, x) for x in idents)
    for fence in (b"", fences):  # the decision is the second pass's alone
        for i, name in enumerate(names):
            if i == index:
                continue
            marks = yield i, fence
            if marks is None:
                continue  # nothing listens there: no store they could be on
            if isinstance(marks, str):
                return marks
            moved = [x for x in idents if marked_before_fence(marks, x, world)]
            if moved:
                return f"{moved} moved to {name}"
    return ""


def mark_moving(key: str, me: str, epoch: int, world: bytes) -> Proto[bool]:
    """A mover's mark on a candidate (``me`` proposing ``epoch``, or that store's committed
    one) in its ``moving`` list ``key``; carrying ``world``, it reads the list back. True
    (fenced) when a fence of it from that world precedes its mark: where that world formed it
    was proven gone first (the server's appends are atomic, so the prover read the same
    order), and it must not carry that world here. The policy alone, run on real stores by
    :meth:`Candidates._mark` and by the tests' simulation."""
    yield Append(key, encode_mark(epoch, me))
    return bool(world) and fenced(bytes((yield Get(key, None))), me, world)


class Candidates:
    """The candidates, this node's standby store and the connection to the live one."""

    def __init__(self, run_id: str, endpoints: list[tuple[str, int]], is_host: bool | None,
                 read_timeout: timedelta, token: bytes | None = None) -> None:
        keys = Keys(run_id)  # every key from _schema
        self.key = keys.epoch
        self.moving_key = keys.moving
        self.open_key = keys.open
        self.me = ""  # ``<addr>|<pid>`` as this node's ``who`` entries name it (its marks)
        self.endpoints = endpoints
        self.read_timeout = read_timeout
        self.token = token
        self.start_wait = 0.0  # a start waits this long (the join timeout) for a committed epoch
        self.standby: Any = None  # the store this node hosts, if it owns a candidate
        self.standby_index = -1
        if is_host is not False:
            self._host(is_host)

    def _host(self, is_host: bool | None) -> None:
        from fastelastic.store import TCPStore

        for i, (host, port) in enumerate(self.endpoints):
            if not (is_host or _is_mine(host)):
                continue
            try:
                self.standby = TCPStore(host, port, is_master=True, multi_tenant=True,
                                        wait_for_workers=False, timeout=self.read_timeout,
                                        token=self.token)
                self.standby_index = i
                return
            except (StoreError, OSError) as e:  # hosted by another node of this machine
                log.debug("candidate %s:%d already hosted (%s)", host, port, e)

    def name(self, i: int) -> str:
        host, port = self.endpoints[i]
        return f"{host}:{port}"

    def connect(self, exclude: int = -1, at_least: int = 0,
                world: bytes = b"") -> tuple[Any, int, int, int]:
        """Connects to the live store: (client, candidate index, its committed epoch, the
        epoch this node proposes there or 0). When the store's epoch is below ``at_least``
        (this node moves the rendezvous there) it is not raised: the node writes only a
        provisional mark (``moving``) and proposes ``at_least`` in its record; the epoch rises
        with the first round there that passes the majority rule (``_round.Machine._publish``).

        At a node's start (``exclude`` -1) the first candidate is waited for up to the read
        timeout, as a single endpoint is; a store that moved (epoch above 0) is taken at once;
        while other candidates answer, empty (the rendezvous may be moving), up to
        ``start_wait`` (the join timeout).
        A starting node carries no world, so it never starts the rendezvous on another
        candidate (``NO_WORLD_RULE``): cut from the first alone, it would form a world of its
        own there while the others form one on the first.

        A mover that carries ``world`` reads the marks back after its own (:meth:`_mark`).

        Raises:
            RendezvousConnectionError: No candidate answered within the read timeout (at a
                start: the first did not, and no other holds a committed epoch).
            Fenced: ``world`` declared this node gone before its mark reached the candidate.
        """
        start = time.monotonic()
        read_end = start + self.read_timeout.total_seconds()
        # each pass probes every candidate; the last pass is the first after the deadline. A
        # start waits longer (start_wait) while other candidates answer empty: the rendezvous
        # may be moving, and a start never proposes an epoch
        wait = max(self.start_wait, 0.0) if exclude < 0 else 0.0
        probes = Slices(max(read_end, start + wait), _RETRY_S, passes=1_000_000,
                        last_look=True)
        for _ in probes:
            found, errors = self._probe(exclude)
            if found and (exclude >= 0 or found[0][0] != 0 or found[0][1] == 0):
                break
            for _, _, c in found:  # at a start, only empty standbys: the first may be coming
                c.close()
            if probes.expired() and found:  # a start: only empty standbys
                raise RendezvousConnectionError(
                    f"The first rendezvous store candidate did not answer within "
                    f"{max(wait, self.read_timeout.total_seconds()):g} seconds "
                    f"({'; '.join(errors)}), and no other holds a committed epoch: "
                    f"{NO_WORLD_RULE}")
            if probes.expired() or (not found and time.monotonic() >= read_end):
                raise RendezvousConnectionError(
                    "No rendezvous store candidate could be reached: " + "; ".join(errors))
            time.sleep(_RETRY_S)
        else:
            raise RendezvousConnectionError("No rendezvous store candidate could be reached")
        neg, i, client = found[0]
        for _, _, other in found[1:]:
            other.close()
        epoch = -neg
        proposed = at_least if epoch < at_least else 0
        if exclude >= 0 or proposed:  # a move: the mark that tells the proof this node is here
            self._mark(client, i, proposed or epoch, world)
        client.set_timeout(self.read_timeout)
        return client, i, epoch, proposed

    def _mark(self, client: Any, i: int, epoch: int, world: bytes) -> None:
        """:func:`mark_moving` on ``client`` (candidate ``i``); when fenced, closes ``client``
        and raises :class:`Fenced`."""
        from . import _store_ops as ops

        proto, reply = mark_moving(self.moving_key, self.me, epoch, world), None
        try:
            for _ in range(3):  # an append and a get
                reply = ops.apply(client, proto.send(reply))
        except StopIteration as e:
            if e.value:
                client.close()
                raise Fenced(f"{self.name(i)} holds a fence of this node from its world "
                             f"{world.decode('utf-8', 'replace')} before its mark: the store "
                             "where that world formed proved it gone first") from None
            return
        raise AssertionError("mark_moving asked more than two requests")

    def connect_to(self, i: int) -> tuple[Any, int]:
        """A connection to candidate ``i`` (a mover going back): (client, its epoch).

        Raises:
            RendezvousConnectionError: It does not answer.
        """
        from fastelastic.store import TCPStore

        host, port = self.endpoints[i]
        try:
            client = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
        except (StoreError, OSError) as e:
            raise RendezvousConnectionError(f"{host}:{port}: {e}") from e
        try:
            epoch = int(client.add(self.key, 0))
        except (StoreError, OSError) as e:
            client.close()
            raise RendezvousConnectionError(f"{host}:{port}: {e}") from e
        client.set_timeout(self.read_timeout)
        return client, epoch

    def opened(self, i: int) -> int:
        """Candidate ``i``'s ``open`` (the round after its last complete one; 0 when none
        completed there), or -1 when it does not answer."""
        from fastelastic.store import TCPStore

        host, port = self.endpoints[i]
        try:
            c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
        except (StoreError, OSError):
            return -1
        try:
            return int(c.add(self.open_key, 0))
        except (StoreError, OSError):
            return -1
        finally:
            c.close()

    def follow(self, live: Live, until: float) -> tuple[Any, Live]:
        """For a node that carries no world whose store was lost (``NO_WORLD_RULE``): the
        candidate with a committed epoch above ``live``'s, or the store it was on once that
        answers again (at its epoch or above); probes every 0.2 s until ``until`` (monotonic).

        Raises:
            RendezvousTimeoutError: Neither happened by ``until``.
        """
        for _ in range(1_000_000):  # bounded by ``until``
            found, _ = self._probe(-1)
            pick = next((f for f in found if -f[0] > live.epoch or (
                f[1] == live.index and -f[0] >= live.epoch)), None)
            for f in found:
                if f is not pick:
                    f[2].close()
            if pick is not None:
                pick[2].set_timeout(self.read_timeout)
                return pick[2], Live(pick[1], -pick[0])
            if time.monotonic() >= until:
                break
            time.sleep(0.2)
        raise RendezvousTimeoutError(
            f"the rendezvous store at {self.name(live.index)} was lost and did not answer "
            f"again, and no other candidate holds a committed epoch above {live.epoch}: "
            f"{NO_WORLD_RULE}")

    def move(self, live: Live, member_round: int | None,
             world: bytes = b"") -> tuple[Any, Live]:
        """The live store was lost: the next live candidate, with a proposed epoch (and where
        to go back to) unless its committed one is already past this node's. Raises
        :class:`Fenced` when ``world`` (the one it carries) proved it gone first."""
        client, i, epoch, proposed = self.connect(
            exclude=live.index, at_least=max(live.epoch, live.proposed) + 1, world=world)
        left = (live.index, member_round) if member_round is not None else live.left
        return client, Live(i, epoch, proposed, left if proposed and live.index >= 0 else None)

    def back(self, live: Live) -> tuple[Any, Live]:
        """A connection to the store an uncommitted move left (see :class:`GoBack`)."""
        assert live.left is not None
        client, epoch = self.connect_to(live.left[0])
        return client, Live(live.left[0], epoch)

    def check(self, live: Live) -> None:
        """For a node whose round failed the majority rule: raises when the rendezvous
        moved on elsewhere (a higher committed epoch), or :class:`GoBack` when the store an
        uncommitted move left answers again: its world formed a round there after the one
        left (it re-joins as a new node), or none (``rejoin``: it re-joins as a member of its
        world). Movers stranded on different successors (each too few for the rule) thus
        meet again where their world formed, once it answers; every mover of a world goes
        back to the same store, and only one hop (a store that lost its rounds, ``open`` 0,
        is not where its world formed). While that store does not answer, a mover regroups
        on the first candidate in list order that answers (:class:`Regroup`), one hop each
        time and only to a lower index, so the movers of a world meet there."""
        answering = self.raise_if_moved(live.index, live.epoch)
        if live.left is None:
            return
        i, left = live.left
        opened = self.opened(i)
        if opened > left + 1:
            raise GoBack(f"the store this node left, {self.name(i)}, is alive and its world "
                         f"formed a round after round {left}")
        if opened == left + 1:
            raise GoBack(f"the store this node left, {self.name(i)}, answers again and its "
                         f"world formed no round there after round {left}", rejoin=True)
        lower = [j for j in answering if j < live.index and j != i]
        if lower:
            raise Regroup(f"{self.name(lower[0])} answers, before this node's "
                          f"{self.name(live.index)} in the list", lower[0])

    def regroup(self, live: Live, j: int, world: bytes = b"") -> tuple[Any, Live]:
        """A connection to candidate ``j`` for a mover that regroups there (see ``check``):
        the same move, its proposal and mark carried over (:class:`Fenced` as ``move``)."""
        client, epoch = self.connect_to(j)
        proposed = live.proposed if live.proposed > epoch else 0
        try:
            self._mark(client, j, proposed or epoch, world)
        except (StoreError, OSError) as e:
            client.close()
            raise RendezvousConnectionError(f"{self.name(j)}: {e}") from e
        return client, Live(j, epoch, proposed, live.left if proposed else None)

    def raise_if_moved(self, index: int, epoch: int) -> list[int]:
        """Raises ``RendezvousConnectionError`` when a candidate other than ``index`` answers
        with an epoch above ``epoch``: the rendezvous moved there while this node's store
        stayed up (a partition, or this node's host frozen while the others moved)."""
        found, _ = self._probe(index)
        for _, _, c in found:
            c.close()
        if found and -found[0][0] > epoch:
            raise RendezvousConnectionError(
                f"the rendezvous moved on to {self.name(found[0][1])} (epoch {-found[0][0]})")
        return sorted(i for _, i, _ in found)

    def _probe(self, exclude: int) -> tuple[list[tuple[int, int, Any]], list[str]]:
        """Every answering candidate but ``exclude``: ``(-epoch, index, client)``, best
        first; and what the others said."""
        from fastelastic.store import TCPStore

        found: list[tuple[int, int, Any]] = []
        errors = []
        for i, (host, port) in enumerate(self.endpoints):
            if i == exclude:
                continue
            try:
                c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
            except (StoreError, OSError) as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            try:
                found.append((-int(c.add(self.key, 0)), i, c))
            except (StoreError, OSError) as e:
                errors.append(f"{host}:{port}: {e}")
                c.close()
        found.sort(key=lambda f: (f[0], f[1]))
        return found, errors

    def gone_elsewhere(self, index: int, idents: list[str], world: bytes = b"") -> str:
        """:func:`prove_gone` on the real candidates (each of its requests by :meth:`_marks`)."""
        proof = prove_gone([self.name(i) for i in range(len(self.endpoints))], index, idents,
                           world)
        reply: bytes | str | None = None
        try:
            for _ in range(2 * len(self.endpoints) + 1):  # two passes over the candidates
                i, fence = proof.send(reply)
                reply = self._marks(i, fence)
        except StopIteration as e:
            return str(e.value)
        raise AssertionError("prove_gone asked more than two passes")

    def _marks(self, i: int, fence: bytes) -> bytes | str | None:
        """Candidate ``i``'s ``moving`` list, after appending ``fence`` (if any); None when it
        refuses the connection; why, when it does not answer."""
        from fastelastic.store import TCPStore

        host, port = self.endpoints[i]
        try:
            socket.create_connection((host, port), timeout=PROBE_S).close()
        except ConnectionRefusedError:
            return None
        except OSError as e:
            return f"{self.name(i)} did not answer ({e})"
        try:
            c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
            try:
                if fence:
                    c.append(self.moving_key, fence)
                return bytes(c.get(self.moving_key)) if c.check([self.moving_key]) else b""
            finally:
                c.close()
        except (StoreError, OSError) as e:
            return f"{self.name(i)} did not answer ({e})"

    def close(self) -> None:
        if self.standby is not None:
            standby, self.standby = self.standby, None
            standby.close()
