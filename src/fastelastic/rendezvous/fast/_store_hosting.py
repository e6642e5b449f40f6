"""Hosting or joining the rendezvous store at the endpoint (the c10d/fastelastic handlers)."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta
from typing import Any

from fastelastic.errors import RendezvousConnectionError, StoreError

from ..utils import _matches_machine_hostname

# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.store_hosting")


def host_store(
    host: str, port: int, is_host: bool | None, read_timeout: timedelta,
    token: bytes | None = None,
) -> tuple[Any, Any]:
    """Hosts the store on ``port`` if this node is the host, else connects (with ``token``,
    the store serves only clients that prove it; see fastelastic.store.auth).

    Returns:
        ``(client, server)``; ``server`` is None when another process hosts it.
    """
    from fastelastic.store import TCPStore

    if is_host is None:
        is_host = _matches_machine_hostname(host)
    if is_host:
        # Our server listens on every interface and its own client connects over loopback, so
        # check here, once, that the endpoint's host resolves: torch's fails to connect to it.
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError) as e:
            raise RendezvousConnectionError(
                f"The rendezvous store host {host!r} (of the endpoint {host}:{port}) cannot be "
                f"resolved: {e}"
            ) from e
        try:
            server = TCPStore(host, port, is_master=True, multi_tenant=True,
                              wait_for_workers=False, timeout=read_timeout, token=token)
            return server, server
        except (StoreError, OSError) as e:
            log.info("store on %s:%d already hosted (%s); joining as a client", host, port, e)
    try:
        client = TCPStore(host, port, is_master=False, timeout=read_timeout, token=token)
    except (StoreError, OSError) as e:
        raise RendezvousConnectionError(
            f"The rendezvous store at {host}:{port} could not be reached: {e}"
        ) from e
    return client, None




def token_from(params: Any) -> bytes | None:
    """The rendezvous store's shared secret: ``--rdzv-conf token_file=PATH``, else
    ``$FASTELASTIC_STORE_TOKEN_FILE``; None when neither is set."""
    from fastelastic.store.auth import TOKEN_FILE_ENV, read_token

    token_file = params.get("token_file") or os.environ.get(TOKEN_FILE_ENV)
    return read_token(str(token_file)) if token_file else None
