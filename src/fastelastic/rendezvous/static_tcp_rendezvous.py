"""The ``static`` rendezvous: a fixed node count, node rank from the parameters, one store."""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from .api import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from .utils import parse_rendezvous_endpoint

__all__ = ["StaticTCPRendezvous", "create_rdzv_handler"]

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT_SECONDS = 600


class StaticTCPRendezvous(RendezvousHandler):
    """Static rendezvous over a TCPStore hosted by the node with rank 0.

    Args:
        master_addr: Host of the store.
        master_port: Port of the store.
        rank: This node's rank.
        world_size: Number of nodes.
        run_id: The run id; the returned store is prefixed with it.
        timeout: Store timeout in seconds.
    """

    def __init__(
        self,
        master_addr: str,
        master_port: int,
        rank: int,
        world_size: int,
        run_id: str,
        timeout: int,
    ) -> None:
        self.master_addr = master_addr
        self.master_port = master_port
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self.timeout = timedelta(seconds=timeout)
        self._store: Any = None

    def get_backend(self) -> str:
        """See base class."""
        return "static"

    @property
    def use_agent_store(self) -> bool:
        """See base class."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """See base class: rank 0 hosts the store, the others connect to it."""
        from fastelastic.store import PrefixStore, TCPStore

        if self._store is None:
            self._store = TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                self.rank == 0,
                self.timeout,
                multi_tenant=True,
            )
        return RendezvousInfo(
            PrefixStore(self.run_id, self._store),
            self.rank,
            self.world_size,
            RendezvousStoreInfo(self.master_addr, self.master_port),
        )

    def is_closed(self) -> bool:
        """See base class: a static rendezvous never closes."""
        return False

    def set_closed(self) -> None:
        """See base class: nothing to close."""

    def num_nodes_waiting(self) -> int:
        """See base class: membership is fixed, nobody waits."""
        return 0

    def get_run_id(self) -> str:
        """See base class."""
        return self.run_id

    def shutdown(self) -> bool:
        """See base class: closes this node's connection to the store, which it made.

        Rank 0's hosted server keeps serving the other nodes for as long as this handler
        lives (they may still be finishing); it stops with the handler, as torch's does with
        its process.
        """
        if self._store is not None:
            self._store.close()
        return True


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Creates a :class:`StaticTCPRendezvous` (``rank`` and ``timeout`` from ``rdzv_conf``).

    Raises:
        ValueError: ``rank`` missing or out of range, no endpoint, or no port in it.
    """
    if "rank" not in params.config:
        raise ValueError(
            "rank is absent in RendezvousParameters. Try add --node-rank to the cmd request"
        )
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError(
            "endpoint is absent in RendezvousParameters. Try add --master-port and "
            "--master-addr to the cmd request"
        )
    master_addr, master_port = parse_rendezvous_endpoint(endpoint, -1)
    if master_port == -1:
        raise ValueError(
            f"Port is absent in endpoint: {endpoint}. Try launching with --master-port"
        )
    world_size = params.max_nodes
    rank = params.get_as_int("rank")
    assert rank is not None
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is out of range for {world_size} nodes")
    timeout = params.get_as_int("timeout", _DEFAULT_TIMEOUT_SECONDS)
    return StaticTCPRendezvous(
        master_addr, master_port, rank, world_size, params.run_id,
        timeout or _DEFAULT_TIMEOUT_SECONDS,
    )
