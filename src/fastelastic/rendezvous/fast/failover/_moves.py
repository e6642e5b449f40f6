"""The rendezvous handler's moves between the ``--rdzv-endpoint`` candidates: the failover's
operations (:mod:`._hops`: move, go back, regroup, follow, a fenced mover's drop) run on the
real stores (``_failover.Candidates.run``), one at a time under the handler's move lock, and
only when the failure came from the store the handler still talks through."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _hops as hops
from ._hops import LiveStore

if TYPE_CHECKING:
    import threading

    from ...api import RendezvousInfo
    from ...timeouts import RendezvousTimeout
    from .._round import Machine
    from ._failover import Candidates

class Moves:
    """Mixin of ``FastRendezvousHandler``: its moves, and the host side of the failover's
    operations (``_failover.Host``)."""

    if TYPE_CHECKING:
        _candidates: Candidates | None
        _live: LiveStore
        _m: Machine
        _store: Any
        _move_lock: threading.RLock
        _run_id: str
        _timeout: RendezvousTimeout
        _joined_on: Any  # the store of the last join (``_join_round``)

        def _next_rendezvous(self) -> RendezvousInfo: ...
        def _do(self, store: Any, op: Any) -> Any: ...
        def _close_side(self) -> None: ...

    def _next_rendezvous_anywhere(self) -> RendezvousInfo:
        """``_next_rendezvous`` on the live store, and what :func:`._hops.join_anywhere`
        does when it fails there, under the move lock (released while it joins)."""
        if self._candidates is None:
            return self._next_rendezvous()
        with self._move_lock:
            info: RendezvousInfo = self._candidates.run(
                hops.join_anywhere(self._candidates.plan, self._m), self)
            return info

    def _move(self, why: BaseException, failed: Any) -> bool:
        """The live store's host is lost: :func:`._hops.move`. False when another call moved
        while this one failed (the failure was the old store's): it does not move again."""
        assert self._candidates is not None
        plan = self._candidates.plan
        return self._hop(lambda live: hops.move(plan, self._m, live, why), failed)[0]

    def _hop(self, op: Callable[[LiveStore], hops.FailoverOp[Any]],
             failed: Any) -> tuple[bool, Any]:
        """Runs the operation ``op(live)`` makes from where the handler is (``live``) under
        the move lock, if the handler still talks through ``failed``: (True, its answer), else
        (False, None)."""
        assert self._candidates is not None
        with self._move_lock:
            if self._store is not failed:
                return False, None
            return True, self._candidates.run(op(self._live), self)

    # ------------------------------------------------------------------ _failover.Host

    def _switch(self, client: Any, live: LiveStore) -> None:
        """Talks to the rendezvous through ``client`` (at ``live``) from now on."""
        old, self._store, self._live = self._store, client, live
        self._close_side()
        with contextlib.suppress(Exception):
            old.close()

    def _join_round(self) -> RendezvousInfo:
        """The join (``_next_rendezvous``) on the store the handler talks through now, the
        move lock released meanwhile (a membership check of another thread may move)."""
        self._joined_on = self._store
        self._move_lock.release()
        try:
            return self._next_rendezvous()
        finally:
            self._move_lock.acquire()

    def _where(self) -> LiveStore | None:
        """Where the rendezvous is; None when the store changed since the last join."""
        return self._live if self._store is self._joined_on else None

    def _settle(self, live: LiveStore) -> None:
        self._live = live

    def _close_store(self, live: LiveStore) -> None:
        """Closes the connection (a fenced mover's: its next request fails, so it follows
        from ``live``)."""
        self._live = live
        with contextlib.suppress(Exception):
            self._store.close()
