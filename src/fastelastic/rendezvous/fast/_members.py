"""The round machine's operations on a node's membership between rounds (a mixin of
``_round.Machine``): its membership checks (``lost_members``, ``num_nodes_waiting``), its
leave, its ``moved`` word before a move, ``done``, and closing the rendezvous."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
)

from . import _schema as sc
from ._liveness import MemberWatch, lost_members
from ._requests import Add, Append, MultiSet, RequestGen, Set
from ._schema import Membership

if TYPE_CHECKING:
    from ._config import Config


class MemberOps:
    """``Machine``'s membership operations (see the module doc)."""

    if TYPE_CHECKING:
        cfg: Config
        clock: Callable[[], float]
        keys: sc.RunKeys
        member: Membership | None
        watch: MemberWatch | None
        spare_ready: bool
        leaving: bool
        waited_as_spare: bool


    def lost_members(self) -> RequestGen[list[tuple[int, str]]]:
        """Members of this node's round lost since the last call: ``[(rank, why), ...]``
        (see ``FastRendezvousHandler.lost_members``)."""
        if self.watch is None:
            return []
        return (yield from lost_members(self.watch, self.cfg, self.spare_ready, self.clock))

    def num_nodes_waiting(self) -> RequestGen[int]:
        """Tickets taken in the round after this node's; 0 behind a full round (spares)."""
        if self.member is None:
            return 0
        r, _, world = self.member
        v = sc.tickets_taken(int((yield Add(self.keys.round(r + 1).tickets, 0))))
        if world >= self.cfg.max_nodes:
            self.spare_ready = v > 0
            return 0
        return v

    def leave(self, for_good: bool = False) -> RequestGen[None]:
        """Tells the members of this node's last round that it left, if it is leaving (a
        re-join whose ticket is counted) or ``for_good``: ``left/<rank>`` (what the next
        round's coordinator waits for), ``broken`` (a next round may form) and ``<rank>:left;``
        in ``gone`` (``quit`` when ``for_good``: it is nowhere else; the others restart at
        their next membership check). Fire-and-forget."""
        if self.member is None or not (self.leaving or for_good):
            return
        self.leaving = False
        q, rank, _ = self.member
        k = self.keys.round(q)
        yield MultiSet([k.left(rank), k.broken], [sc.PRESENT, sc.PRESENT])
        yield Append(k.gone, sc.encode_gone(rank, "quit" if for_good else "left"))

    def moving(self) -> RequestGen[None]:
        """Before a node that moves to another candidate closes anything: ``<rank>:moved;`` in
        its round's ``gone`` (fire-and-forget), so that where its world formed its close is
        not taken for a death (``_majority.proof_candidates``)."""
        if self.member is not None:
            q, rank, _ = self.member
            yield Append(self.keys.round(q).gone, sc.encode_gone(rank, "moved"))

    def mark_done(self, hosting: bool = False) -> RequestGen[None]:
        """Tells the others this node's workers finished: its later exit is no loss.
        ``hosting``: it hosts the store, which ends with it (``host`` follows ``done``)."""
        if self.watch is not None:
            rank = self.watch.rank
            done = sc.encode_gone(rank, "done")
            yield Append(self.watch.k.gone, done + sc.encode_gone(rank, "host") if hosting
                         else done)

    def set_closed(self) -> RequestGen[None]:
        """Sets ``closed`` and wakes every node waiting in a forming round or as a spare."""
        yield Set(self.keys.closed, sc.PRESENT)
        cur = int((yield Add(self.keys.open, 0)))
        rounds = {cur, cur + 1}
        if self.member is not None:
            rounds.add(self.member.round + 1)
        for r in sorted(rounds):
            yield Append(self.keys.round(r).outcome, sc.CLOSED)
        if self.member is not None:  # wakes the spares waiting behind our round at once
            yield Append(self.keys.round(self.member.round).broken, sc.BROKEN_CLOSED)

    def has_waiters(self) -> RequestGen[bool]:
        """True when nodes wait for the round after this node's (spares, at shutdown)."""
        if self.member is None:
            return False
        return bool(int((yield Add(self.keys.round(self.member.round + 1).tickets, 0))))

    def closed_error(self) -> RendezvousError:
        """Closed: a spare (waiting behind a full round) exits gracefully, as torch's does."""
        if self.waited_as_spare:
            return RendezvousGracefulExitError(
                f"The rendezvous '{self.cfg.run_id}' is closed; this node waited as a spare.")
        return RendezvousClosedError(f"The rendezvous '{self.cfg.run_id}' is closed.")
