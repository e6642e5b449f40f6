"""The fast rendezvous on fastelastic's TCPStore: O(1) store messages per node, no hot key.

Protocol (keys under ``fe.rdzv.<run_id>/``; round ``r`` keys under ``<r>/``):

* ``open``: hint of the round new nodes should join (set by each round's publisher).
* ``closed``: exists once the rendezvous is closed.
* ``<r>/t``: ticket counter. A node's ``add(t, 1)`` is its join; tickets above ``max_nodes``
  mean the round is full and the node waits in round ``r + 1`` (counted by
  ``num_nodes_waiting`` of the members of ``r``). The last-call coordinator seals the round with
  ``add(t, SEAL)``: the returned value minus ``SEAL`` is the final count and every later ticket
  is above ``SEAL``.
* ``<r>/n/<ticket>``: the node's record (preferred rank), set with one ``multi_set``.
* ``<r>/res``: the round's outcome, decided by one ``compare_set`` from absent:
  ``M<world>\\n<ticket of rank 0>,<ticket of rank 1>,...\\n`` (complete) — or, when a joined
  node's connection closes first, ``D;`` appended by the server (``append_on_disconnect``), or
  ``D;`` set by a node that found a deciding ticket's holder lost: the round is abandoned and
  everyone re-joins ``r + 1``. A ``C;`` appended by ``set_closed`` wakes waiters with
  :class:`RendezvousClosedError`. Text after the first newline is ignored, so late appends
  never corrupt a complete outcome.
* ``<r>/rank/<ticket>``: the rank of each ticket: ``-1`` written by the node with its record,
  overwritten by the publisher's one ``multi_set`` before it decides ``res``; a woken node reads
  ``res`` and its rank with one ``multi_get``.
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

import ipaddress
import logging
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Any

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
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


def _members(raw: bytes) -> list[int]:
    """The tickets by rank listed on the second line of a complete outcome."""
    parts = raw.split(b"\n", 2)
    if len(parts) < 3 or not parts[1]:
        return []
    try:
        return [int(x) for x in parts[1].split(b",")]
    except ValueError as e:
        raise RendezvousStateError(f"corrupt rendezvous outcome {raw[:40]!r}") from e


class _Watch:
    """What a member of a complete round reads to notice a lost peer (see ``lost_members``)."""

    def __init__(self, prefix: str, rank: int, tickets: list[int], window: float,
                 slack: float) -> None:
        world = len(tickets)
        self.prefix = prefix
        self.rank = rank
        self.tickets = tickets
        count = min(world - 1, _MAX_WATCHED)
        self.peers = [(rank + k) % world for k in range(1, count + 1)]
        self.keys = [prefix + "gone"] + [f"{prefix}hb/t{tickets[p]}" for p in self.peers]
        self.beats = Beats(window, slack)  # keyed by rank
        self.reported: set[int] = set()


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
        self._pending_left: str | None = None
        self._lock = threading.Lock()
        self._side: Any = None
        self._worker_server: Any = None

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
        self._record(f"joined round {self._member[0] if self._member else -1} as rank "
                     f"{info.rank} of {info.world_size}", NodeState.SUCCEEDED, info.rank)
        return info

    def _record(self, message: str, state: NodeState, rank: int | None = None) -> None:
        construct_and_record_rdzv_event(
            run_id=self._run_id, message=message, node_state=state,
            name=f"{type(self).__name__}.next_rendezvous", hostname=self._local_addr,
            master_endpoint=self._bootstrap_addr, rank=rank,
        )

    def _side_store(self) -> Any:
        """The connection for calls made while another thread is inside next_rendezvous.

        A client connection serves one request at a time, and a joining node's connection may
        be blocked in a long wait; calls from other threads then use a second connection.
        """
        if not self._lock.locked():
            return self._store
        if self._side is None:
            clone = getattr(self._store, "clone", None)
            self._side = clone() if clone is not None else self._store
        return self._side

    def is_closed(self) -> bool:
        """See base class."""
        return bool(self._call(self._side_store().check, [self._key + "closed"]))

    def set_closed(self) -> None:
        """See base class: sets ``closed`` and wakes every node waiting in a forming round."""
        store = self._side_store()
        self._call(store.set, self._key + "closed", b"1")
        cur = int(self._call(store.add, self._key + "open", 0))
        rounds = {cur, cur + 1}
        if self._member is not None:
            rounds.add(self._member[0] + 1)
        for r in sorted(rounds):
            self._call(store.append, f"{self._key}{r}/res", b"C;")

    def num_nodes_waiting(self) -> int:
        """See base class: the tickets taken in the round after this node's round."""
        if self._member is None:
            return 0
        v = int(self._call(self._side_store().add, f"{self._key}{self._member[0] + 1}/t", 0))
        return v - _SEAL if v >= _SEAL else v

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
        store = self._side_store()
        vals = [bytes(v) for v in self._call(store.multi_get, w.keys)]
        now = time.monotonic()
        gone = _parse_gone(vals[0])
        silent = w.beats.observe(dict(zip(w.peers, vals[1:], strict=True)), now)
        for rank, still in silent.items():
            if rank not in gone:
                log.warning("rendezvous %s: rank %d sent no keep-alive for %.1fs; dropping it",
                            self._run_id, rank, still)
                self._call(store.append, w.prefix + "gone", b"%d:silent;" % rank)
                self._call(store.set, f"{w.prefix}left/{rank}", b"silent")
                gone[rank] = "silent"
        fresh = [(r, why) for r, why in gone.items() if r not in w.reported and why != "done"]
        if not fresh:
            return []
        w.reported.update(r for r, _ in fresh)
        records = self._call(store.multi_get, [f"{w.prefix}n/{w.tickets[r]}" for r, _ in fresh])
        out = []
        for (rank, why), rec in zip(fresh, records, strict=True):
            _, addr, pid = (bytes(rec).decode("utf-8", "replace").split("|") + ["", ""])[:3]
            stale = now - w.beats.since[rank][1] if rank in w.beats.since else 0.0
            if why == "closed":
                text = (f"cut: no keep-alive for {stale:.1f}s, then its connection timed out"
                        if stale >= 2 * self._ka_interval else "dead: its connection closed")
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
        if w is not None:
            self._call(self._side_store().append, w.prefix + "gone", b"%d:done;" % w.rank)

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
            try:
                store.wait(keys, timedelta(seconds=min(slice_s, remaining)))
                return
            except StoreTimeoutError:
                pass
            lost = self.lost_members()
            if lost:
                raise RendezvousMemberLostError(lost)

    def shutdown(self) -> bool:
        """See base class: stops keep-alives and closes the rendezvous."""
        self._stop_heartbeats()
        self._retire_worker_store()
        try:
            self.set_closed()
        except (RendezvousConnectionError, StoreError) as e:
            log.warning("rendezvous %s: shutdown could not close: %s", self._run_id, e)
            return False
        return True

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
        self._prev_watch, self._watch = self._watch, None
        if store.check([self._key + "closed"]):
            raise RendezvousClosedError(f"The rendezvous '{self._run_id}' is closed.")
        if self._member is not None:
            r = self._member[0] + 1
            self._pending_left = f"{self._key}{self._member[0]}/left/{self._member[1]}"
        else:
            r = int(store.add(self._key + "open", 0))
        for _ in range(_MAX_WALK):
            if time.monotonic() > deadline:
                break
            got = self._try_round(r, deadline)
            if got is not None:
                rank, world, tickets = got
                self._member = (r, rank, world)
                p = f"{self._key}{r}/"
                if self._hooks:
                    store.append_on_disconnect(p + "left/%d" % rank, b"1")
                    store.append_on_disconnect(p + "gone", b"%d:closed;" % rank)
                self._watch = (_Watch(p, rank, tickets, self._window, self._ka_interval / 2)
                               if len(tickets) == world else None)
                round_store, boot = self._round_store(r, rank)
                return RendezvousInfo(round_store, rank, world, boot)
            r += 1
        raise RendezvousTimeoutError(
            f"The rendezvous '{self._run_id}' did not complete within {self._timeout.join}."
        )

    def _round_store(self, r: int, rank: int) -> tuple[Any, RendezvousStoreInfo]:
        """The agents' store (prefixed per round) and the workers' store address."""
        round_store = _prefix_store(str(self.store_prefix), self._store)
        if not self.use_agent_store:
            # torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0's workers host their own.
            return round_store, RendezvousStoreInfo.build(rank, round_store, self._local_addr)
        return round_store, self._worker_store_info(r, rank, self._store)

    def _worker_store_info(self, r: int, rank: int, meet: Any) -> RendezvousStoreInfo:
        """Rank 0 hosts a fresh, empty store for this round's workers; all learn its address.

        Workers of a restarted group use the same key names as the dead attempt (gloo's
        ``default_pg/...`` addresses, for one): on a shared store they would read stale
        values and connect to dead peers. A store per round, as torch's agent-store comment
        intends, starts every attempt clean. The address is published through ``meet`` (the
        rendezvous's own store, or etcd) with one ``set``; others read it with one ``get``.
        ``MASTER_ADDR`` is rank 0's ``local_addr``, else its FQDN, as torch publishes it.
        """
        from fastelastic.store import TCPStore

        self._retire_worker_store()
        key = f"{self._key}{r}/wstore"
        if rank == 0:
            addr = self._local_addr or socket.getfqdn()
            # torch's clients cannot authenticate, so this store is open: it listens only on
            # the address the workers are given when that is an address of this host (a name
            # would need a lookup and may stand for several; an address of a NAT is not
            # ours), else on every interface, as torch's does.
            self._worker_server = None
            if _is_ip(addr):
                try:
                    self._worker_server = TCPStore(
                        "", 0, is_master=True, wait_for_workers=False,
                        timeout=self._store.timeout, bind_host=addr)
                except StoreError as e:
                    log.info("workers' store: cannot listen on %s only (%s); listening on "
                             "every interface", addr, e)
            if self._worker_server is None:
                self._worker_server = TCPStore(
                    "", 0, is_master=True, wait_for_workers=False, timeout=self._store.timeout)
            meet.set(key, f"{addr}:{self._worker_server.port}".encode())
        else:
            self.wait_members(meet, [key], time.monotonic() + self._store.timeout.total_seconds())
        host, _, port = bytes(meet.get(key)).decode().rpartition(":")
        return RendezvousStoreInfo(host, int(port))

    def _retire_worker_store(self) -> None:
        """Stops the previous round's worker store (its workers were stopped before re-joining)."""
        server, self._worker_server = self._worker_server, None
        if server is not None:
            server.shutdown_server()

    def _try_round(self, r: int, deadline: float) -> tuple[int, int, list[int]] | None:
        """Joins round ``r``; (rank, world, tickets by rank) or None to move on to ``r + 1``."""
        store = self._store
        p = f"{self._key}{r}/"
        if self._hooks:
            store.append_on_disconnect(p + "res", b"D;")
        t = int(store.add(p + "t", 1))
        keys: list[str] = []
        vals: list[bytes] = []
        if self._pending_left is not None:
            keys.append(self._pending_left)
            vals.append(b"1")
            self._pending_left = None
        if t > self._max:  # full or sealed: wait in the next round
            if keys:
                store.multi_set(keys, vals)
            return None
        pref = self._member[1] if self._member is not None else self._node_rank
        keys.append(f"{p}n/{t}")
        vals.append(b"%d|%s|%d" % (pref, self._local_addr.encode(), os.getpid()))
        # A placeholder for our rank: the publisher overwrites it (after it saw this write)
        # before deciding res, so one multi_get of (res, rank) reads both once res exists.
        keys.append(f"{p}rank/{t}")
        vals.append(b"-1")
        keys.append(f"{p}hb/t{t}")  # keep-alives from the ticket on
        vals.append(b"0")
        store.multi_set(keys, vals)
        BEATER.add(self, f"{p}hb/t{t}")
        if t == self._max:
            self._publish(r, self._max, deadline)
        elif t == self._min:
            self._coordinate(r, deadline)
        kind, count, rank, raw = self._wait_outcome(r, deadline, rank_key=f"{p}rank/{t}",
                                                    ticket=t)
        if kind == "C":
            raise RendezvousClosedError(f"The rendezvous '{self._run_id}' is closed.")
        if kind == "D":
            log.info("rendezvous %s round %d abandoned (a node left); re-joining", self._run_id, r)
            return None
        if rank < 0:  # not admitted (round full, or our record came too late)
            return None
        return rank, count, _members(raw)

    def _wait_outcome(self, r: int, deadline: float, mine: bool = True,
                      rank_key: str | None = None, ticket: int = 0) -> tuple[str, int, int, bytes]:
        """Round ``r``'s outcome: (kind, world, rank read from ``rank_key`` or -1, raw res).

        A node holding ``ticket`` checks every quarter window that the holders of the
        deciding tickets (``min_nodes``: last call; ``max_nodes``: publish) are alive, and
        abandons the round when one is not (no record: a stray or a node lost right after its
        ticket; its keep-alive stood still for a window: frozen or hung).
        """
        key = f"{self._key}{r}/res"
        seen = Beats(self._window, self._ka_interval / 2)
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if mine:  # give up our ticket: nobody may count this node in the round any more
                    self._store.append(key, b"D;")
                raise RendezvousTimeoutError(
                    f"The rendezvous '{self._run_id}' did not complete within "
                    f"{self._timeout.join}."
                )
            step = remaining if not ticket else min(remaining, self._window / 4)
            try:
                self._store.wait([key], timedelta(seconds=step))
                break
            except StoreTimeoutError:
                pass
            if ticket and self._deciders_stalled(r, ticket, seen):
                self._store.compare_set(key, "", b"D;")
        if rank_key is None:
            raw = bytes(self._store.get(key))
            return (*_outcome(raw), -1, raw)
        raw_res, raw_rank = self._store.multi_get([key, rank_key])
        try:
            rank = int(bytes(raw_rank))
        except ValueError as e:
            raise RendezvousStateError(f"corrupt rank {bytes(raw_rank)[:40]!r}") from e
        return (*_outcome(bytes(raw_res)), rank, bytes(raw_res))

    def _deciders_stalled(self, r: int, ticket: int, seen: Beats) -> bool:
        """True if a deciding ticket of round ``r`` has no record, or a keep-alive that stood
        still for the detection window (``seen``: the counters polled so far)."""
        p = f"{self._key}{r}/"
        count = int(self._store.add(p + "t", 0))
        if count >= _SEAL:  # sealed: the coordinator is publishing; the holder of min acts
            count -= _SEAL
        states: dict[int, int] = {}
        for role in sorted({self._min, self._max}):
            if role > count or role == ticket:
                continue
            # -1: no record yet; else the keep-alive counter. Stalled: unchanged for a window.
            if not self._store.check([f"{p}n/{role}"]):
                states[role] = -1
            else:
                states[role] = int(self._store.add(f"{p}hb/t{role}", 0))
        stalled = seen.observe(states)
        for role, still in stalled.items():
            why = "no record" if states[role] < 0 else "no keep-alive"
            log.warning("rendezvous %s round %d: the node holding ticket %d (%s for %.1fs) is "
                        "lost; abandoning the round", self._run_id, r, role, why, still)
        return bool(stalled)

    def _res_exists(self, r: int) -> bool:
        return bool(self._store.check([f"{self._key}{r}/res"]))

    def _coordinate(self, r: int, deadline: float) -> None:
        """Ticket ``min_nodes``: drain, last call, seal, publish."""
        store = self._store
        if not self._drain(r, deadline):
            return
        last_call = min(self._timeout.last_call.total_seconds(), deadline - time.monotonic())
        if last_call >= 0.001:
            try:
                store.wait([f"{self._key}{r}/res"], timedelta(seconds=last_call))
                return  # decided meanwhile (max reached, closed or abandoned)
            except StoreTimeoutError:
                pass
        count = int(store.add(f"{self._key}{r}/t", _SEAL)) - _SEAL
        if count < self._max:  # at max the max-ticket holder publishes
            self._publish(r, count, deadline, drained=True)

    def _publish(self, r: int, count: int, deadline: float, drained: bool = False) -> None:
        """Decides round ``r`` with ``count`` members: ranks, then one compare_set of res."""
        store = self._store
        p = f"{self._key}{r}/"
        # Draining lets every member of the last round that is still coming join this one; a
        # full round (max_nodes tickets) has no room left for them, so it waits for nobody (a
        # replacement node and the survivors need not wait for a frozen member's window).
        if not drained and count < self._max and not self._drain(r, deadline):
            return
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
            try:
                store.wait([f"{p}n/{i}" for i in tickets],
                           timedelta(seconds=min(_SLICE, remaining)))
                break
            except StoreTimeoutError:
                if self._res_exists(r):  # a joiner died before writing its record
                    return
        if len(tickets) < self._min:
            store.compare_set(p + "res", "", b"D;")  # too few left: everyone re-joins r + 1
            return
        prefs = []
        for raw in store.multi_get([f"{p}n/{i}" for i in tickets]):
            try:
                prefs.append(int(bytes(raw).split(b"|", 1)[0]))
            except ValueError as e:
                raise RendezvousStateError(f"corrupt node record {bytes(raw)[:40]!r}") from e
        world = len(tickets)
        ranks = assign_ranks(prefs, world)
        by_rank = [0] * world
        for ticket, rank in zip(tickets, ranks, strict=True):
            by_rank[rank] = ticket
        store.multi_set([f"{p}rank/{i}" for i in tickets] + [p + "gone"],
                        [b"%d" % x for x in ranks] + [b""])
        blob = b"M%d\n%s\n" % (world, b",".join(b"%d" % t for t in by_rank))
        if bytes(store.compare_set(p + "res", "", blob)) == blob:
            store.set(self._key + "open", b"%d" % (r + 1))

    def _last_complete(self, r: int, deadline: float) -> tuple[int, int, list[int]] | None:
        """Walks back from ``r - 1`` to the last complete round: (round, world, tickets)."""
        for q in range(r - 1, max(-1, r - 1 - _MAX_WALK), -1):
            kind, count, _, raw = self._wait_outcome(q, deadline, mine=False)
            if kind == "M":
                return q, count, _members(raw)
            if kind == "C":
                raise RendezvousClosedError(f"The rendezvous '{self._run_id}' is closed.")
        return None

    def _drain(self, r: int, deadline: float) -> bool:
        """Waits until every member of the last complete round left. False if ``r`` got decided.

        A member whose keep-alive counter stands still for the detection window is dropped
        (frozen, hung or cut off). When this node watched it during that round, the window
        counts from the last change it saw then, not from now.
        """
        last = self._last_complete(r, deadline)
        if last is None:
            return True
        q, world, tickets = last
        missing = [f"{self._key}{q}/left/{i}" for i in range(world)]
        window = self._window
        beats = Beats(window, self._ka_interval / 2)
        prev = self._prev_watch
        if prev is not None and prev.prefix == f"{self._key}{q}/":
            for rank, (raw, since) in prev.beats.since.items():
                try:
                    beats.since[rank] = (int(raw), since)
                except ValueError:
                    continue
        while missing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                step = max(0.05, min(window / 4, self._ka_interval / 2))
                self._store.wait(missing, timedelta(seconds=min(step, remaining)))
                return True
            except StoreTimeoutError:
                pass
            if self._res_exists(r):
                return False
            present = self._store.check  # narrow the set to the keys still missing
            missing = [k for k in missing if not present([k])]
            counters = {}
            for key in missing:  # a member silent for a whole window is lost: drop it
                rank = int(key.rsplit("/", 1)[1])
                hb = f"hb/t{tickets[rank]}" if rank < len(tickets) else f"hb/{rank}"
                counters[rank] = int(self._store.add(f"{self._key}{q}/{hb}", 0))
            for rank, still in beats.observe(counters).items():
                log.warning("rendezvous %s: member rank %d of round %d was lost (silent: no "
                            "keep-alive for %.1fs); dropping it", self._run_id, rank, q, still)
                self._store.set(f"{self._key}{q}/left/{rank}", b"hung")
            missing = [k for k in missing if not present([k])]
        return True

    # ------------------------------------------------------------------ keep-alive

    def _stop_heartbeats(self) -> None:
        BEATER.remove(self)




def _is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True


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
    ``rank`` (preferred node rank), ``token_file`` (a shared secret guarding the rendezvous
    store; default ``$FASTELASTIC_STORE_TOKEN_FILE``).

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
    )
