"""torch's ``elastic.utils.distributed``: a c10d store with retries, and free local ports."""

from __future__ import annotations

import errno
import logging
from contextlib import closing
from datetime import timedelta
from typing import Any

from fastelastic.errors import StoreError
from fastelastic.utils.api import get_socket_with_port
from fastelastic.utils.store import barrier

__all__ = ["create_c10d_store", "get_free_port", "get_socket_with_port"]

logger = logging.getLogger(__name__)

_TCP_STORE_INIT = "_tcp_store/num_members"


def create_c10d_store(
    is_server: bool,
    server_addr: str,
    server_port: int = -1,
    world_size: int = 1,
    timeout: float = (60 * 10),
    wait_for_workers: bool = True,
    retries: int = 3,
    use_libuv: bool | None = None,
) -> Any:
    """Creates (``is_server``) or joins a ``TCPStore``; with ``wait_for_workers`` returns once
    ``world_size`` members have joined.

    With ``server_port=-1`` the server picks a free port, retrying ``retries`` times if another
    process takes it first. ``use_libuv`` is accepted and ignored, as in torch (our server is
    always the native one).

    Raises:
        ValueError: ``server_port=-1`` with ``world_size > 1`` (clients could not find it).
        RuntimeError: the port stayed in use.
        TimeoutError: not all members joined within ``timeout`` seconds.
    """
    from fastelastic.store import TCPStore

    if use_libuv is not None:
        logger.warning("argument use_libuv is deprecated and ignored")
    if server_port == -1 and world_size > 1:
        raise ValueError(
            f"server_port must be specified when world_size > 1, got server_port={server_port}, "
            f"world_size={world_size}"
        )
    attempt = retries if server_port == -1 else 1
    while True:
        port = server_port if server_port != -1 else get_free_port()
        logger.info(
            "Creating c10d store on %s:%s (world_size=%s, is_server=%s, timeout=%ss)",
            server_addr, port, world_size, is_server, timeout,
        )
        try:
            store = TCPStore(
                host_name=server_addr,
                port=port,
                world_size=world_size,
                is_master=is_server,
                timeout=timedelta(seconds=timeout),
                wait_for_workers=wait_for_workers,
            )
        except (StoreError, OSError) as e:
            if not (is_server and _address_in_use(e)):
                raise
            if attempt >= retries:
                raise RuntimeError(f"on {server_addr}, port: {port} already in use") from e
            logger.warning("port: %s already in use, attempt: [%s/%s]", port, attempt, retries)
            attempt += 1
            continue
        if wait_for_workers:
            try:
                barrier(store, world_size, key_prefix=_TCP_STORE_INIT, barrier_timeout=timeout)
            except StoreError as e:
                raise TimeoutError(
                    f"timed out waiting for all {world_size} members to join"
                ) from e
        logger.info("Successfully created c10d store")
        return store


def _address_in_use(e: BaseException | None) -> bool:
    while e is not None:
        if (isinstance(e, OSError) and e.errno == errno.EADDRINUSE) or "in use" in str(e):
            return True
        e = e.__cause__
    return False


def get_free_port() -> int:
    """Returns a port of ``localhost`` that was free a moment ago (not reserved: another process
    may take it before you bind it)."""
    with closing(get_socket_with_port()) as sock:
        return int(sock.getsockname()[1])

