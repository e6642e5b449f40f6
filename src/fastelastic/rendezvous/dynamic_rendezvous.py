"""torch-shaped dynamic rendezvous: one shared state blob behind a fenced get/set backend.

This is the compatibility path for users who bring their own :class:`RendezvousBackend` (or use
:mod:`.c10d_rendezvous_backend` / :mod:`.etcd_rendezvous_backend`). It keeps torch's semantics
(min/max nodes, last call, join timeout, wait and redundancy lists, closing, heartbeats) but
never sleeps a fixed second between syncs: when a backend offers ``wait_for_change(token,
timeout)`` the handler blocks on it, else it backs off from 10 ms. The registry's ``c10d`` and
``etcd`` names use the faster ticket protocol of :mod:`.fast.fast_rendezvous` instead.
"""

from __future__ import annotations

import copy
import logging
import os
import pickle
import threading
import time
import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import Enum
from typing import Any

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)
from fastelastic.events import NodeState, construct_and_record_rdzv_event

from .api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from .timeouts import RendezvousTimeout, timeout_from_params

__all__ = [
    "DynamicRendezvousHandler",
    "RendezvousBackend",
    "RendezvousSettings",
    "RendezvousTimeout",
    "create_handler",
]

log = logging.getLogger(__name__)

Token = Any
_ROLLBACK_SECONDS = 5.0
_MAX_SYNCS = 1_000_000


class RendezvousBackend(ABC):
    """Represent a backend that holds the rendezvous state."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Get the name of the backend."""

    @abstractmethod
    def get_state(self) -> tuple[bytes, Token] | None:
        """Get the rendezvous state.

        Returns:
            The encoded state and its fencing token, or ``None`` if no state exists.

        Raises:
            RendezvousConnectionError: The connection to the backend has failed.
            RendezvousStateError: The rendezvous state is corrupt.
        """

    @abstractmethod
    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """Set the rendezvous state conditionally on ``token``.

        If ``token`` matches the stored fencing token the state is replaced; if it does not, the
        existing state is returned unchanged; if ``token`` is ``None`` the state is set only if
        none exists.

        Returns:
            The state now stored, its fencing token and whether our write succeeded.

        Raises:
            RendezvousConnectionError: The connection to the backend has failed.
            RendezvousStateError: The rendezvous state is corrupt.
        """


@dataclass(repr=False, eq=False, frozen=True)
class RendezvousSettings:
    """Hold the settings of the rendezvous.

    Attributes:
        run_id: The run id of the rendezvous.
        min_nodes: The minimum number of nodes to admit to the rendezvous.
        max_nodes: The maximum number of nodes to admit to the rendezvous.
        timeout: The timeout configuration of the rendezvous.
        keep_alive_interval: The time between keep-alive heartbeats.
        keep_alive_max_attempt: Missed heartbeats after which a node is considered dead.
    """

    run_id: str
    min_nodes: int
    max_nodes: int
    timeout: RendezvousTimeout
    keep_alive_interval: timedelta
    keep_alive_max_attempt: int


@dataclass(eq=True, order=True, frozen=True)
class _NodeDesc:
    """A node in the rendezvous: address, pid and a per-process counter."""

    addr: str
    pid: int
    local_id: int

    def __repr__(self) -> str:
        return f"{self.addr}_{self.pid}_{self.local_id}"


class _NodeDescGenerator:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._local_id = 0

    def generate(self, local_addr: str | None = None) -> _NodeDesc:
        with self._lock:
            local_id = self._local_id
            self._local_id += 1
        import socket

        return _NodeDesc(local_addr or socket.getfqdn(), os.getpid(), local_id)


@dataclass
class _RendezvousState:
    round: int = 0
    complete: bool = False
    deadline: datetime | None = None
    closed: bool = False
    participants: dict[_NodeDesc, int] = field(default_factory=dict)
    wait_list: set[_NodeDesc] = field(default_factory=set)
    redundancy_list: set[_NodeDesc] = field(default_factory=set)
    last_heartbeats: dict[_NodeDesc, datetime] = field(default_factory=dict)


def _now() -> datetime:
    # Heartbeats and the last-call deadline live in state shared between machines, so they
    # must be wall-clock (as torch's); local deadlines use time.monotonic().
    return datetime.now(UTC)


class _StateHolder:
    """Caches the decoded state and its token; syncs and commits through the backend."""

    def __init__(self, backend: RendezvousBackend, settings: RendezvousSettings) -> None:
        self._backend = backend
        self._settings = settings
        self.state = _RendezvousState()
        self.token: Token = None

    def _load(self, raw: tuple[bytes, Token] | tuple[bytes, Token, bool] | None) -> None:
        if raw is None:
            return
        try:
            state = pickle.loads(raw[0])
        except Exception as e:
            raise RendezvousStateError("The rendezvous state is corrupt.") from e
        if not isinstance(state, _RendezvousState):
            raise RendezvousStateError("The rendezvous state is corrupt.")
        self.state, self.token = state, raw[1]

    def sync(self) -> None:
        self._load(self._backend.get_state())

    def commit(self, state: _RendezvousState) -> bool:
        self._sanitize(state)
        result = self._backend.set_state(pickle.dumps(state), self.token)
        if result is None:
            return False
        self._load(result)
        return bool(result[2])

    @property
    def can_wait(self) -> bool:
        return getattr(self._backend, "wait_for_change", None) is not None

    def wait_for_change(self, timeout: float) -> None:
        waiter = getattr(self._backend, "wait_for_change", None)
        if waiter is not None:
            waiter(self.token, timeout)
        elif timeout > 0:
            threading.Event().wait(timeout)
        self.sync()

    def _sanitize(self, state: _RendezvousState) -> None:
        """Drops nodes whose heartbeat is older than interval * max_attempt."""
        expire = _now() - self._settings.keep_alive_interval * self._settings.keep_alive_max_attempt
        dead = [n for n, beat in state.last_heartbeats.items() if beat < expire]
        removed = False
        for node in dead:
            del state.last_heartbeats[node]
            removed |= state.participants.pop(node, None) is not None
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
        if removed:
            _after_participant_removed(state, self._settings)


def _after_participant_removed(state: _RendezvousState, settings: RendezvousSettings) -> None:
    if state.complete:
        if not state.participants:
            state.complete = False
            state.round += 1
    elif len(state.participants) < settings.min_nodes:
        state.deadline = None


class _Step(Enum):
    FINISH = 1
    WAIT = 2
    COMMIT = 3


class DynamicRendezvousHandler(RendezvousHandler):
    """Represent a handler that sets up a rendezvous among a set of nodes."""

    _node_desc_generator = _NodeDescGenerator()

    @classmethod
    def from_backend(
        cls,
        run_id: str,
        store: Any,
        backend: RendezvousBackend,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        timeout: RendezvousTimeout | None = None,
        keep_alive_interval: int = 5,
        keep_alive_max_attempt: int = 3,
    ) -> DynamicRendezvousHandler:
        """Create a new :py:class:`DynamicRendezvousHandler`.

        Args:
            run_id: The run id of the rendezvous.
            store: The store to return as part of the rendezvous.
            backend: The backend that holds the rendezvous state.
            min_nodes: The minimum number of nodes to admit to the rendezvous.
            max_nodes: The maximum number of nodes to admit to the rendezvous.
            local_addr: The local node address.
            timeout: The timeout configuration of the rendezvous.
            keep_alive_interval: Seconds between keep-alive heartbeats.
            keep_alive_max_attempt: Missed heartbeats after which a node is considered dead.
        """
        node = cls._node_desc_generator.generate(local_addr)
        settings = RendezvousSettings(
            run_id, min_nodes, max_nodes, timeout or RendezvousTimeout(),
            keep_alive_interval=timedelta(seconds=keep_alive_interval),
            keep_alive_max_attempt=keep_alive_max_attempt,
        )
        return cls(node, settings, backend.name, store, _StateHolder(backend, settings))

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        backend_name: str,
        store: Any,
        state_holder: _StateHolder,
    ) -> None:
        if not settings.run_id:
            raise ValueError("The run id must be a non-empty string.")
        if settings.min_nodes < 1:
            raise ValueError(
                f"The minimum number of nodes ({settings.min_nodes}) must be greater than zero."
            )
        if settings.max_nodes < settings.min_nodes:
            raise ValueError(
                f"The maximum number of nodes ({settings.max_nodes}) must be greater than or equal "
                f"to the minimum number of nodes ({settings.min_nodes})."
            )
        self._this_node = node
        self._settings = settings
        self._backend_name = backend_name
        self._store = store
        self._holder = state_holder
        self._lock = threading.RLock()
        self._ka_stop: threading.Event | None = None

    @property
    def settings(self) -> RendezvousSettings:
        """Get the settings of the rendezvous."""
        return self._settings

    def get_backend(self) -> str:
        """See base class."""
        return self._backend_name

    @property
    def use_agent_store(self) -> bool:
        """See base class: true when the store is a TCPStore workers can connect to."""
        return self._shares_tcp_store()

    def _shares_tcp_store(self) -> bool:
        if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0") == "1":
            return False
        return type(self._store).__name__ == "TCPStore"

    def _record(self, message: str, state: NodeState, rank: int | None = None) -> None:
        construct_and_record_rdzv_event(
            run_id=self._settings.run_id, message=message, node_state=state,
            name=f"{type(self).__name__}.next_rendezvous", hostname=self._this_node.addr,
            pid=self._this_node.pid, local_id=self._this_node.local_id, rank=rank,
        )

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class."""
        self._record(f"node {self._this_node!r} joins the next round", NodeState.RUNNING)
        self._stop_heartbeats()
        deadline = time.monotonic() + self._settings.timeout.join.total_seconds()
        with self._lock:
            try:
                self._run(self._exit_step, deadline)
                self._run(self._join_step, deadline)
            except Exception as e:
                self._record(f"{type(e).__name__}: {e}", NodeState.FAILED)
                raise
            state = self._holder.state
            rank, world = state.participants[self._this_node], len(state.participants)
            round_ = state.round
        self._record(f"joined round {round_} as rank {rank} of {world}", NodeState.SUCCEEDED,
                     rank)
        self._start_heartbeats()
        from fastelastic.store import PrefixStore

        store = PrefixStore(f"torch.rendezvous.{self._settings.run_id}.{round_}", self._store)
        if self._shares_tcp_store():
            info = RendezvousStoreInfo(str(self._store.host), int(self._store.port))
        else:
            info = RendezvousStoreInfo.build(rank, store, self._this_node.addr)
        log.info("node %r joined round %d of %s as rank %d/%d", self._this_node, round_,
                 self._settings.run_id, rank, world)
        return RendezvousInfo(store, rank, world, info)

    def is_closed(self) -> bool:
        """See base class."""
        with self._lock:
            self._holder.sync()
            return self._holder.state.closed

    def set_closed(self) -> None:
        """See base class."""
        with self._lock:
            self._close()

    def num_nodes_waiting(self) -> int:
        """See base class."""
        with self._lock:
            self._holder.sync()
            return len(self._holder.state.wait_list)

    def get_run_id(self) -> str:
        """See base class."""
        return self._settings.run_id

    def shutdown(self) -> bool:
        """See base class."""
        self._stop_heartbeats()
        try:
            with self._lock:
                self._close()
            return True
        except RendezvousError as e:
            log.warning("node %r failed to shut down rendezvous %s: %s", self._this_node,
                        self._settings.run_id, type(e).__name__)
            return False

    # ------------------------------------------------------------------ state machine

    def _run(self, step: Any, deadline: float) -> None:
        """Syncs, asks ``step`` what to do, commits its mutation or waits, until FINISH."""
        self._holder.sync()
        backoff = 0.01
        for _ in range(_MAX_SYNCS):
            state = copy.deepcopy(self._holder.state)
            what = step(state, deadline)
            if what is _Step.FINISH:
                return
            if what is _Step.COMMIT:
                self._touch(state)
                if self._holder.commit(state):
                    backoff = 0.01
                continue
            wait = min(deadline - time.monotonic() + 0.001,
                       self._settings.keep_alive_interval.total_seconds())
            if state.deadline is not None:  # wake when the last call ends
                wait = min(wait, (state.deadline - _now()).total_seconds() + 0.001)
            if not self._holder.can_wait:
                wait = min(wait, backoff)
                backoff = min(backoff * 2, 0.5)
            self._holder.wait_for_change(max(0.0, wait))
        raise RendezvousStateError("The rendezvous state machine did not settle.")

    def _touch(self, state: _RendezvousState) -> None:
        if (self._this_node in state.participants or self._this_node in state.wait_list
                or self._this_node in state.redundancy_list):
            state.last_heartbeats[self._this_node] = _now()
        else:
            state.last_heartbeats.pop(self._this_node, None)

    def _exit_step(self, state: _RendezvousState, deadline: float) -> _Step:
        if self._this_node not in state.participants:
            return _Step.FINISH
        if time.monotonic() > deadline:
            raise RendezvousTimeoutError("Timed out leaving the previous rendezvous round.")
        del state.participants[self._this_node]
        _after_participant_removed(state, self._settings)
        return _Step.COMMIT

    def _join_step(self, state: _RendezvousState, deadline: float) -> _Step:
        me, s = self._this_node, self._settings
        if state.closed:
            if me in state.redundancy_list:
                raise RendezvousGracefulExitError(f"The rendezvous '{s.run_id}' is closed.")
            raise RendezvousClosedError(f"The rendezvous '{s.run_id}' is closed.")
        if me in state.redundancy_list:
            if len(state.participants) >= s.max_nodes:
                return self._wait_or_beat(state)
            state.redundancy_list.discard(me)
            return _Step.COMMIT
        joined = me in state.participants
        if state.complete and joined:
            return _Step.FINISH
        now = time.monotonic()
        if now > deadline:
            if now <= deadline + _ROLLBACK_SECONDS and (joined or me in state.wait_list):
                state.participants.pop(me, None)
                state.wait_list.discard(me)
                if joined:
                    _after_participant_removed(state, s)
                return _Step.COMMIT
            raise RendezvousTimeoutError(
                f"The rendezvous '{s.run_id}' did not complete within {s.timeout.join}."
            )
        if state.complete:
            if len(state.participants) < s.max_nodes:
                if me not in state.wait_list:
                    state.wait_list.add(me)
                    return _Step.COMMIT
            elif me not in state.wait_list:
                state.redundancy_list.add(me)
                return _Step.COMMIT
            return self._wait_or_beat(state)
        if not joined:
            state.wait_list.discard(me)
            state.participants[me] = 0
            if len(state.participants) == s.min_nodes:
                state.deadline = _now() + s.timeout.last_call
            if len(state.participants) >= s.max_nodes:
                self._complete(state)
            return _Step.COMMIT
        if (state.deadline is not None and s.min_nodes <= len(state.participants) <= s.max_nodes
                and state.deadline < _now()):
            self._complete(state)
            return _Step.COMMIT
        return self._wait_or_beat(state)

    def _wait_or_beat(self, state: _RendezvousState) -> _Step:
        beat = state.last_heartbeats.get(self._this_node)
        if beat is not None and beat <= _now() - self._settings.keep_alive_interval:
            return _Step.COMMIT
        return _Step.WAIT

    @staticmethod
    def _complete(state: _RendezvousState) -> None:
        state.complete = True
        state.deadline = None
        for rank, node in enumerate(sorted(state.participants)):
            state.participants[node] = rank

    def _close(self) -> None:
        deadline = time.monotonic() + self._settings.timeout.close.total_seconds()

        def step(state: _RendezvousState, dl: float) -> _Step:
            if state.closed:
                return _Step.FINISH
            if time.monotonic() > dl:
                raise RendezvousTimeoutError("Timed out closing the rendezvous.")
            state.closed = True
            return _Step.COMMIT

        self._run(step, deadline)

    # ------------------------------------------------------------------ keep-alive

    def _start_heartbeats(self) -> None:
        stop = threading.Event()
        self._ka_stop = stop
        interval = self._settings.keep_alive_interval.total_seconds()
        ref = weakref.ref(self)

        def beat() -> None:
            while not stop.wait(interval):
                handler = ref()
                if handler is None:
                    return
                handler._keep_alive()
                del handler

        threading.Thread(target=beat, name=f"RendezvousKeepAliveTimer_{self._this_node.local_id}",
                         daemon=True).start()

    def _stop_heartbeats(self) -> None:
        if self._ka_stop is not None:
            self._ka_stop.set()
            self._ka_stop = None

    def _keep_alive(self) -> None:
        deadline = time.monotonic() + self._settings.timeout.heartbeat.total_seconds()

        def step(state: _RendezvousState, dl: float) -> _Step:
            beat = state.last_heartbeats.get(self._this_node)
            if beat is None or beat > _now() - self._settings.keep_alive_interval:
                return _Step.FINISH
            if time.monotonic() > dl:
                raise RendezvousTimeoutError("Timed out sending a keep-alive heartbeat.")
            return _Step.COMMIT

        try:
            with self._lock:
                self._run(step, deadline)
        except RendezvousError as e:
            log.warning("node %r keep-alive failed: %s", self._this_node, type(e).__name__)


def create_handler(store: Any, backend: RendezvousBackend, params: RendezvousParameters
                   ) -> DynamicRendezvousHandler:
    """Create a new :py:class:`DynamicRendezvousHandler` from the specified parameters.

    ``rdzv_conf`` keys: ``join_timeout`` (600 s), ``last_call_timeout`` (30 s),
    ``close_timeout`` (30 s), ``heartbeat`` / ``heartbeat_timeout`` (5 s),
    ``keep_alive_interval`` (5 s), ``keep_alive_max_attempt`` (3).

    Args:
        store: The store to return as part of the rendezvous.
        backend: The backend that holds the rendezvous state.
        params: The rendezvous parameters.

    Raises:
        ValueError: A malformed option.
        TypeError: ``keep_alive_interval`` or ``keep_alive_max_attempt`` given as None.
    """
    timeout = timeout_from_params(params)
    keep_alive_interval = params.get_as_int("keep_alive_interval", 5)
    if keep_alive_interval is None:
        raise TypeError(
            "You passed 'keep_alive_interval=None' as a rendezvous configuration option"
        )
    keep_alive_max_attempt = params.get_as_int("keep_alive_max_attempt", 3)
    if keep_alive_max_attempt is None:
        raise TypeError(
            "You passed 'keep_alive_max_attempt=None' as a rendezvous configuration option"
        )
    return DynamicRendezvousHandler.from_backend(
        params.run_id, store, backend, params.min_nodes, params.max_nodes, params.local_addr,
        timeout, keep_alive_interval=keep_alive_interval,
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
