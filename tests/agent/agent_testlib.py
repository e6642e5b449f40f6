"""Helpers for the agent tests: real TCP store clients and a static rendezvous over them."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from typing import Any

import pytest

from fastelastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)


def _store_classes() -> Any:
    try:
        from fastelastic.store import TCPStore

        return TCPStore
    except ImportError:
        pass
    try:
        from torch.distributed import TCPStore

        return TCPStore
    except ImportError:
        pytest.skip("!!! neither fastelastic.store.TCPStore nor torch's TCPStore is importable")


@pytest.fixture
def store_server():
    """A store server on loopback (fastelastic's when present, else torch's)."""
    cls = _store_classes()
    server = cls(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    yield server
    stop = getattr(server, "shutdown_server", None)  # ours; torch's ends with its object
    if stop is not None:
        stop()


def store_client(server: Any) -> Any:
    return type(server)(
        "127.0.0.1",
        server.port,
        is_master=False,
        wait_for_workers=False,
        timeout=timedelta(seconds=30),
    )


class CountingStore:
    """Wraps a store and counts the calls the rank exchange makes."""

    def __init__(self, store: Any):
        self._store = store
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def counted(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kwargs)

        return counted


class StoreRendezvous(RendezvousHandler):
    """A static rendezvous over a real store: fixed rank and world size, one round per call.

    ``waiting`` is what ``num_nodes_waiting`` reports (tests raise it to fake a new node).
    Its store client is its own: :py:meth:`shutdown` closes it. The test owns it (see
    :func:`owned`).
    """

    def __init__(
        self,
        server: Any,
        rank: int,
        world_size: int,
        run_id: str = "test",
        use_agent_store: bool = True,
    ):
        self._server = server
        self._rank = rank
        self._world_size = world_size
        self._run_id = run_id
        self._use_agent_store = use_agent_store
        self.rounds = 0
        self.waiting = 0
        self.store: Any = None
        owned(self)

    def get_backend(self) -> str:
        return "test-static"

    @property
    def use_agent_store(self) -> bool:
        return self._use_agent_store

    def next_rendezvous(self) -> RendezvousInfo:
        self.rounds += 1
        self.waiting = 0
        if self.store is None:
            self.store = store_client(self._server)
        return RendezvousInfo(
            self.store,
            self._rank,
            self._world_size,
            RendezvousStoreInfo("127.0.0.1", self._server.port),
        )

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        return None

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        store, self.store = self.store, None
        if store is not None:
            store.close()
        return True


_OWNED: list[RendezvousHandler] = []


def owned(handler: Any) -> Any:
    """Registers a rendezvous handler the test made: the test owns it, as the launcher owns a
    real one (the agent never shuts its handler down). ``shut_down_rendezvous`` shuts it down
    when the test ends."""
    _OWNED.append(handler)
    return handler


@pytest.fixture(autouse=True)
def shut_down_rendezvous():
    """Shuts down every rendezvous handler the test made (closes their store clients)."""
    yield
    made, _OWNED[:] = list(_OWNED), []
    for handler in made:
        handler.shutdown()


@pytest.fixture
def no_identical_env(monkeypatch):
    monkeypatch.delenv("TORCH_ELASTIC_WORKER_IDENTICAL", raising=False)
    monkeypatch.delenv("FASTELASTIC_WORKER_IDENTICAL", raising=False)


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))
