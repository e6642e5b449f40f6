"""The workers' store of a round: which node hosts it, where, and who owns its socket.

Each round's rank 0 hosts a fresh, empty store for its workers (``MASTER_ADDR`` and
``MASTER_PORT``). Workers of a restarted group use the same key names as the dead attempt
(gloo's ``default_pg/...`` addresses, for one): on a shared store they would read stale values
and connect to dead peers, so every attempt starts clean, as torch's agent-store comment
intends.

A node that joins a round binds its listening socket first and puts its address in its
record; the round's outcome carries rank 0's, so nobody waits for rank 0 after the round is
decided (at thousands of nodes that wait cost seconds). Rank 0 then starts the server on that
socket: a worker that connects sooner waits in the listen backlog, not in an error.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from fastelastic.errors import StoreError

from ..api import RendezvousStoreInfo
from ._schema import encode_wstore, parse_wstore

__all__ = ["RoundStores", "WorkerStoreHost", "is_ip"]

# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.worker_store")


def is_ip(addr: str) -> bool:
    try:
        ipaddress.ip_address(addr)
    except ValueError:
        return False
    return True


@functools.cache
def _fqdn() -> str:
    """This host's name as torch publishes it for ``MASTER_ADDR``: looked up once a process
    (every node announces its address when it joins, before ranks are known)."""
    return socket.getfqdn()


class WorkerStoreHost:
    """This node's side of the workers' store: its listening socket and, as rank 0, the server.

    One owner for each: the socket is this object's until :py:meth:`host` hands it to the
    server (which keeps its own duplicate); the server is this object's until
    :py:meth:`retire`.

    Args:
        local_addr: The address workers are given (``MASTER_ADDR``); default this host's FQDN.
    """

    def __init__(self, local_addr: str) -> None:
        self._local_addr = local_addr
        self._addr: str | None = None
        self._sock: socket.socket | None = None
        self.server: Any = None

    @property
    def addr(self) -> str:
        if self._addr is None:
            self._addr = self._local_addr or _fqdn()
        return self._addr

    def address(self) -> bytes:
        """``host:port`` the workers will use if this node is rank 0 (binds on first need).

        torch's clients cannot authenticate, so the store is open: it listens only on the
        address the workers are given when that is an address of this host (a name would
        need a lookup and may stand for several; an address of a NAT is not ours), else on
        every interface, as torch's does.
        """
        if self._sock is None:
            self._sock = self._listen()
        return encode_wstore(self.addr, self._sock.getsockname()[1])

    def _listen(self) -> socket.socket:
        addr = self.addr
        if is_ip(addr):
            family = socket.AF_INET6 if ":" in addr else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                sock.bind((addr, 0))
                sock.listen(4096)
                return sock
            except OSError as e:
                sock.close()
                log.info("workers' store: cannot listen on %s only (%s); listening on every "
                         "interface", addr, e)
        sock = socket.create_server(("", 0), family=socket.AF_INET6, dualstack_ipv6=True,
                                    backlog=4096, reuse_port=False) \
            if socket.has_dualstack_ipv6() else socket.create_server(("", 0), backlog=4096)
        return sock

    def host(self, timeout: timedelta) -> Any:
        """Starts this round's server on the socket announced by :py:meth:`address`."""
        from fastelastic.store import TCPStore

        self.retire()
        if self._sock is None:
            self.address()
        sock, self._sock = self._sock, None
        assert sock is not None
        try:
            self.server = TCPStore("", 0, is_master=True, wait_for_workers=False,
                                   timeout=timeout, master_listen_fd=sock.fileno())
        finally:
            sock.close()  # the server listens on its own duplicate
        return self.server

    def meet(self, rank: int, key: str, meet: Any, addr: bytes, timeout: timedelta,
             wait: Callable[[Any, list[str], float], None]) -> tuple[str, int]:
        """The workers' store of a round: (host, port); rank 0 hosts it, the others retire
        theirs.

        ``addr`` is rank 0's announced address, from the round's outcome. Without one (a
        round decided by an older node) rank 0 publishes it at ``key`` through ``meet`` with
        one ``set`` and the others read it with one ``get`` once ``wait(meet, [key],
        deadline)`` returns. ``MASTER_ADDR`` is rank 0's ``local_addr``, else its FQDN, as
        torch publishes it.
        """
        if rank == 0:
            server = self.host(timeout)
            if not addr:
                addr = encode_wstore(self.addr, server.port)
                meet.set(key, addr)
        else:
            self.retire()
            if not addr:
                wait(meet, [key], time.monotonic() + timeout.total_seconds())
                addr = bytes(meet.get(key))
        return parse_wstore(addr)

    def retire(self) -> None:
        """Stops the last round's server (its workers were stopped before re-joining)."""
        server, self.server = self.server, None
        if server is not None:
            try:
                server.shutdown_server()
            except StoreError as e:  # pragma: no cover - best effort on the way out
                log.debug("workers' store: shutdown: %s", e)

    def close(self) -> None:
        self.retire()
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()


class RoundStores:
    """Mixin of ``FastRendezvousHandler``: each round's agents' store (a per-round prefix of the
    rendezvous store) and its workers' store (hosted by rank 0, :class:`WorkerStoreHost`)."""

    if TYPE_CHECKING:
        _store: Any
        _wstore: WorkerStoreHost
        _local_addr: str
        _m: Any

        @property
        def store_prefix(self) -> str | None: ...
        @property
        def use_agent_store(self) -> bool: ...
        def wait_members(self, store: Any, keys: list[str], deadline: float) -> None: ...

    def _round_store(self, r: int, rank: int,
                     wstore: bytes = b"") -> tuple[Any, RendezvousStoreInfo]:
        """The agents' store (prefixed per round) and the workers' store address."""
        from fastelastic.store import PrefixStore

        round_store = PrefixStore(str(self.store_prefix), self._store)
        if not self.use_agent_store:
            # torch's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: rank 0's workers host their own.
            return round_store, RendezvousStoreInfo.build(rank, round_store, self._local_addr)
        return round_store, self._worker_store_info(r, rank, self._store, wstore)

    def _worker_store_info(self, r: int, rank: int, meet: Any,
                           addr: bytes = b"") -> RendezvousStoreInfo:
        """The workers' store of round ``r``: rank 0 hosts it (``WorkerStoreHost.meet``)."""
        host, port = self._wstore.meet(rank, self._m.keys.round(r).wstore, meet, addr,
                                       self._store.timeout, self.wait_members)
        return RendezvousStoreInfo(host, port)

    @property
    def _worker_server(self) -> Any:
        return self._wstore.server

    def _retire_worker_store(self) -> None:
        """Stops the previous round's worker store (its workers were stopped before re-joining)."""
        self._wstore.retire()
