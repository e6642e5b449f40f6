"""The rendezvous contract: handler interface, info/parameter types and the handler registry."""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousStateError,
    RendezvousTimeoutError,
)

__all__ = [
    "RendezvousClosedError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousGracefulExitError",
    "RendezvousHandler",
    "RendezvousHandlerCreator",
    "RendezvousHandlerRegistry",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousStateError",
    "RendezvousStoreInfo",
    "RendezvousTimeoutError",
    "rendezvous_handler_registry",
]

_TRUE_STRINGS = frozenset(("1", "true", "t", "yes", "y"))
_FALSE_STRINGS = frozenset(("0", "false", "f", "no", "n"))


def _free_port() -> int:
    """Returns a TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _as_text(value: Any) -> str:
    return value.decode("utf-8") if isinstance(value, (bytes, bytearray)) else str(value)


@dataclass
class RendezvousStoreInfo:
    """Store address and port that trainer code can use to bootstrap distributed comms."""

    MASTER_ADDR_KEY: ClassVar[str] = "MASTER_ADDR"
    MASTER_PORT_KEY: ClassVar[str] = "MASTER_PORT"

    master_addr: str
    master_port: int

    @staticmethod
    def build(
        rank: int,
        store: Any,
        local_addr: str | None,
        server_port: int | None = None,
    ) -> RendezvousStoreInfo:
        """Publishes (rank 0) and reads (everyone) the bootstrap address through ``store``.

        Args:
            rank: Rank of the calling node; rank 0 publishes the address.
            store: The store of the rendezvous round.
            local_addr: Address of this node; rank 0 falls back to its FQDN.
            server_port: Port of a shared TCPStore server; rank 0 otherwise picks a free port.

        Returns:
            The address and port rank 0 published.
        """
        if rank == 0:
            addr = local_addr or socket.getfqdn()
            port = server_port or _free_port()
            store.set(RendezvousStoreInfo.MASTER_ADDR_KEY, addr.encode("utf-8"))
            store.set(RendezvousStoreInfo.MASTER_PORT_KEY, str(port).encode("utf-8"))
        addr = _as_text(store.get(RendezvousStoreInfo.MASTER_ADDR_KEY))
        port = int(_as_text(store.get(RendezvousStoreInfo.MASTER_PORT_KEY)))
        return RendezvousStoreInfo(master_addr=addr, master_port=port)


class RendezvousInfo:
    """Holds the information about the rendezvous."""

    def __init__(
        self,
        store: Any,
        rank: int,
        world_size: int,
        bootstrap_store_info: RendezvousStoreInfo,
    ) -> None:
        self._store = store
        self._rank = rank
        self._world_size = world_size
        self._bootstrap_store_info = bootstrap_store_info

    @property
    def store(self) -> Any:
        """Store used by the elastic control plane.

        A ``torch.distributed.Store`` (wrapping ours) when this process has imported
        ``torch.distributed``, so it can go to ``init_process_group(store=...)``; our plain store
        otherwise (the launcher never imports torch).
        """
        from fastelastic.store._torch import maybe_torch_store

        self._store = maybe_torch_store(self._store)
        return self._store

    @property
    def rank(self) -> int:
        """Rank within the group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """Global group size."""
        return self._world_size

    @property
    def bootstrap_store_info(self) -> RendezvousStoreInfo | None:
        """Store information trainer code can use to bootstrap distributed comms."""
        return self._bootstrap_store_info

    def __repr__(self) -> str:
        return (
            f"RendezvousInfo(rank={self._rank}, world_size={self._world_size}, "
            f"bootstrap_store_info={self._bootstrap_store_info!r})"
        )


class RendezvousHandler(ABC):
    """Main rendezvous interface.

    Note:
        Most users do not implement their own handler: the ``c10d`` handler on fastelastic's
        store is the recommended one.
    """

    @abstractmethod
    def get_backend(self) -> str:
        """Return the name of the rendezvous backend."""

    @property
    def use_agent_store(self) -> bool:
        """Whether the store returned by :py:meth:`next_rendezvous` can be shared with workers.

        The handler then shares the store's address as :py:class:`RendezvousStoreInfo`; by
        convention applications find it through ``MASTER_ADDR``/``MASTER_PORT``.
        """
        return False

    @abstractmethod
    def next_rendezvous(self) -> RendezvousInfo:
        """Main entry point into the rendezvous barrier.

        Blocks until the rendezvous is complete and this node is included in the formed group,
        or a timeout occurs, or the rendezvous is closed.

        Returns:
            Instance of :py:class:`RendezvousInfo`.

        Raises:
            RendezvousClosedError: The rendezvous is closed.
            RendezvousConnectionError: The connection to the rendezvous backend failed.
            RendezvousStateError: The rendezvous state is corrupt.
            RendezvousTimeoutError: The rendezvous did not complete on time.
        """

    @abstractmethod
    def is_closed(self) -> bool:
        """Check whether the rendezvous has been closed.

        A closed rendezvous means all future attempts to re-rendezvous within the same job
        fail. The flag propagates eventually and must not be used for synchronization.
        """

    @abstractmethod
    def set_closed(self) -> None:
        """Mark the rendezvous as closed."""

    @abstractmethod
    def num_nodes_waiting(self) -> int:
        """Return the number of nodes that arrived late and are not in the current group.

        Callers check this periodically and admit waiting nodes by calling
        :py:meth:`next_rendezvous` again (re-rendezvous).
        """

    @abstractmethod
    def get_run_id(self) -> str:
        """Return the run id: the user-defined id of one distributed application instance."""

    @abstractmethod
    def shutdown(self) -> bool:
        """Close all resources that were opened for the rendezvous.

        Returns:
            True if the resources were released.
        """


class RendezvousParameters:
    """Hold the parameters to construct a :py:class:`RendezvousHandler`.

    Args:
        backend: The name of the backend to use to handle the rendezvous.
        endpoint: The endpoint of the rendezvous, usually in form ``<hostname>[:<port>]``.
        run_id: The id of the rendezvous.
        min_nodes: The minimum number of nodes to admit to the rendezvous.
        max_nodes: The maximum number of nodes to admit to the rendezvous.
        local_addr: The address of the local node.
        **kwargs: Additional parameters for the specified backend.

    Raises:
        ValueError: ``backend`` is empty, ``min_nodes < 1`` or ``max_nodes < min_nodes``.
    """

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1:
            raise ValueError(
                f"The minimum number of rendezvous nodes ({min_nodes}) must be greater than zero."
            )
        if max_nodes < min_nodes:
            raise ValueError(
                f"The maximum number of rendezvous nodes ({max_nodes}) must be greater than or "
                f"equal to the minimum number of rendezvous nodes ({min_nodes})."
            )
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.config = kwargs
        self.local_addr = local_addr

    def get(self, key: str, default: Any = None) -> Any:
        """Return the value for ``key`` if ``key`` exists, else ``default``."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        """Return the value for ``key`` as a ``bool``.

        Raises:
            ValueError: The value is not one of 1/0, true/false, t/f, yes/no, y/n.
        """
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        if isinstance(value, int):
            if value in (0, 1):
                return value == 1
        elif isinstance(value, str):
            lowered = value.lower()
            if lowered in _TRUE_STRINGS:
                return True
            if lowered in _FALSE_STRINGS:
                return False
        raise ValueError(
            f"The rendezvous configuration option '{key}' does not represent a valid boolean value."
        )

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        """Return the value for ``key`` as an ``int``.

        Raises:
            ValueError: The value does not parse as an integer.
        """
        value = self.get(key, default)
        if value is None:
            return value
        try:
            return int(value)
        except ValueError as e:
            raise ValueError(
                f"The rendezvous configuration option '{key}' does not represent a valid integer "
                "value."
            ) from e

    def __repr__(self) -> str:
        return (
            f"RendezvousParameters(backend={self.backend!r}, endpoint={self.endpoint!r}, "
            f"run_id={self.run_id!r}, min_nodes={self.min_nodes}, max_nodes={self.max_nodes}, "
            f"local_addr={self.local_addr!r}, config={self.config!r})"
        )


RendezvousHandlerCreator = Callable[[RendezvousParameters], RendezvousHandler]


class RendezvousHandlerRegistry:
    """Represent a registry of :py:class:`RendezvousHandler` backends."""

    _registry: dict[str, RendezvousHandlerCreator]
    # the default registry loads a backend it lacks from a torchrun.handlers entry point
    _load_missing: Callable[[str], bool] | None = None

    def __init__(self) -> None:
        self._registry = {}

    def register(self, backend: str, creator: RendezvousHandlerCreator) -> None:
        """Register a new rendezvous backend.

        Args:
            backend: The name of the backend.
            creator: The callback to invoke to construct the :py:class:`RendezvousHandler`.

        Raises:
            ValueError: The name is empty or already registered with a different creator.
        """
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        current = self._registry.get(backend)
        if current is not None and current != creator:
            raise ValueError(
                f"The rendezvous backend '{backend}' cannot be registered with '{creator}' as it "
                f"is already registered with '{current}'."
            )
        self._registry[backend] = creator

    def create_handler(self, params: RendezvousParameters) -> RendezvousHandler:
        """Create a new :py:class:`RendezvousHandler` for ``params.backend``.

        The default registry first loads a backend it lacks from the ``torchrun.handlers``
        entry point of that name (third-party plugins, as torchrun registers them).

        Raises:
            ValueError: The backend is not registered.
            RuntimeError: The created handler reports a different backend name.
        """
        if params.backend not in self._registry and self._load_missing is not None:
            self._load_missing(params.backend)
        try:
            creator = self._registry[params.backend]
        except KeyError as e:
            raise ValueError(
                f"The rendezvous backend '{params.backend}' is not registered. Did you forget "
                f"to call `{self.register.__name__}`?"
            ) from e
        handler = creator(params)
        if handler.get_backend() != params.backend:
            raise RuntimeError(
                f"The rendezvous backend '{handler.get_backend()}' does not match the requested "
                f"backend '{params.backend}'."
            )
        return handler


rendezvous_handler_registry = RendezvousHandlerRegistry()
"""The default global registry used by launchers to instantiate rendezvous handlers."""
