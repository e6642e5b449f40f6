"""Loopback stores for the failover tests: a multi-tenant store, and a port nothing listens on
(a candidate that refuses the connection)."""

from __future__ import annotations

import socket
from datetime import timedelta

from fastelastic.store import TCPStore


def store(port: int = 0) -> TCPStore:
    return TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                    multi_tenant=True, timeout=timedelta(seconds=30))


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there: refused
    return port
