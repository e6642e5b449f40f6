"""The default rendezvous backends and :func:`get_rendezvous_handler`."""

from __future__ import annotations

import logging

from .api import RendezvousHandler, RendezvousParameters, rendezvous_handler_registry

__all__ = ["get_rendezvous_handler"]

log = logging.getLogger(__name__)

PLUGIN_GROUP = "torchrun.handlers"


def _create_static_handler(params: RendezvousParameters) -> RendezvousHandler:
    from .static_tcp_rendezvous import create_rdzv_handler

    return create_rdzv_handler(params)


def _create_c10d_handler(params: RendezvousParameters) -> RendezvousHandler:
    if str(params.get("store_type", "tcp")).strip().lower() == "file":
        # torch's dynamic rendezvous over a FileStore (no store server to host)
        return _create_c10d_v2_handler(params)
    from .fast.fast_rendezvous import create_fast_handler

    return create_fast_handler(params)


def _create_etcd_handler(params: RendezvousParameters) -> RendezvousHandler:
    from .etcd_rendezvous import create_rdzv_handler

    return create_rdzv_handler(params)


def _create_etcd_v2_handler(params: RendezvousParameters) -> RendezvousHandler:
    from .dynamic_rendezvous import create_handler
    from .etcd_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    return create_handler(store, backend, params)


def _create_c10d_v2_handler(params: RendezvousParameters) -> RendezvousHandler:
    from .c10d_rendezvous_backend import create_backend
    from .dynamic_rendezvous import create_handler

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    # The handler answers to the name it was asked for ("c10d-v2" is our alias of torch's
    # dynamic "c10d" path; the registry checks the name, as torch's does)
    handler._backend_name = params.backend
    return handler


def _register_default_handlers() -> None:
    rendezvous_handler_registry.register("static", _create_static_handler)
    rendezvous_handler_registry.register("c10d", _create_c10d_handler)
    rendezvous_handler_registry.register("fastelastic", _create_c10d_handler)
    rendezvous_handler_registry.register("etcd", _create_etcd_handler)
    rendezvous_handler_registry.register("etcd-v2", _create_etcd_v2_handler)
    rendezvous_handler_registry.register("c10d-v2", _create_c10d_v2_handler)
    rendezvous_handler_registry._load_missing = _register_out_of_tree_handler


def _register_out_of_tree_handler(name: str) -> bool:
    """Registers the backend ``name`` from a ``torchrun.handlers`` entry point, as torchrun does.

    The entry point is a function returning the handler creator. Only the entry point named
    ``name`` is loaded, when ``name`` is asked for and not registered (built-in names win, as
    in torchrun, where registering a clashing plugin fails): plugins nobody uses are never
    imported. fastelastic's own entry point (its torchrun plugin) is skipped.

    Returns:
        Whether a creator for ``name`` is registered now.
    """
    from importlib import metadata

    for ep in metadata.entry_points(group=PLUGIN_GROUP, name=name):
        if ep.value.split(".", 1)[0].split(":", 1)[0] == "fastelastic":
            continue
        try:
            rendezvous_handler_registry.register(name, ep.load()())
            log.info("registered rendezvous backend %r from the %s entry point %s",
                     name, PLUGIN_GROUP, ep.value)
            return True
        except Exception:
            log.warning("Exception while registering out of tree plugin %s: ", name,
                        exc_info=True)
    return False


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Obtains a :py:class:`RendezvousHandler` for ``params.backend`` from the default registry.

    Custom handlers are added with ``rendezvous_handler_registry.register(name, creator)``.

    Args:
        params: The rendezvous parameters; ``params.backend`` picks the creator.

    Returns:
        A new handler.

    Raises:
        ValueError: The backend is not registered.
    """
    return rendezvous_handler_registry.create_handler(params)
