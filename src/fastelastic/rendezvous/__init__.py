"""Rendezvous: gathers a job's nodes, agrees on membership and rank order, hands out the store.

Mirrors ``torch.distributed.elastic.rendezvous``. Registered backends: ``c10d`` and
``fastelastic`` (the fast design on fastelastic's TCPStore), ``static``, ``etcd`` (etcd v3, fast
design), and the torch-shaped dynamic-rendezvous paths ``c10d-v2`` and ``etcd-v2``.
"""

from .api import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousHandler,
    RendezvousHandlerCreator,
    RendezvousHandlerRegistry,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStateError,
    RendezvousStoreInfo,
    RendezvousTimeoutError,
    rendezvous_handler_registry,
)
from .registry import _register_default_handlers, get_rendezvous_handler

_register_default_handlers()

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
    "get_rendezvous_handler",
    "rendezvous_handler_registry",
]
