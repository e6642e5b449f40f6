"""How the members of an etcd round learn at once that one of them died.

etcd knows a process is gone only when its lease expires (``lease_ttl``, 3 s, and etcd scans
for expired leases twice a second): a lost node cost the others 3 s more than with the
``c10d`` store, whose server sees the node's connection close. Each round already has such a
server: the workers' store hosted by rank 0's agent (the hub), which every other agent
connects to. So each member opens one more connection to it, and:

* a member's connection closing appends the member's lease to ``fe.etcd.lost`` (a disconnect
  action of the hub's store) and wakes the hub's relay, which revokes that lease in etcd:
  the member's etcd disconnect actions take effect at once (see :mod:`.etcd_kv`), as they
  would when its lease expires;
* the hub's connection closing is seen by every member (its wait fails): they revoke the
  hub's lease (published in ``fe.etcd.hub``); etcd makes that happen once.

Nothing is revoked when a connection ends on purpose: a member that leaves the round first
sets ``fe.etcd.bye/<lease>``; the hub, before it retires its store, records in etcd that the
round's store ends (``fe.etcd.end/<run>/<round>``, read by a member only when its connection
fails) and sets ``fe.etcd.end`` in its store (every member then says bye and stops). A
frozen node keeps its connections: its lease and its keep-alive counters tell.
The lease stays the fallback for everything else (a node lost before the round completed,
the hub and its connection lost at once). The values of ``fe.etcd.hub`` and ``fe.etcd.lost``
are built and parsed in :mod:`..fast._schema`.
"""

from __future__ import annotations

import logging
import threading
from datetime import timedelta
from typing import Any

from fastelastic.errors import StoreConnectionError, StoreError, StoreTimeoutError

from ..fast._schema import encode_lease, encode_lost_lease, parse_lease, parse_lost_leases

__all__ = ["RoundLiveness"]

log = logging.getLogger("fastelastic.rendezvous.etcd_rendezvous")

_HUB = "fe.etcd.hub"
_LOST = "fe.etcd.lost"
_TICK = "fe.etcd.tick"
_BYE = "fe.etcd.bye/"
_END = "fe.etcd.end"
_SLICE = timedelta(seconds=1.0)  # how often a blocked thread checks that it should stop
_MAX_SLICES = 10_000_000  # bound on the slices of one round (~115 days)


class RoundLiveness:
    """This node's liveness link for one round, through the hub's store.

    Args:
        kv: This node's :class:`~.etcd_kv.EtcdKV` (its lease is what others revoke).
        conn: A connection to the hub's store that this object owns from now on (its own:
            a member's disconnect action is tied to it).
        hub: This node is the hub (rank 0, hosting the store).
        tag: Names the round in etcd (``<run>/<round>``) and in log messages.
    """

    def __init__(self, kv: Any, conn: Any, hub: bool, tag: str) -> None:
        self._kv = kv
        self._ended = f"fe.etcd.end/{tag}"
        self._conn = conn
        self._hub = hub
        self._what = f"round {tag}"
        self._stop = threading.Event()
        self._lease = int(kv.lease())
        if hub:
            conn.set(_HUB, encode_lease(self._lease))
            target = self._relay
        else:
            conn.append_on_disconnect_many([_LOST, _TICK], [encode_lost_lease(self._lease), b"1"])
            target = self._watch_hub
        self._thread = threading.Thread(target=self._run, args=(target,), daemon=True,
                                        name="fe-etcd-liveness")
        self._thread.start()

    def stop(self) -> None:
        """Ends the link on purpose: nothing is revoked for it. The hub's returns once etcd
        knows (one write), so it may retire its store right after; a member's at once (its
        thread ends within a slice)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._hub:
            try:
                self._kv.set(self._ended, b"1")
            except StoreError as e:
                log.warning("etcd liveness (%s): could not record the store's end: %s",
                            self._what, e)
        try:
            # The hub: every member stops and says bye. A member: bye before its connection
            # closes, so the hub's relay knows the close is no death.
            self._conn.set(_END if self._hub else f"{_BYE}{self._lease}", b"1")
        except (StoreError, OSError) as e:
            log.debug("etcd liveness (%s): stop: %s", self._what, e)

    def _run(self, target: Any) -> None:
        try:
            target()
        finally:
            try:
                self._conn.close()
            except (StoreError, OSError):
                pass

    def _relay(self) -> None:
        """The hub: each time a member's connection closes, revoke its lease (unless it said
        bye). ``tick`` is deleted before ``lost`` is read, and both are appended together by
        the server: no close is missed, none is polled for."""
        done: set[int] = set()
        conn = self._conn
        for _ in range(_MAX_SLICES):
            if self._stop.is_set():
                return
            try:
                conn.wait([_TICK], _SLICE)
            except StoreTimeoutError:
                continue
            except (StoreError, OSError):
                return  # our store was retired
            try:
                conn.delete_key(_TICK)
                lost = parse_lost_leases(bytes(conn.get(_LOST)))
                for lease in sorted(lost - done):
                    done.add(lease)
                    if self._stop.is_set() or conn.check([f"{_BYE}{lease}"]):
                        continue
                    log.warning("etcd liveness (%s): a member's connection to this node "
                                "closed (its process is gone); ending its etcd lease %d",
                                self._what, lease)
                    self._revoke(lease)
            except (StoreError, OSError, ValueError) as e:
                if not self._stop.is_set():
                    log.warning("etcd liveness (%s): relay stopped: %s", self._what, e)
                return

    def _watch_hub(self) -> None:
        """A member: blocked on the hub's store until it ends on purpose (``end``) or its
        connection fails (the hub's process is gone: revoke its lease)."""
        conn = self._conn
        hub: int | None = None
        try:
            for _ in range(_MAX_SLICES):
                if self._stop.is_set():
                    return
                try:
                    if hub is None:
                        hub = parse_lease(bytes(conn.get(_HUB, _SLICE)))
                    conn.wait([_END], _SLICE)
                    conn.set(f"{_BYE}{self._lease}", b"1")  # the hub retires its store
                    return
                except StoreTimeoutError:
                    continue
        except (StoreConnectionError, ConnectionError, OSError) as e:
            if self._stop.is_set():
                return
            if hub is None:
                log.warning("etcd liveness (%s): lost the hub before it said who it is: %s",
                            self._what, e)
                return
            try:
                if self._kv.check([self._ended]):
                    return  # the hub retired this round's store: it lives on
            except StoreError as e2:
                log.warning("etcd liveness (%s): %s", self._what, e2)
                return
            log.warning("etcd liveness (%s): the connection to rank 0's store failed (%s): its "
                        "process is gone; ending its etcd lease %d", self._what, e, hub)
            self._revoke(hub)
        except (StoreError, ValueError) as e:  # not a lost connection: just stop watching
            log.warning("etcd liveness (%s): stopped watching rank 0: %s", self._what, e)
            self.stop()

    def _revoke(self, lease: int) -> None:
        try:
            self._kv.revoke(lease)
        except StoreError as e:
            log.warning("etcd liveness (%s): could not end lease %d: %s", self._what, lease, e)
