"""The rendezvous handler's moves between the ``--rdzv-endpoint`` candidates (the policy
of :mod:`._failover`, run under the handler's move lock): a member that lost the live store
moves to the next candidate; a node that carries no world only follows a committed move or
waits for its store; a mover whose round failed the majority rule goes back to its world's
store or regroups on an earlier candidate. A mover fenced by its world's proof
(``_failover.Fenced``) drops that world and follows, as a node with no world."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from fastelastic.errors import (
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreError,
    StoreTimeoutError,
)

from ._failover import Fenced, GoBack, Live, Regroup

if TYPE_CHECKING:
    import threading

    from ._failover import Candidates
    from ._requests import Proto
    from ._round import Machine
    from .api import RendezvousInfo
    from .timeouts import RendezvousTimeout

log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous")
_MAX_HOPS = 64  # moves and returns of one next_rendezvous


class Moves:
    """Mixin of ``FastRendezvousHandler``: its moves (every one holds ``_move_lock`` and acts
    only when the failure came from the store it still talks through)."""

    if TYPE_CHECKING:
        _candidates: Candidates | None
        _live: Live
        _m: Machine
        _store: Any
        _move_lock: threading.RLock
        _run_id: str
        _timeout: RendezvousTimeout

        def _run(self, gen: Proto[Any], store: Any) -> Any: ...
        def _next_rendezvous(self) -> RendezvousInfo: ...
        def _stop_heartbeats(self) -> None: ...
        def _close_side(self) -> None: ...

    def _next_rendezvous_anywhere(self) -> RendezvousInfo:
        """``_next_rendezvous`` on the live store, moving to the next candidate when the
        store's host is lost (bounded by the number of candidates). A node that carries no
        world never moves the rendezvous (``_failover.NO_WORLD_RULE``): it follows a committed
        move, or waits for its store, within the join timeout."""
        moves = len(self._candidates.endpoints) - 1 if self._candidates is not None else 0
        until = time.monotonic() + self._timeout.join.total_seconds()
        for _ in range(_MAX_HOPS):  # bounded: each pass moves (at most ``moves``) or goes back
            store = self._store
            try:
                info = self._next_rendezvous()
                self._live = self._live.member()
                return info
            except GoBack as e:
                self._go_back(e, store)
            except Regroup as e:
                self._regroup(e, store)
            except (RendezvousConnectionError, StoreTimeoutError) as e:
                if self._candidates is not None and self._m.member is None and not (
                        self._m.carried):
                    self._follow(e, store, until)
                    continue
                if moves <= 0:
                    raise
                moves -= 1
                self._move(e, store)
        raise RendezvousConnectionError(
            f"The rendezvous '{self._run_id}' moved between its candidates {_MAX_HOPS} times "
            "without forming a round.")

    def _move(self, why: BaseException, failed: Any) -> bool:
        """The live store's host is lost: connect to the next live candidate, raise its epoch
        past the lost one's, and start the rounds over there (see :mod:`._failover`).

        ``failed`` is the store client the failure came from. Moves are serialised
        (``_move_lock``): when another call moved while this one failed, the failure was the
        old store's and this one does not move again (False)."""
        assert self._candidates is not None
        with self._move_lock:
            if self._store is not failed:
                return False
            self._move_now(why)
            return True

    def _move_now(self, why: BaseException) -> None:
        assert self._candidates is not None
        c, live, member = self._candidates, self._live, self._m.member
        lost = c.name(live.index) if live.index >= 0 else "?"
        self._stop_heartbeats()
        with contextlib.suppress(RendezvousConnectionError, StoreError):  # before any close
            self._run(self._m.moving(), self._store)
        try:
            self._switch(*c.move(live, member[0] if member is not None else None,
                                 self._m.world_id))
        except Fenced as e:
            self._fenced(e)
            return
        new = self._live
        if live.left is not None and new.index == live.left[0] and self._m.returned():
            self._live = new = Live(new.index, new.epoch)  # back where its world formed
        else:
            self._m.moved(new.proposed)
        log.warning("rendezvous %s: the store at %s was lost (%s); moved to %s (epoch %d%s)",
                    self._run_id, lost, why, c.name(new.index), new.proposed or new.epoch,
                    " proposed: committed once a round forms there" if new.proposed else "")

    def _go_back(self, why: GoBack, failed: Any) -> None:
        """A mover whose move was not committed finds the store it left answering again: it
        goes back, as a member of its world when no round formed there since (``rejoin``),
        else as a new node."""
        assert self._candidates is not None
        with self._move_lock:
            if self._store is not failed:
                return
            self._stop_heartbeats()
            self._switch(*self._candidates.back(self._live))
            if not (why.rejoin and self._m.returned()):
                self._m.back()
            log.warning("rendezvous %s: %s; went back to it", self._run_id, why)

    def _regroup(self, why: Regroup, failed: Any) -> None:
        """A mover whose round failed the majority rule regroups on an earlier candidate (its
        world's store not answering): the movers of a world meet there."""
        assert self._candidates is not None
        with self._move_lock:
            if self._store is not failed:
                return
            self._stop_heartbeats()
            try:
                self._switch(*self._candidates.regroup(self._live, why.index,
                                                       self._m.world_id))
            except Fenced as e:
                self._fenced(e)
                return
            self._m.moved(self._live.proposed)
            log.warning("rendezvous %s: %s; regrouped there", self._run_id, why)

    def _follow(self, why: BaseException, failed: Any, until: float) -> None:
        """A node that carries no world lost its store: it follows a committed move, or
        reconnects to its store once it answers (``Candidates.follow``; raises after
        ``until``)."""
        assert self._candidates is not None
        with self._move_lock:
            if self._store is not failed:
                return
            self._stop_heartbeats()
            lost = self._candidates.name(self._live.index)
            log.warning("rendezvous %s: the store at %s was lost (%s) while this node belonged "
                        "to no world: it does not move the rendezvous; it waits up to %.0fs "
                        "for that store or a committed move", self._run_id, lost, why,
                        max(0.0, until - time.monotonic()))
            try:
                client, live = self._candidates.follow(self._live, until)
            except RendezvousTimeoutError as e:
                raise RendezvousTimeoutError(
                    f"The rendezvous '{self._run_id}' did not complete within "
                    f"{self._timeout.join.total_seconds():g} seconds ({why}): {e}") from e
            self._switch(client, live)
            self._m.moved()
            log.warning("rendezvous %s: the store at %s (lost while this node belonged to no "
                        "world) is now at %s (epoch %d)", self._run_id, lost,
                        self._candidates.name(live.index), live.epoch)

    def _fenced(self, why: Fenced) -> None:
        """The store where this node's world formed proved it gone before its mark reached a
        candidate: it drops that world (a new node from now on) and closes its connection, so
        its next request fails and it follows (``_follow``) as a node with no world: to a
        committed move, or back to its world's store (not to an uncommitted successor)."""
        assert self._candidates is not None
        self._m.back()
        if self._live.left is not None:  # it was on an uncommitted successor: not its store
            self._live = Live(self._live.left[0], 0)
        with contextlib.suppress(Exception):
            self._store.close()
        log.warning("rendezvous %s: %s; it carries no world from now on: it does not move "
                    "the rendezvous, it follows a committed move or waits for %s",
                    self._run_id, why, self._candidates.name(self._live.index))

    def _switch(self, client: Any, live: Live) -> None:
        """Talks to the rendezvous through ``client`` (at ``live``) from now on."""
        old, self._store, self._live = self._store, client, live
        self._close_side()
        with contextlib.suppress(Exception):
            old.close()

