"""torchrun plugin: ``--rdzv-backend=fastelastic`` runs our rendezvous and store under torch.

pyproject declares the ``torchrun.handlers`` entry point ``fastelastic =
fastelastic.rendezvous.torch_plugin:handler_generator``. torch calls :func:`handler_generator`
and registers what it returns as the creator for ``fastelastic``. The handler subclasses
torch's ``RendezvousHandler`` and hands torch its own types: torch's ``RendezvousInfo`` and a
torch ``TCPStore`` client connected to fastelastic's store server (same wire protocol).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["handler_generator"]


def _make_handler_class() -> type:
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import api as torch_api

    from fastelastic.errors import RendezvousError

    from .api import RendezvousParameters
    from .fast.fast_rendezvous import FastRendezvousHandler, create_fast_handler

    class FastElasticTorchHandler(torch_api.RendezvousHandler):
        """torch-typed facade over :class:`FastRendezvousHandler`.

        Args:
            inner: The fastelastic handler doing the rendezvous.
        """

        def __init__(self, inner: FastRendezvousHandler) -> None:
            self._inner = inner
            self._client: Any = None
            self._client_at: tuple[str, int] | None = None

        def get_backend(self) -> str:
            return self._inner.get_backend()

        @property
        def use_agent_store(self) -> bool:
            return self._inner.use_agent_store

        def next_rendezvous(self) -> Any:
            try:
                info = self._inner.next_rendezvous()
            except RendezvousError as e:
                # torch's agent catches its own classes (a spare's graceful exit, closed, ...)
                kind = getattr(torch_api, type(e).__name__, torch_api.RendezvousError)
                raise kind(str(e)) from e
            boot = info.bootstrap_store_info
            assert boot is not None
            # Each round has a fresh workers' store (its rank 0 hosts it): connect to this
            # round's, not to the first one, which its host stopped when it re-joined.
            if self._client is None or self._client_at != (boot.master_addr, boot.master_port):
                self._client = dist.TCPStore(
                    boot.master_addr, boot.master_port, is_master=False,
                    timeout=self._inner.store.timeout, wait_for_workers=False,
                )
                self._client_at = (boot.master_addr, boot.master_port)
            store = dist.PrefixStore(str(self._inner.store_prefix), self._client)
            return torch_api.RendezvousInfo(
                store, info.rank, info.world_size,
                torch_api.RendezvousStoreInfo(boot.master_addr, boot.master_port),
            )

        def is_closed(self) -> bool:
            return self._inner.is_closed()

        def set_closed(self) -> None:
            self._inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self._inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self._inner.get_run_id()

        def shutdown(self) -> bool:
            return self._inner.shutdown()

    def create(params: Any) -> FastElasticTorchHandler:
        ours = RendezvousParameters(
            params.backend, params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
            params.local_addr, **params.config,
        )
        return FastElasticTorchHandler(create_fast_handler(ours))

    FastElasticTorchHandler.create = staticmethod(create)  # type: ignore[attr-defined]
    return FastElasticTorchHandler


def handler_generator() -> Callable[[Any], Any]:
    """Returns the creator torch registers for the ``fastelastic`` rendezvous backend.

    Returns:
        ``fn(params: torch RendezvousParameters) -> torch RendezvousHandler``.
    """
    return _make_handler_class().create  # type: ignore[attr-defined, no-any-return]
