"""The fast rendezvous on fastelastic's TCPStore: O(1) store messages per node, no hot key.

This module is the I/O layer: :class:`FastRendezvousHandler` runs the protocol of
:mod:`._round` (a transport-free state machine; keys in :mod:`._schema`) on a store client,
picks the connection each call goes through, keeps this node's keep-alives going
(:mod:`._liveness`) and hosts the workers' store (:mod:`._worker_store`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, TypeVar

from fastelastic._waits import Slices
from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousMemberLostError,
    RendezvousTimeoutError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)
from fastelastic.events import NodeState, construct_and_record_rdzv_event

from ..api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
)
from ..timeouts import RendezvousTimeout, store_times_from_params, timeout_from_params
from ..utils import parse_rendezvous_endpoint
from . import _requests as rq
from . import _schema as sc
from . import _store_ops as ops
from ._liveness import BEATER
from ._round import Config, Machine
from ._schema import Membership, assign_ranks
from ._store_hosting import host_store, token_from
from ._worker_store import RoundStores, WorkerStoreHost
from .failover import _hops as hops
from .failover._failover import Candidates, parse_candidates
from .failover._hops import LiveStore
from .failover._moves import Moves

__all__ = ["FastRendezvousHandler", "assign_ranks", "create_fast_handler"]

log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous")  # the name users configure

T = TypeVar("T")
DEFAULT_PORT = 29400
_LINGER_S = 10.0  # at most this long the host's store outlives its own shutdown
_LEAVE_CONNECT_S = 2.0  # at most this long a leave waits for a connection of its own
_MEMBERS_LINGER_S = 2.0  # ... when no spare waits: for the members' own shutdowns
DEFAULT_KEEP_ALIVE_INTERVAL = 1.0  # seconds
DEFAULT_KEEP_ALIVE_MAX_ATTEMPT = 5  # detection window: interval * attempts = 5 s (torch: 15 s)


def new_node_id() -> str:
    """A new identity for this launcher (:func:`._schema.node_id`): its hostname, pid and 64
    random bits. ``gethostname`` is a syscall; an FQDN would be a DNS lookup, which costs a
    timeout wherever the resolver does not answer."""
    return sc.node_id(socket.gethostname(), os.getpid(), secrets.randbits(64))


class FastRendezvousHandler(Moves, RoundStores, RendezvousHandler):
    """Rendezvous handler running the ticket protocol of :mod:`._round` on a store.

    Args:
        run_id: The run id of the rendezvous.
        store: A fastelastic ``TCPStore`` client owned by this handler (its connection is this
            node's liveness; use one per node).
        backend_name: Name reported by :py:meth:`get_backend`.
        min_nodes: Minimum number of nodes.
        max_nodes: Maximum number of nodes.
        timeout: Join, last-call, close and heartbeat timeouts.
        local_addr: This node's address: ``MASTER_ADDR`` when it is rank 0 and workers'
            stores it hosts (default: its FQDN, looked up when first needed). It names no node:
            the rendezvous tells nodes apart by ``node_id``.
        node_rank: Preferred rank of this node (-1 for none).
        keep_alive_interval: Seconds between keep-alive counter bumps (default 1).
        keep_alive_max_attempt: Missed keep-alives after which a silent node is dropped
            (default 5: a frozen or hung node is noticed within 5 s).
        bootstrap_addr: Host workers use to reach the store (``MASTER_ADDR``).
        server: The hosting store object when this node hosts, kept alive with the handler.
        reform_last_call: Wait ``last_call`` also when a round re-forms after a complete one
            (torch's behaviour); by default such a round is sealed once every member of the
            last one is back or lost.
        candidates: The rendezvous store's candidate endpoints (:mod:`.failover._failover`), when
            there are several: a lost store host is then survived by moving to the next.
        node_id: This node's identity in the rendezvous (:func:`new_node_id`; default: the
            candidates' ``plan.me`` if set, else a new one). Unique per launcher: the majority
            rules count members by it.

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
        candidates: Any = None,
        node_id: str | None = None,
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
        self._timeout = timeout or RendezvousTimeout()
        self._local_addr = local_addr or ""
        self._node_rank = node_rank
        self._ka_interval = float(keep_alive_interval)  # read by the keep-alive thread
        self._m = Machine(Config(
            run_id, min_nodes, max_nodes, join=self._timeout.join.total_seconds(),
            last_call=self._timeout.last_call.total_seconds(),
            ka_interval=self._ka_interval, ka_max=keep_alive_max_attempt,
            reform_last_call=reform_last_call,
            hooks=bool(getattr(store, "supports_extensions", False)),
            can_move=candidates is not None and len(candidates.endpoints) > 1))
        self._window = self._m.cfg.window
        # with candidates: waits in half-window slices, each reply due within the window, so a
        # frozen or cut host is noticed within 1.5 windows wherever a node waits (_store_ops)
        self._slice = self._window / 2 if candidates is not None else 0.0
        self._bootstrap_addr = str(bootstrap_addr or getattr(store, "host", "localhost"))
        self._key = self._m.keys.base
        self._lock = threading.Lock()  # held by the thread inside next_rendezvous
        self._owner: int | None = None  # that thread's id
        self._side_lock = threading.Lock()
        self._side: Any = None
        self._wstore = WorkerStoreHost(self._local_addr)
        self._candidates = candidates
        self._node = node_id or (candidates.plan.me if candidates is not None else "") or \
            new_node_id()
        if candidates is not None:
            candidates.plan.me = self._node  # its marks and fences name it as its records do
            candidates.plan.join_s = self._timeout.join.total_seconds()
        self._live = LiveStore()  # where the rendezvous is (with candidates)
        self._move_lock = threading.RLock()  # one move at a time (see _move)
        self._joined_on: Any = None  # the store of the last join (see _moves._join_round)
        self._closed_owned = False  # shutdown() closed the connections and the hosted store

    # ------------------------------------------------------------------ running the protocol

    def _run(self, gen: rq.RequestGen[T], store: Any) -> T:
        """Runs one of the machine's operations on ``store``: sends each request, feeds the
        reply back. A connection failure ends it as ``RendezvousConnectionError``."""
        reply: Any = None
        try:
            while True:
                op = gen.send(reply)
                reply = self._do(store, op)
        except StopIteration as e:
            return e.value  # type: ignore[no-any-return]
        except (StoreConnectionError, ConnectionError) as e:
            raise RendezvousConnectionError(
                f"The connection to the rendezvous store of run '{self._run_id}' failed: {e}"
            ) from e
        finally:
            gen.close()

    def _do(self, store: Any, op: rq.Request) -> Any:
        """One request of the machine on ``store``; its reply (see :mod:`._requests`)."""
        match op:
            case rq.Beat(key):
                BEATER.add(self, key)
                return None
            case rq.StopBeats():
                BEATER.remove(self)
                return None
            case rq.GoneElsewhere(idents, world):  # the proof of _majority (it can move)
                assert self._candidates is not None
                return self._candidates.gone_elsewhere(self._live.index, idents, world)
            case rq.MovedElsewhere():  # one endpoint: nowhere else to be
                if self._candidates is not None:
                    self._candidates.check(self._live)
                return None
            case _:  # the store's own requests (an unknown one is a TypeError)
                return ops.apply(store, op, self._slice)

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

    def _close_side(self) -> None:
        """Closes the second connection, if this handler made one (it is the handler's)."""
        with self._side_lock:
            side, self._side = self._side, None
        if side is not None and side is not self._store:
            with contextlib.suppress(Exception):
                side.close()

    def _side_call(self, gen: rq.RequestGen[T]) -> T:
        with self._conn() as store:
            return self._run(gen, store)

    def _watchful(self, gen: rq.RequestGen[T]) -> T:
        """``_side_call`` for a membership check with several candidates: a store that does
        not answer within the detection window is as lost as one whose connection closed."""
        assert self._candidates is not None
        with self._conn() as conn, ops.reply_deadline(conn, self._window,
                                                      self._candidates.read_timeout) as store:
            return self._run(gen, store)

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
    def _member(self) -> Membership | None:
        return self._m.member

    @property
    def store_prefix(self) -> str | None:
        """Key prefix of the store returned by the last :py:meth:`next_rendezvous` (per round)."""
        if self._m.member is None:
            return None
        return f"torch.rendezvous.{self._run_id}.{self._m.member.round}"

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        if self._closed_owned:
            raise RendezvousClosedError(f"the handler of rendezvous '{self._run_id}' was shut "
                                        "down")
        self._record(f"joining the next round of rendezvous '{self._run_id}'", NodeState.RUNNING)
        with self._lock:
            self._owner = threading.get_ident()
            try:
                info = self._next_rendezvous_anywhere()
            except RendezvousConnectionError as e:
                self._record(f"{type(e).__name__}: {e}", NodeState.FAILED)
                raise
            except (StoreConnectionError, ConnectionError) as e:  # the workers' store
                self._record(f"{type(e).__name__}: {e}", NodeState.FAILED)
                raise RendezvousConnectionError(
                    f"The connection to the rendezvous store of run '{self._run_id}' failed: "
                    f"{e}") from e
            except BaseException as e:
                self._stop_heartbeats()
                self._record(f"{type(e).__name__}: {e}", NodeState.FAILED)
                raise
            finally:
                self._owner = None
        member = self._m.member
        self._record(f"joined round {member.round if member else -1} as rank "
                     f"{info.rank} of {info.world_size}", NodeState.SUCCEEDED, info.rank)
        return info

    def _next_rendezvous(self) -> RendezvousInfo:
        wstore = self._wstore.address() if self.use_agent_store else b""
        join = self._m.join(self._node_rank, self._local_addr, os.getpid(), wstore, self._node)
        if self._candidates is None:
            seat = self._run(join, self._store)
        else:  # a host that does not answer within the window is lost (see _store_ops)
            with ops.reply_deadline(self._store, self._window, self._candidates.read_timeout):
                seat = self._run(join, self._store)
        round_store, boot = self._round_store(seat.round, seat.rank, seat.wstore)
        return RendezvousInfo(round_store, seat.rank, seat.world, boot)

    def _record(self, message: str, state: NodeState, rank: int | None = None) -> None:
        construct_and_record_rdzv_event(
            run_id=self._run_id, message=message, node_state=state,
            name=f"{type(self).__name__}.next_rendezvous", hostname=self._local_addr,
            master_endpoint=self._bootstrap_addr, rank=rank,
        )

    def is_closed(self) -> bool:
        """See base class. True once this handler was shut down (its connections are closed;
        it closed the rendezvous, or its store was gone)."""
        if self._closed_owned:
            return True
        with self._conn() as store:
            return bool(self._run(_check(self._m.keys.closed), store))

    def set_closed(self) -> None:
        """See base class: sets ``closed`` and wakes every node waiting in a forming round."""
        self._side_call(self._m.set_closed())

    def num_nodes_waiting(self) -> int:
        """See base class: the tickets taken in the round after this node's round.

        A full round (``max_nodes`` members) has room for nobody: the nodes waiting behind it
        are spares (torch's redundancy list) and count as none, so they never restart it. A
        member of it that re-joins is reported by :py:meth:`lost_members` instead, which,
        while a spare is ready, calls a peer silent after ``max(2 intervals, window / 2)``
        rather than the whole window: a false suspicion then costs a restart, not a seat.
        """
        if self._m.member is None:
            return 0
        if self._candidates is None:
            return self._member_check(self._m.num_nodes_waiting())
        try:
            return self._watchful(self._m.num_nodes_waiting())
        except (RendezvousConnectionError, StoreTimeoutError):
            return 0  # lost_members moves the rendezvous and reports it

    def get_run_id(self) -> str:
        """See base class."""
        return self._run_id

    # ------------------------------------------------------------- keep-alives (BeatingMember)

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def keep_alive_interval(self) -> float:
        return self._ka_interval

    @property
    def detection_window(self) -> float:
        return self._window

    def beat(self, key: str, value: bytes) -> None:
        # A fire-and-forget write: it goes out at once even while the handler's connection is
        # blocked in a wait of another thread (see KVClient).
        self._store.set(key, value)

    def lost_members(self) -> list[tuple[int, str]]:
        """Members of this node's round lost since the last call: ``[(rank, why), ...]``.

        One ``multi_get`` of the round's ``gone`` and the keep-alive counters of up to eight
        peers (the next ranks, round-robin). A peer whose counter stood still for the
        detection window is published as silent for everyone. ``why`` names the node
        (address, pid) and says dead (connection closed), cut (heartbeats stopped, then the
        connection timed out), left, or silent (connected, no heartbeat: frozen or hung).
        This node's own rank is listed when the others dropped it.
        """
        if self._m.watch is None:
            return []
        if self._candidates is None:
            return self._member_check(self._m.lost_members())
        store, lost = self._store, self._candidates.name(self._live.index)
        try:
            return self._watchful(self._m.lost_members())
        except (RendezvousConnectionError, StoreTimeoutError) as e:
            if self._owner is not None and self._owner != threading.get_ident():
                # a rendezvous runs in another thread: it moves, on its own failure
                return [(-1, f"the rendezvous store's host {lost} was lost ({e})")]
            self._move(e, store)
            where = self._candidates.name(self._live.index)
            return [(-1, f"the rendezvous store's host {lost} was lost ({e}); " + (
                f"the rendezvous moved to {where}" if self._m.carried or self._m.member else
                f"this node was proven gone from its world first: it follows ({where})"))]

    def _member_check(self, gen: rq.RequestGen[T]) -> T:
        """A membership check on the one endpoint. Once the store's host finished, a store
        that cannot be reached is the job's end there: no keep-alive is sent to it again."""
        try:
            return self._side_call(gen)
        except RendezvousConnectionError:
            if self.store_host_finished:
                self._stop_heartbeats()
            raise

    @property
    def store_host_finished(self) -> bool:
        """True once this node read that the node hosting the rendezvous store finished its
        work (its workers succeeded; :py:meth:`mark_done`): the store then goes when that
        node ends, and losing it is no lost host (one endpoint only: with several candidates
        the rendezvous moves on instead)."""
        w = self._m.watch
        return self._candidates is None and w is not None and w.host_done

    def mark_done(self) -> None:
        """Tells the other members that this node finished its work (its workers succeeded).

        Its connection closing or its keep-alives stopping later is then no loss: a node that
        leaves the exit barrier early does not make the others restart their workers. The
        store's host (one endpoint) also says so: its store ends with it.
        """
        hosting = self._server is not None and self._candidates is None
        self._run(self._m.mark_done(hosting), self._store)  # fire-and-forget: never waits

    def leave(self) -> None:
        """Tells the members of this node's round that it is leaving for good (preempted:
        SIGTERM/SIGINT), without closing the rendezvous for them.

        Fire-and-forget writes (``left/<rank>``, ``broken``, ``<rank>:quit;`` in ``gone``): the
        others re-form at their next check instead of waiting for this node's connection.
        """
        self._stop_heartbeats()
        if self._m.member is None:
            return
        try:
            self._run(self._m.leave(for_good=True), self._store)
            return
        except (RendezvousConnectionError, StoreError) as e:
            first = e
        # The signal that brought us here may have landed in a rendezvous wait: the request
        # was cut short and the connection given up (KVConn). Say it on a connection of its
        # own, made within a short bound (a lost host must not hold up the shutdown).
        try:
            with ops.fresh(self._store, min(self._window, _LEAVE_CONNECT_S)) as conn:
                self._run(self._m.leave(for_good=True), conn)
                conn.check([self._m.keys.closed])  # a round trip: the writes are in
        except (RendezvousConnectionError, StoreError, OSError, AttributeError) as e:
            log.warning("rendezvous %s: could not announce leaving: %s (then: %s)",
                        self._run_id, first, e)

    def wait_members(self, store: Any, keys: list[str], deadline: float) -> None:
        """Waits for ``keys`` (written by other members) unless a member is lost first.

        Raises:
            RendezvousMemberLostError: a member of this node's round was lost.
            RendezvousTimeoutError: ``deadline`` (monotonic) passed.
        """
        for step in Slices(deadline, max(0.05, min(self._ka_interval, 1.0))):
            if ops.wait(store, keys, step):
                return
            lost = self.lost_members()
            if lost:
                raise RendezvousMemberLostError(lost)
        raise RendezvousTimeoutError(f"timed out waiting for {keys[:3]} of other members")

    def shutdown(self) -> bool:
        """See base class: stops keep-alives and closes the rendezvous.

        Then, on every path, closes what the handler owns: its connections and the store it
        hosts (after the linger). With a single endpoint, a store whose host is gone cannot be
        closed and admits nobody either: at a normal end the host closed the rendezvous and
        left first, so this is said at INFO, not as a warning. With several candidates, a node
        closes the rendezvous only on a store it was a member of a round on: one that gave up
        on a store it moved to alone (a cut link) must not close it for every node started
        later.
        """
        self._stop_heartbeats()
        self._wstore.close()
        if self._candidates is not None and not self._live.formed:
            log.warning("rendezvous %s: not closing the store at %s: this node formed no world "
                        "on it", self._run_id, self._candidates.name(self._live.index))
            self._close_owned(linger=False)
            return False
        closed = False
        try:
            self.set_closed()
            closed = True
        except (RendezvousConnectionError, StoreError) as e:
            if isinstance(e, RendezvousConnectionError) and self._candidates is None and (
                    self._server is None):
                log.info("rendezvous %s: the store's host has gone; nothing is left to close "
                         "(%s)", self._run_id, e)
            else:
                log.warning("rendezvous %s: shutdown could not close: %s", self._run_id, e)
            return False
        finally:
            self._close_owned(linger=closed)
        return True

    def _close_owned(self, linger: bool) -> None:
        """Closes the handler's connections and (after the linger, when the rendezvous was
        closed) the store it hosts; once."""
        if self._closed_owned:
            return
        self._closed_owned = True
        try:
            if linger:
                self._linger()
        finally:
            self._close_side()
            with contextlib.suppress(Exception):
                self._store.close()
            stop = getattr(self._server, "shutdown_server", None)  # the store this node hosts
            if stop is not None:
                with contextlib.suppress(Exception):
                    stop()
            if self._candidates is not None:
                self._candidates.close()

    def _linger(self) -> None:
        """As the store's host, keeps it up (bounded) until the other nodes have gone.

        Nodes waiting for a next round (spares) leave as soon as they read that the
        rendezvous closed; were the store to go first they would see a failure instead. The
        members of the last round, at a normal end, are leaving the exit barrier and closing
        the rendezvous themselves at the same moment: a store gone under them would be a
        warning on every such node; they get ``_MEMBERS_LINGER_S``.
        """
        server = getattr(self._server, "server", None)
        if server is None or self._m.member is None:
            return
        try:
            waiters = self._run(self._m.has_waiters(), self._store)
        except (RendezvousConnectionError, StoreError):
            return
        own = 1 + (self._side is not None and self._side is not self._store)
        bound = _LINGER_S if waiters else _MEMBERS_LINGER_S
        for _ in Slices(time.monotonic() + min(bound, self._timeout.close.total_seconds())):
            if server.num_connections <= own:
                break
            time.sleep(0.01)  # polled: the server has no "connections dropped to N" event

    def _stop_heartbeats(self) -> None:
        BEATER.remove(self)


def _check(key: str) -> rq.RequestGen[bool]:
    return bool((yield rq.Check([key])))


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
    candidates = None
    if "," in (params.endpoint or ""):
        endpoints = parse_candidates(params.endpoint, DEFAULT_PORT)
        host, port = endpoints[0]
    else:
        host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    timeout = timeout_from_params(params)
    read_timeout, keep_alive_interval, keep_alive_max_attempt = store_times_from_params(
        params, DEFAULT_KEEP_ALIVE_INTERVAL, DEFAULT_KEEP_ALIVE_MAX_ATTEMPT)
    rank = params.get_as_int("rank", -1)
    reform_last_call = bool(params.get_as_bool("reform_last_call", False))
    if "," in (params.endpoint or ""):
        candidates = Candidates(params.run_id, endpoints, params.get_as_bool("is_host"),
                                read_timeout, token_from(params))
        candidates.plan.me = new_node_id()  # before the connect: a start's move marks
        candidates.plan.start_wait = timeout.join.total_seconds()
        client, index, epoch, proposed = candidates.connect()
        server = candidates.standby
        host = endpoints[index][0]
    else:
        client, server = host_store(host, port, params.get_as_bool("is_host"), read_timeout,
                                    token_from(params))
    handler = FastRendezvousHandler(
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
        candidates=candidates,
    )
    if candidates is not None:
        handler._live = hops.begin(handler._m, index, epoch, proposed)
    return handler
