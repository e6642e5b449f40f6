"""The fast rendezvous on fastelastic's TCPStore: O(1) store messages per node, no hot key.

Protocol (keys under ``fe.rdzv.<run_id>/``; round ``r`` keys under ``<r>/``):

* ``open``: hint of the round new nodes should join (set by each round's publisher).
* ``closed``: exists once the rendezvous is closed.
* ``<r>/t``: ticket counter. A node's ``add(t, 1)`` is its join; tickets above ``max_nodes``
  mean the round is full and the node waits in round ``r + 1`` (counted by
  ``num_nodes_waiting`` of the members of ``r``). The last-call coordinator seals the round with
  ``add(t, SEAL)``: the returned value minus ``SEAL`` is the final count and every later ticket
  is above ``SEAL``.
* ``<r>/n/<ticket>``: the node's record (``pref|addr|pid|workers' store address``), set
  with one ``multi_set``, with ``<r>/rank/<ticket>`` = ``-1`` and ``<r>/hb/t<ticket>``.
* ``<r>/res``: the round's outcome, decided by one ``compare_set`` from absent:
  ``M<world>\\n<rank 0's workers' store address>\\n`` (complete) — or, when a joined
  node's connection closes first, ``D;`` appended by the server (``append_on_disconnect``), or
  ``D;`` set by a node that found a deciding ticket's holder lost: the round is abandoned and
  everyone re-joins ``r + 1``. A ``C;`` appended by ``set_closed`` wakes waiters with
  :class:`RendezvousClosedError`. Text after the first newline is ignored, so late appends
  never corrupt a complete outcome.
* ``<r>/rank/<ticket>``: the node's seat, written by the publisher (one ``multi_set``)
  before it decides ``res``: ``<rank>|<tickets of the peers it watches>``, or the node's own
  ``-1`` when it was not admitted. ``<r>/who/<rank>``: ``<ticket>|<record>`` of each member.
  A waiting node reads ``res`` with one request (a ``get`` that waits) and then its seat:
  two requests and O(1) bytes whatever the world size.
* ``<r>/left/<rank>``: set when a member of complete round ``r`` re-joins, or by the server
  when its connection closes. The next round completes only after every member of the last
  complete round left (torch's semantics: waiting nodes are admitted at re-rendezvous).
* ``<r>/hb/t<ticket>``: the node's keep-alive counter, bumped every ``keep_alive_interval``
  from the moment it took its ticket (created with its record).
* ``<r>/gone``: created empty by the publisher; ``<rank>:closed;`` is appended by the server
  when a member's connection closes (process death, or a cut link ended by TCP keep-alive),
  ``<rank>:done;`` by a member whose workers finished (its later exit is no loss),
  ``<rank>:silent;`` by a member that saw a peer's counter stand still for
  ``keep_alive_interval * keep_alive_max_attempt`` (frozen or hung). Every member reads it and
  its peers' counters with one ``multi_get`` per membership check (:py:meth:`lost_members`).

A ticket whose record does not appear within that window (a node lost between its ticket and
its record, or a stray client) is dropped from the round; the round completes with the others
when they are at least ``min_nodes``, else it is abandoned.

Roles come from the ticket, so nobody races: ticket ``max_nodes`` publishes at once; ticket
``min_nodes`` waits ``last_call`` then seals and publishes; everyone else waits on ``res``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Literal

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousMemberLostError,
    RendezvousStateError,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)
from fastelastic.events import NodeState, construct_and_record_rdzv_event

from ._liveness import BEATER, Beats
from ._store_hosting import host_store, token_from
from ._worker_store import WorkerStoreHost
from .api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from .timeouts import RendezvousTimeout, timeout_from_params
from .utils import parse_rendezvous_endpoint

__all__ = ["FastRendezvousHandler", "assign_ranks", "create_fast_handler"]

log = logging.getLogger(__name__)

DEFAULT_PORT = 29400
_SEAL = 1 << 40
_SLICE = 1.0  # seconds: how often a publisher blocked on a dead joiner's record re-checks res
_MAX_WALK = 10_000  # bound on rounds walked forward/back
_LINGER_S = 10.0  # at most this long the host's store outlives its own shutdown
_MAX_WATCHED = 8  # peers whose keep-alive counters a member reads per membership check
DEFAULT_KEEP_ALIVE_INTERVAL = 1.0  # seconds
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5  # detection window: interval * attempts = 5 s (torch: 15 s)


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


def _seat(raw: bytes) -> tuple[int, list[bytes]]:
    """A node's ``rank/<ticket>``: (rank or -1, tickets of the peers it watches)."""
    head, _, peers = raw.partition(b"|")
    try:
        return int(head), peers.split(b",") if peers else []
    except ValueError as e:
        raise RendezvousStateError(f"corrupt rank {raw[:40]!r}") from e


class _Watch:
    """What a member of a complete round reads to notice a lost peer (see ``lost_members``)."""

    def __init__(self, prefix: str, rank: int, world: int, peer_tickets: list[bytes],
                 window: float, slack: float) -> None:
        self.prefix = prefix
        self.rank = rank
        self.peers = [(rank + k) % world for k in range(1, len(peer_tickets) + 1)]
        self.keys = [prefix + "gone"] + [f"{prefix}hb/t{t.decode()}" for t in peer_tickets]
        self.beats = Beats(window, slack)  # keyed by rank
        self.reported: set[int] = set()


_Last = tuple[int, int]  # the last complete round: (round, world)


def _wait(store: Any, keys: list[str], seconds: float) -> bool:
    """One slice of a wait: True once every key is set, False after ``seconds``.

    Every wait loop of the protocol is made of these slices, so a loop re-checks what it must
    (a lost decider, a decided round, the rendezvous closed) at its own pace. Keep-alives do
    not depend on it: they never queue behind a wait (see ``KVClient``).
    """
    try:
        store.wait(keys, timedelta(seconds=max(seconds, 0.001)))
        return True
    except StoreTimeoutError:
        return False


class _Deciders:
    """What a ticket holder waiting for round ``r``'s outcome checks each quarter window: the
    holders of the deciding tickets (``min_nodes``: last call; ``max_nodes``: publish) have
    a record and a moving keep-alive counter. One request per check once their records are
    seen (a ``multi_get`` of their counters)."""

    def __init__(self, handler: FastRendezvousHandler, r: int, ticket: int) -> None:
        self.h = handler
        self.p = f"{handler._key}{r}/"
        self.r = r
        self.roles = [x for x in sorted({handler._min, handler._max}) if x != ticket]
        self.recorded: set[int] = set()
        self.count = 0
        self.seen = Beats(handler._window, handler._ka_interval / 2)

    def stalled(self) -> bool:
        h, store, p = self.h, self.h._store, self.p
        if any(role > self.count for role in self.roles):
            self.count = int(store.add(p + "t", 0))
            if self.count >= _SEAL:  # sealed: the coordinator is publishing
                self.count -= _SEAL
        roles = [x for x in self.roles if x <= self.count]
        states: dict[int, Any] = {}
        for role in roles:
            if role not in self.recorded:
                if not store.check([f"{p}n/{role}"]):
                    states[role] = -1
                    continue
                self.recorded.add(role)
        known = [x for x in roles if x in self.recorded]
        if known:
            vals = store.multi_get([f"{p}hb/t{x}" for x in known])
            states.update((x, bytes(v)) for x, v in zip(known, vals, strict=True))
        stalled = self.seen.observe(states)
        for role, still in stalled.items():
            why = "no record" if states[role] == -1 else "no keep-alive"
            log.warning("rendezvous %s round %d: the node holding ticket %d (%s for %.1fs) is "
                        "lost; abandoning the round", h._run_id, self.r, role, why, still)
        return bool(stalled)


def _on_disconnect(store: Any, keys: list[str], values: list[bytes]) -> None:
    """Registers disconnect actions in one round trip where the client can pipeline them."""
    many = getattr(store, "append_on_disconnect_many", None)
    if many is not None:
        many(keys, values)
        return
    for k, v in zip(keys, values, strict=True):
        store.append_on_disconnect(k, v)


def _wstore_of(raw: bytes) -> bytes:
    """Rank 0's workers' store address, on the second line of a complete outcome (or b"")."""
    parts = raw.split(b"\n", 2)
    return parts[1] if len(parts) > 2 else b""


def _outcome(raw: bytes) -> tuple[str, int]:
    """Parses ``res``: ('M', count) complete, ('C', 0) closed, ('D', 0) abandoned."""
    if raw.startswith(b"M"):
        head = raw.split(b"\n", 1)[0]
        try:
            return "M", int(head[1:])
        except ValueError as e:
            raise RendezvousStateError(f"corrupt rendezvous outcome {raw[:40]!r}") from e
    if b"C" in raw.split(b"\n", 1)[0]:
        return "C", 0
    if raw.startswith(b"D"):
        return "D", 0
    raise RendezvousStateError(f"corrupt rendezvous outcome {raw[:40]!r}")


class FastRendezvousHandler(RendezvousHandler):
    """Rendezvous handler implementing the ticket protocol described in this module.

    Args:
        run_id: The run id of the rendezvous.
        store: A fastelastic ``TCPStore`` client owned by this handler (its connection is this
            node's liveness; use one per node).
        backend_name: Name reported by :py:meth:`get_backend`.
        min_nodes: Minimum number of nodes.
        max_nodes: Maximum number of nodes.
        timeout: Join, last-call, close and heartbeat timeouts.
        local_addr: This node's address (informational).
        node_rank: Preferred rank of this node (-1 for none).
        keep_alive_interval: Seconds between keep-alive counter bumps (default 1).
        keep_alive_max_attempt: Missed keep-alives after which a silent node is dropped
            (default 5: a frozen or hung node is noticed within 5 s).
        bootstrap_addr: Host workers use to reach the store (``MASTER_ADDR``).
        server: The hosting store object when this node hosts, kept alive with the handler.
        reform_last_call: Wait ``last_call`` also when a round re-forms after a complete one
            (torch's behaviour); by default such a round is sealed once every member of the
            last one is back or lost.

    Raises:
        ValueError: Bad run id or node counts.
    """

    def __init__(
        self,
        run_id: str,
        store: Any,
        backend_name: str,
        min_nodes: int,
        max_nodes: int,
        timeout: RendezvousTimeout | None = None,
        local_addr: str | None = None,
        node_rank: int = -1,
        keep_alive_interval: float = DEFAULT_KEEP_ALIVE_INTERVAL,
        keep_alive_max_attempt: int = DEFAULT_KEEP_ALIVE_MAX_ATTEMPT,
        bootstrap_addr: str | None = None,
        server: Any = None,
        reform_last_call: bool = False,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(
                f"The minimum number of nodes ({min_nodes}) must be greater than zero."
            )
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({max_nodes}) must be greater than or equal to the "
                f"minimum number of nodes ({min_nodes})."
            )
        if keep_alive_interval <= 0 or keep_alive_max_attempt < 1:
            raise ValueError("keep_alive_interval must be > 0 and keep_alive_max_attempt >= 1.")
        self._run_id = run_id
        self._store = store
        self._server = server
        self._backend_name = backend_name
        self._min = min_nodes
        self._max = max_nodes
        self._timeout = timeout or RendezvousTimeout()
        self._local_addr = local_addr or ""
        self._node_rank = node_rank
        self._ka_interval = float(keep_alive_interval)
        self._ka_max = keep_alive_max_attempt
        self._window = self._ka_interval * keep_alive_max_attempt
        self._watch: _Watch | None = None
        self._prev_watch: _Watch | None = None  # the last round's, for _drain
        self._bootstrap_addr = str(bootstrap_addr or getattr(store, "host", "localhost"))
        self._hooks = bool(getattr(store, "supports_extensions", False))
        self._key = f"fe.rdzv.{run_id}/"
        self._member: tuple[int, int, int] | None = None  # (round, rank, world)
        self._last_seen: _Last | None = None  # see _last_complete
        self._reform_last_call = reform_last_call
        self._waited_as_spare = False  # this node waited behind a full, running round
        self._leaving = False  # this node re-joins: tell its last round once it has a ticket
        self._spare_ready = False  # a node waits behind this node's full round
        self._spare_window = max(2 * self._ka_interval, self._window / 2)
        self._lock = threading.Lock()  # held by the thread inside next_rendezvous
        self._owner: int | None = None  # that thread's id
        self._side_lock = threading.Lock()
        self._side: Any = None
        self._wstore = WorkerStoreHost(self._local_addr)

    # ------------------------------------------------------------------ RendezvousHandler

    def get_backend(self) -> str:
        """See base class."""
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        """See base class: workers share the agent's store (``MASTER_ADDR``/``MASTER_PORT``)."""
        return os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") != "1"

    @property
    def store(self) -> Any:
        """The store client this handler talks through."""
        return self._store

    @property
    def store_prefix(self) -> str | None:
        """Key prefix of the store returned by the last :py:meth:`next_rendezvous` (per round)."""
        if self._member is None:
            return None
        return f"torch.rendezvous.{self._run_id}.{self._member[0]}"

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        self._record(f"joining the next round of rendezvous '{self._run_id}'", NodeState.RUNNING)
        with self._lock:
            self._owner = threading.get_ident()
            try:
                info = self._next_rendezvous()
            except (StoreConnectionError, ConnectionError) as e:
                self._record(f"{type(e).__name__}: {e}", NodeState.FAILED)
                raise RendezvousConnectionError(
                    f"The connection to the rendezvous store of run '{self._run_id}' failed: {e}"
                ) from e
            except BaseException as e:
                self._stop_heartbeats()
                self._record(f"{type(e).__name__}: {e}", NodeState.FAILED)
                raise
            finally:
                self._owner = None
        self._record(f"joined round {self._member[0] if self._member else -1} as rank "
                     f"{info.rank} of {info.world_size}", NodeState.SUCCEEDED, info.rank)
        return info

    def _record(self, message: str, state: NodeState, rank: int | None = None) -> None:
        construct_and_record_rdzv_event(
            run_id=self._run_id, message=message, node_state=state,
            name=f"{type(self).__name__}.next_rendezvous", hostname=self._local_addr,
            master_endpoint=self._bootstrap_addr, rank=rank,
        )

    @contextlib.contextmanager
    def _conn(self) -> Iterator[Any]:
        """The connection for one call that expects a reply.

        The thread inside :py:meth:`next_rendezvous` uses the handler's own connection. So
        does any other thread while no rendezvous is under way (it holds ``_lock`` for the
        call, so a rendezvous starting meanwhile waits for it, never the other way round).
        While one is under way its connection may be blocked in a long wait, so the others use
        a second connection, made once, on first need (shutdown and the agent's checks during
        a rendezvous: rare). Keep-alives need neither: they are fire-and-forget writes, which
        go out on the busy connection without waiting (see ``KVClient``).
        """
        if self._owner == threading.get_ident():
            yield self._store
            return
        if self._lock.acquire(blocking=False):
            try:
                yield self._store
            finally:
                self._lock.release()
            return
        with self._side_lock:
            if self._side is None:
                clone = getattr(self._store, "clone", None)
                self._side = clone() if clone is not None else self._store
            side = self._side
        yield side

    def is_closed(self) -> bool:
        """See base class."""
        with self._conn() as store:
            return bool(self._call(store.check, [self._key + "closed"]))

    def set_closed(self) -> None:
        """See base class: sets ``closed`` and wakes every node waiting in a forming round."""
        with self._conn() as store:
            self._call(store.set, self._key + "closed", b"1")
            cur = int(self._call(store.add, self._key + "open", 0))
            rounds = {cur, cur + 1}
            if self._member is not None:
                rounds.add(self._member[0] + 1)
            for r in sorted(rounds):
                self._call(store.append, f"{self._key}{r}/res", b"C;")
            if self._member is not None:  # wakes the spares waiting behind our round at once
                self._call(store.append, f"{self._key}{self._member[0]}/broken", b"C")

    def num_nodes_waiting(self) -> int:
        """See base class: the tickets taken in the round after this node's round.

        A full round (``max_nodes`` members) has room for nobody: the nodes waiting behind it
        are spares (torch's redundancy list) and count as none, so they never restart it. A
        member of it that re-joins is reported by :py:meth:`lost_members` instead, which,
        while a spare is ready, calls a peer silent after ``max(2 intervals, window / 2)``
        rather than the whole window: a false suspicion then costs a restart, not a seat.
        """
        member = self._member
        if member is None:
            return 0
        with self._conn() as store:
            v = int(self._call(store.add, f"{self._key}{member[0] + 1}/t", 0))
        v = v - _SEAL if v >= _SEAL else v
        if member[2] >= self._max:
            self._spare_ready = v > 0
            return 0
        return v

    def get_run_id(self) -> str:
        """See base class."""
        return self._run_id

    def lost_members(self) -> list[tuple[int, str]]:
        """Members of this node's round lost since the last call: ``[(rank, why), ...]``.

        One ``multi_get`` of ``<round>/gone`` and the keep-alive counters of up to
        ``_MAX_WATCHED`` peers (the next ranks, round-robin). A peer whose counter stood still
        for the detection window is published as silent for everyone. ``why`` names the node
        (address, pid) and says dead (connection closed), cut (heartbeats stopped, then the
        connection timed out) or silent (connected, no heartbeat: frozen or hung). This node's
        own rank is listed when the others dropped it.
        """
        w = self._watch
        if w is None:
            return []
        with self._conn() as store:
            return self._lost_members(w, store)

    def _lost_members(self, w: _Watch, store: Any) -> list[tuple[int, str]]:
        vals = [bytes(v) for v in self._call(store.multi_get, w.keys)]
        now = time.monotonic()
        gone = _parse_gone(vals[0])
        silent = w.beats.observe(dict(zip(w.peers, vals[1:], strict=True)), now)
        if self._spare_ready:  # a spare can take a silent peer's seat: suspect it sooner
            short = self._spare_window
            silent.update((rank, now - since) for rank, (_, since) in w.beats.since.items()
                          if rank not in silent and now - since >= short)
        for rank, still in silent.items():
            if rank not in gone:
                log.warning("rendezvous %s: rank %d sent no keep-alive for %.1fs; dropping it",
                            self._run_id, rank, still)
                self._call(store.append, w.prefix + "gone", b"%d:silent;" % rank)
                self._call(store.multi_set, [f"{w.prefix}left/{rank}", w.prefix + "broken"],
                           [b"silent", b"1"])
                gone[rank] = "silent"
        fresh = [(r, why) for r, why in gone.items() if r not in w.reported and why != "done"]
        if not fresh:
            return []
        w.reported.update(r for r, _ in fresh)
        records = self._call(store.multi_get, [f"{w.prefix}who/{r}" for r, _ in fresh])
        out = []
        for (rank, why), rec in zip(fresh, records, strict=True):
            _, _, addr, pid = (bytes(rec).decode("utf-8", "replace").split("|") + ["", ""])[:4]
            stale = now - w.beats.since[rank][1] if rank in w.beats.since else 0.0
            if why == "closed":
                text = (f"cut: no keep-alive for {stale:.1f}s, then its connection timed out"
                        if stale >= 2 * self._ka_interval else "dead: its connection closed")
            elif why == "left":
                text = "left the round: it is re-joining (its workers restarted)"
            elif self._spare_ready:
                text = (f"silent: connected but no keep-alive for {self._spare_window:g}s "
                        "(frozen or hung; a spare is ready)")
            else:
                text = (f"silent: connected but no keep-alive for {self._window:g}s "
                        "(frozen or hung)")
            who = "this node" if rank == w.rank else f"node {addr or '?'} (pid {pid or '?'})"
            out.append((rank, f"{who} {text}"))
        return out

    def mark_done(self) -> None:
        """Tells the other members that this node finished its work (its workers succeeded).

        Its connection closing or its keep-alives stopping later is then no loss: a node that
        leaves the exit barrier early does not make the others restart their workers.
        """
        w = self._watch
        if w is not None:  # fire-and-forget: never waits for the connection
            self._call(self._store.append, w.prefix + "gone", b"%d:done;" % w.rank)

    def leave(self) -> None:
        """Tells the members of this node's round that it is leaving for good (preempted:
        SIGTERM/SIGINT), without closing the rendezvous for them.

        Fire-and-forget writes, as a re-join announces itself (``left/<rank>``, ``broken``,
        ``<rank>:left;`` in ``gone``): the others see it at their next membership check and
        re-form at once, instead of waiting for this node's connection to close.
        """
        self._stop_heartbeats()
        if self._member is not None:
            self._leaving = True
            try:
                self._leave_last_round()
            except (StoreError, ConnectionError) as e:
                log.warning("rendezvous %s: could not announce leaving: %s", self._run_id, e)

    def wait_members(self, store: Any, keys: list[str], deadline: float) -> None:
        """Waits for ``keys`` (written by other members) unless a member is lost first.

        Raises:
            RendezvousMemberLostError: a member of this node's round was lost.
            RendezvousTimeoutError: ``deadline`` (monotonic) passed.
        """
        slice_s = max(0.05, min(self._ka_interval, 1.0))
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RendezvousTimeoutError(f"timed out waiting for {keys[:3]} of other members")
            if _wait(store, keys, min(slice_s, remaining)):
                return
            lost = self.lost_members()
            if lost:
                raise RendezvousMemberLostError(lost)

    def shutdown(self) -> bool:
        """See base class: stops keep-alives and closes the rendezvous."""
        self._stop_heartbeats()
        self._wstore.close()
        try:
            self.set_closed()
        except (RendezvousConnectionError, StoreError) as e:
            log.warning("rendezvous %s: shutdown could not close: %s", self._run_id, e)
            return False
        self._linger()
        return True

    def _linger(self) -> None:
        """As the store's host, keeps it up (bounded) until the other nodes have gone, when
        some wait for a next round (spares): they leave as soon as they read that the
        rendezvous closed, and were the store to go first they would see a failure instead.
        """
        server = getattr(self._server, "server", None)
        member = self._member
        if server is None or member is None:
            return
        try:  # only nodes waiting for a next round need to read the end (a lost one never will)
            if not int(self._store.add(f"{self._key}{member[0] + 1}/t", 0)):
                return
        except StoreError:
            return
        own = 1 + (self._side is not None and self._side is not self._store)
        until = time.monotonic() + min(_LINGER_S, self._timeout.close.total_seconds())
        while server.num_connections > own and time.monotonic() < until:
            time.sleep(0.01)  # bounded: the server has no "connections dropped to N" event

    # ------------------------------------------------------------------ protocol

    def _call(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except (StoreConnectionError, ConnectionError) as e:
            raise RendezvousConnectionError(
                f"The connection to the rendezvous store of run '{self._run_id}' failed: {e}"
            ) from e

    def _next_rendezvous(self) -> RendezvousInfo:
        store = self._store
        deadline = time.monotonic() + self._timeout.join.total_seconds()
        self._stop_heartbeats()
        self._waited_as_spare = self._spare_ready = False
        self._prev_watch, self._watch = self._watch, None
        if store.check([self._key + "closed"]):
            raise RendezvousClosedError(f"The rendezvous '{self._run_id}' is closed.")
        if self._member is not None:
            r = self._member[0] + 1
            self._leaving = True
        else:
            r = int(store.add(self._key + "open", 0))
        for _ in range(_MAX_WALK):
            if time.monotonic() > deadline:
                break
            got = self._try_round(r, deadline)
            if got is not None:
                rank, world, peers, wstore = got
                self._member = (r, rank, world)
                p = f"{self._key}{r}/"
                if self._hooks:  # our death: we left, the round is over, and why
                    _on_disconnect(store, [p + "left/%d" % rank, p + "broken", p + "gone"],
                                   [b"1", b"1", b"%d:closed;" % rank])
                self._watch = _Watch(p, rank, world, peers, self._window, self._ka_interval / 2)
                round_store, boot = self._round_store(r, rank, wstore)
                return RendezvousInfo(round_store, rank, world, boot)
            r += 1
        raise RendezvousTimeoutError(
            f"The rendezvous '{self._run_id}' did not complete within {self._timeout.join}."
        )

    def _round_store(self, r: int, rank: int,
                     wstore: bytes = b"") -> tuple[Any, RendezvousStoreInfo]:
        """The agents' store (prefixed per round) and the workers' store address."""
        round_store = _prefix_store(str(self.store_prefix), self._store)
        if not self.use_agent_store:
            # torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0's workers host their own.
            return round_store, RendezvousStoreInfo.build(rank, round_store, self._local_addr)
        return round_store, self._worker_store_info(r, rank, self._store, wstore)

    def _worker_store_info(self, r: int, rank: int, meet: Any,
                           addr: bytes = b"") -> RendezvousStoreInfo:
        """The workers' store of round ``r`` (see :mod:`._worker_store`): rank 0 hosts it.

        ``addr`` is rank 0's announced address, from the round's outcome. Without one (a
        round decided by an older node) rank 0 publishes it through ``meet`` with one
        ``set`` and the others read it with one ``get``. ``MASTER_ADDR`` is rank 0's
        ``local_addr``, else its FQDN, as torch publishes it.
        """
        ws = self._wstore
        if rank == 0:
            ws.host(self._store.timeout)
            if not addr:
                addr = f"{ws.addr}:{ws.server.port}".encode()
                meet.set(f"{self._key}{r}/wstore", addr)
        else:
            ws.retire()
            if not addr:
                key = f"{self._key}{r}/wstore"
                self.wait_members(meet, [key],
                                  time.monotonic() + self._store.timeout.total_seconds())
                addr = bytes(meet.get(key))
        host, _, port = addr.decode().rpartition(":")
        return RendezvousStoreInfo(host, int(port))

    @property
    def _worker_server(self) -> Any:
        return self._wstore.server

    def _retire_worker_store(self) -> None:
        """Stops the previous round's worker store (its workers were stopped before re-joining)."""
        self._wstore.retire()

    def _leave_last_round(self) -> None:
        """Tells the members of this node's last round that it left (it is re-joining).

        Fire-and-forget writes: ``left/<rank>`` (what the next round's coordinator waits
        for), ``broken`` (the round is over: a next round may form) and ``<rank>:left;`` in
        ``gone`` (the other members restart their workers at their next membership check).
        """
        if self._member is None or not self._leaving:
            return
        self._leaving = False
        q, rank, _ = self._member
        p = f"{self._key}{q}/"
        self._store.multi_set([f"{p}left/{rank}", p + "broken"], [b"1", b"1"])
        self._store.append(p + "gone", b"%d:left;" % rank)

    def _try_round(self, r: int, deadline: float) -> tuple[int, int, list[bytes], bytes] | None:
        """Joins round ``r``; (rank, world, the watched peers' tickets, workers' store address)
        or None to move on to ``r + 1``."""
        store = self._store
        p = f"{self._key}{r}/"
        t = int(store.add(p + "t", 1))
        # Only now that our ticket is counted: a coordinator that sees every member of the
        # last round back seals at once, and must not seal before our ticket.
        self._leave_last_round()
        if t > self._max:  # full or sealed: wait in the next round
            return None
        if self._hooks:  # our death abandons the round while it forms
            store.append_on_disconnect(p + "res", b"D;")
        pref = self._member[1] if self._member is not None else self._node_rank
        # The record; a placeholder for our seat (rank), which the publisher overwrites before
        # it decides res; and the keep-alive counter, bumped from the ticket on.
        store.multi_set(
            [f"{p}n/{t}", f"{p}rank/{t}", f"{p}hb/t{t}"],
            [b"%d|%s|%d|%s" % (pref, self._local_addr.encode(), os.getpid(),
                                self._wstore.address() if self.use_agent_store else b""),
             b"-1", b"0"])
        BEATER.add(self, f"{p}hb/t{t}")
        if t == self._max:
            self._publish(r, self._max, deadline)
        elif t == self._min:
            self._coordinate(r, deadline)
        kind, count, raw = self._wait_outcome(r, deadline, ticket=t)
        if kind == "C":
            raise self._closed_error(r)
        if kind == "D":
            log.info("rendezvous %s round %d abandoned (a node left); re-joining", self._run_id, r)
            return None
        rank, peers = _seat(bytes(store.get(f"{p}rank/{t}")))
        if rank < 0:  # not admitted (round full, or our record came too late)
            return None
        return rank, count, peers, _wstore_of(raw)

    def _closed_error(self, r: int) -> RendezvousError:
        """Closed: a spare (waiting behind a full round) exits gracefully, as torch's does."""
        if self._waited_as_spare or self._spare(r):
            return RendezvousGracefulExitError(
                f"The rendezvous '{self._run_id}' is closed; this node waited as a spare.")
        return RendezvousClosedError(f"The rendezvous '{self._run_id}' is closed.")

    def _spare(self, r: int) -> bool:
        """True while the last round before ``r`` is complete, full and not over: a node
        waiting for ``r`` is then a spare (torch's redundancy list), whom no join timeout
        applies to."""
        last = self._last_complete(r, time.monotonic() + _SLICE)
        return (last is not None and last[1] >= self._max
                and not self._store.check([f"{self._key}{last[0]}/broken"]))

    def _wait_outcome(self, r: int, deadline: float, mine: bool = True,
                      ticket: int = 0) -> tuple[str, int, bytes]:
        """Round ``r``'s outcome: (kind, world, raw res).

        A node holding ``ticket`` checks every quarter window that the holders of the
        deciding tickets (``min_nodes``: last call; ``max_nodes``: publish) are alive, and
        abandons the round when one is not (no record: a stray or a node lost right after its
        ticket; its keep-alive stood still for a window: frozen or hung). A spare's join
        timeout starts only when the full round it waits behind is over.
        """
        key = f"{self._key}{r}/res"
        watch = _Deciders(self, r, ticket) if ticket else None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if mine and self._spare(r):
                    self._waited_as_spare = True
                    deadline = time.monotonic() + self._timeout.join.total_seconds()
                    continue
                if mine:  # give up our ticket: nobody may count this node in the round any more
                    self._store.append(key, b"D;")
                raise RendezvousTimeoutError(
                    f"The rendezvous '{self._run_id}' did not complete within "
                    f"{self._timeout.join}."
                )
            step = remaining if watch is None else min(remaining, self._window / 4)
            try:  # one round trip, whether res is there or comes later
                raw = bytes(self._store.get(key, timedelta(seconds=max(step, 0.001))))
                return (*_outcome(raw), raw)
            except StoreTimeoutError:
                pass
            if watch is not None and watch.stalled():
                self._store.compare_set(key, "", b"D;")

    def _res_exists(self, r: int) -> bool:
        return bool(self._store.check([f"{self._key}{r}/res"]))

    def _after_last_round(self, r: int,
                          deadline: float) -> tuple[_Last | None, float] | Literal[False]:
        """Before a decider decides ``r``: waits until the last complete round is over.

        While it runs, everyone waiting for ``r`` is a spare, and a round of spares must not
        form beside it (two worlds); it is over once a member of it left or was lost
        (``broken``). Returns the last complete round (round, world; None if there is none)
        and the deadline to keep, or False if ``r`` got decided meanwhile (closed or
        abandoned). A spare waits without a deadline; its join timeout counts from the moment
        the round is over.
        """
        last = self._last_complete(r, deadline)
        if last is None:
            return None, deadline
        key = f"{self._key}{last[0]}/broken"
        waited = False
        while True:
            try:  # one round trip: wait, and read why (``C``: the job ended and closed)
                why = bytes(self._store.get(key, timedelta(seconds=_SLICE)))
                break
            except StoreTimeoutError:
                pass
            waited = self._waited_as_spare = True
            if self._res_exists(r):
                return False
        if waited:
            # The job ended (closed, or a member finished its work and left): spares go home
            # before the job's store does.
            if b"C" in why or "done" in _parse_gone(
                    bytes(self._store.get(f"{self._key}{last[0]}/gone"))).values():
                raise self._closed_error(r)
            deadline = time.monotonic() + self._timeout.join.total_seconds()
        return last, deadline

    def _coordinate(self, r: int, deadline: float) -> None:
        """Ticket ``min_nodes``: drain, last call, seal, publish.

        A round that re-forms after a complete one needs no last call: once every member of
        that round is back (or lost), nobody else is expected, and a node that comes later
        joins the next round (``--rdzv-conf reform_last_call=1`` keeps torch's wait).
        """
        store = self._store
        gate = self._after_last_round(r, deadline)
        if gate is False:
            return
        last, deadline = gate
        if last is not None and not self._drain(r, last, deadline):
            return
        if last is None or self._reform_last_call:
            last_call = min(self._timeout.last_call.total_seconds(),
                            deadline - time.monotonic())
            if last_call >= 0.001 and _wait(store, [f"{self._key}{r}/res"], last_call):
                return  # decided meanwhile (max reached, closed or abandoned)
        count = int(store.add(f"{self._key}{r}/t", _SEAL)) - _SEAL
        if count < self._max:  # at max the max-ticket holder publishes
            self._publish(r, count, deadline, gated=True)

    def _publish(self, r: int, count: int, deadline: float, gated: bool = False) -> None:
        """Decides round ``r`` with ``count`` members: ranks, then one compare_set of res."""
        store = self._store
        p = f"{self._key}{r}/"
        # A full round (max_nodes tickets) has no room for the last round's members still
        # coming, so it waits for nobody once that round is over (a replacement node and the
        # survivors need not wait for a frozen member's window).
        if not gated:
            gate = self._after_last_round(r, deadline)
            if gate is False:
                return
            deadline = gate[1]
        tickets = list(range(1, count + 1))
        drop_at = min(deadline, time.monotonic() + self._window)
        while True:
            remaining = drop_at - time.monotonic()
            if remaining <= 0:  # tickets without a record: lost after their add, or strays
                tickets = [i for i in tickets if store.check([f"{p}n/{i}"])]
                log.warning("rendezvous %s round %d: dropping tickets %s (no record within "
                            "%gs)", self._run_id, r, sorted(set(range(1, count + 1))
                                                            - set(tickets)), self._window)
                break
            if _wait(store, [f"{p}n/{i}" for i in tickets], min(_SLICE, remaining)):
                break
            if self._res_exists(r):  # a joiner died before writing its record
                return
        if len(tickets) < self._min:
            store.compare_set(p + "res", "", b"D;")  # too few left: everyone re-joins r + 1
            return
        prefs = []
        records = [bytes(raw) for raw in store.multi_get([f"{p}n/{i}" for i in tickets])]
        for raw in records:
            try:
                prefs.append(int(raw.split(b"|", 1)[0]))
            except ValueError as e:
                raise RendezvousStateError(f"corrupt node record {raw[:40]!r}") from e
        world = len(tickets)
        ranks = assign_ranks(prefs, world)
        by_rank = [0] * world
        for ticket, rank in zip(tickets, ranks, strict=True):
            by_rank[rank] = ticket
        # O(1) for each node to read: its seat (rank and the tickets of the peers it watches)
        # and, by rank, each member's ticket and record (for reports and the next drain).
        record_of = dict(zip(tickets, records, strict=True))
        watched = min(world - 1, _MAX_WATCHED)
        keys, vals = [p + "gone"], [b""]
        for rank, ticket in enumerate(by_rank):
            peers = b",".join(b"%d" % by_rank[(rank + k) % world] for k in range(1, watched + 1))
            keys += [f"{p}rank/{ticket}", f"{p}who/{rank}"]
            vals += [b"%d|%s" % (rank, peers), b"%d|%s" % (ticket, record_of[ticket])]
        store.multi_set(keys, vals)
        first = record_of[by_rank[0]].split(b"|")
        wstore = first[3] if len(first) > 3 else b""
        blob = b"M%d\n%s\n" % (world, wstore)
        if bytes(store.compare_set(p + "res", "", blob)) == blob:
            store.set(self._key + "open", b"%d" % (r + 1))

    def _last_complete(self, r: int, deadline: float) -> _Last | None:
        """Walks back from ``r - 1`` to the last complete round: (round, world)."""
        cached = self._last_seen
        if cached is not None and cached[0] < r and cached[0] >= r - 1:
            return cached
        for q in range(r - 1, max(-1, r - 1 - _MAX_WALK), -1):
            kind, count, raw = self._wait_outcome(q, deadline, mine=False)
            if kind == "M":
                self._last_seen = (q, count)
                return self._last_seen
            if kind == "C":
                raise RendezvousClosedError(f"The rendezvous '{self._run_id}' is closed.")
        return None

    def _drain(self, r: int, last: _Last, deadline: float) -> bool:
        """Waits until every member of the last complete round left. False if ``r`` got decided.

        A member whose keep-alive counter stands still for the detection window is dropped
        (frozen, hung or cut off). When this node watched it during that round, the window
        counts from the last change it saw then, not from now. Each check is one
        ``multi_get`` (the round's ``gone`` and the missing members' counters), whatever the
        number of members.
        """
        q, world = last
        pq = f"{self._key}{q}/"
        missing = list(range(world))
        beats = Beats(self._window, self._ka_interval / 2)
        prev = self._prev_watch
        if prev is not None and prev.prefix == pq:
            for rank, (raw, since) in prev.beats.since.items():
                beats.since[rank] = (raw, since)
        step = max(0.05, min(self._window / 4, self._ka_interval / 2))
        tickets: list[str] | None = None
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            if _wait(self._store, [f"{pq}left/{i}" for i in missing], min(step, remaining)):
                return True
            if self._res_exists(r):
                return False
            if tickets is None:  # once: the members' tickets, for their keep-alive counters
                tickets = [bytes(v).split(b"|", 1)[0].decode()
                           for v in self._store.multi_get([f"{pq}who/{i}" for i in range(world)])]
            hb = [f"{pq}hb/t{tickets[i]}" for i in missing]
            vals = [bytes(v) for v in self._store.multi_get([pq + "gone"] + hb)]
            gone = _parse_gone(vals[0])
            counters = {i: v for i, v in zip(missing, vals[1:], strict=True) if i not in gone}
            for rank, still in beats.observe(counters).items():
                log.warning("rendezvous %s: member rank %d of round %d was lost (silent: no "
                            "keep-alive for %.1fs); dropping it", self._run_id, rank, q, still)
                self._store.multi_set([f"{pq}left/{rank}", pq + "broken"], [b"hung", b"1"])
                gone[rank] = "silent"
            missing = [i for i in missing if i not in gone]
        return True

    # ------------------------------------------------------------------ keep-alive

    def _stop_heartbeats(self) -> None:
        BEATER.remove(self)




def _parse_gone(raw: bytes) -> dict[int, str]:
    """``<rank>:<why>;`` entries of ``<round>/gone``: the first reason given for each rank."""
    out: dict[int, str] = {}
    for entry in raw.split(b";"):
        rank, _, why = entry.partition(b":")
        try:
            out.setdefault(int(rank), why.decode("ascii", "replace"))
        except ValueError:
            continue
    return out


def _prefix_store(prefix: str, store: Any) -> Any:
    from fastelastic.store import PrefixStore

    return PrefixStore(prefix, store)


def create_fast_handler(params: RendezvousParameters) -> FastRendezvousHandler:
    """Creates the ``c10d``/``fastelastic`` handler from :class:`RendezvousParameters`.

    ``rdzv_conf`` keys: ``join_timeout``, ``last_call_timeout``, ``close_timeout``,
    ``heartbeat``, ``keep_alive_interval``, ``keep_alive_max_attempt``, ``read_timeout``
    (store operations, default 60 s), ``is_host`` (default: the endpoint host is this machine),
    ``rank`` (preferred node rank), ``reform_last_call`` (wait ``last_call_timeout`` also when
    a round re-forms after a complete one, as torch does; default off), ``token_file`` (a
    shared secret guarding the rendezvous store; default ``$FASTELASTIC_STORE_TOKEN_FILE``).

    Raises:
        ValueError: A malformed option.
        RendezvousConnectionError: The store cannot be hosted or reached.
    """
    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    timeout = timeout_from_params(params)
    read_timeout = timedelta(seconds=params.get_as_int("read_timeout", 60) or 60)
    if read_timeout <= timedelta(0):
        raise ValueError("The read timeout must be positive.")
    try:
        keep_alive_interval = float(params.get("keep_alive_interval",
                                               DEFAULT_KEEP_ALIVE_INTERVAL))
    except (TypeError, ValueError) as e:
        raise ValueError("The rendezvous configuration option 'keep_alive_interval' must be a "
                         "number of seconds.") from e
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt",
                                               DEFAULT_KEEP_ALIVE_MAX_ATTEMPT)
    if keep_alive_max_attempt is None:
        raise ValueError("keep_alive_max_attempt must not be None.")
    rank = params.get_as_int("rank", -1)
    reform_last_call = bool(params.get_as_bool("reform_last_call", False))
    client, server = host_store(host, port, params.get_as_bool("is_host"), read_timeout,
                                token_from(params))
    return FastRendezvousHandler(
        params.run_id,
        client,
        params.backend,
        params.min_nodes,
        params.max_nodes,
        timeout,
        local_addr=params.local_addr,
        node_rank=-1 if rank is None else rank,
        keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
        bootstrap_addr=host,
        server=server,
        reform_last_call=reform_last_call,
    )
