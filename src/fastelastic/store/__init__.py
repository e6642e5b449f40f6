"""The key-value store agents and workers meet on: ``Store``, ``TCPStore``, ``PrefixStore``.

``TCPStore`` has the constructor and methods of ``torch.distributed.TCPStore`` and speaks the
same wire protocol, so torch's clients can use our server and our client can use torch's.
"""

from __future__ import annotations

import abc
import random
import socket
import time
import weakref
from datetime import timedelta
from typing import Iterable, Optional, Union

from fastelastic._native.kvclient import HandshakeReset, KVClient
from fastelastic.errors import StoreConnectionError, StoreTimeoutError
from fastelastic.store import _torch
from fastelastic.store._hosting import (
    ServerHandle,
    host_server,
    raise_fd_limit,
    set_keepalive,
    spin_us,
)
from fastelastic.store._torch import as_torch_store
from fastelastic.store.auth import token_from_env

__all__ = [
    "Store", "TCPStore", "PrefixStore", "as_torch_store", "connect_socket", "raise_fd_limit"
]

_DEFAULT_TIMEOUT = timedelta(seconds=300)
_HANDSHAKE_ATTEMPTS = 5
Value = Union[str, bytes]


class Store(abc.ABC):
    """What every store offers (torch's ``torch.distributed.Store`` interface)."""

    @abc.abstractmethod
    def set(self, key: str, value: Value) -> None: ...

    @abc.abstractmethod
    def get(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def add(self, key: str, value: int) -> int: ...

    @abc.abstractmethod
    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes: ...

    @abc.abstractmethod
    def wait(self, keys: list[str], timeout: Optional[timedelta] = None) -> None: ...


def _seconds(timeout: Union[timedelta, float, int]) -> float:
    return timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)


def connect_socket(host: str, port: int, deadline: float) -> socket.socket:
    """Connects to host:port, retrying refused or reset connections until deadline (monotonic).

    The host name is resolved once, before the first attempt, never per request. The socket
    ends within ``FASTELASTIC_STORE_KEEPALIVE_S`` of the server's host vanishing (keep-alive
    probes and ``TCP_USER_TIMEOUT``), so no call waits forever on a dead link.
    """
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise StoreConnectionError(f"cannot resolve the store host {host!r}: {e}") from e
    delay = 0.01
    last: Optional[OSError] = None
    while True:
        for fam, stype, proto, _, addr in addrs:
            sock = socket.socket(fam, stype, proto)
            set_keepalive(sock)
            sock.settimeout(max(0.05, deadline - time.monotonic()))
            try:
                sock.connect(addr)
                sock.settimeout(None)
                return sock
            except OSError as e:
                sock.close()
                last = e
        if time.monotonic() >= deadline:
            raise StoreConnectionError(
                f"cannot reach the store at {host}:{port}: {last}. Check that the host that "
                "hosts the store is up, that the address and port are right, and that no "
                "firewall is in the way."
            ) from last
        time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
        delay = min(delay * 2, 1.0) * (0.75 + random.random() / 2)


class TCPStore(KVClient, Store):
    """A TCP key-value store client; with ``is_master=True`` it also hosts the server.

    Args:
        host_name: the server's host (for the master: its own address; it listens on all).
        port: the server's port; 0 with ``is_master=True`` picks a free one (see ``port``).
        world_size: with ``wait_for_workers``, the number of clients to wait for.
        is_master: host the server in a background thread of this process.
        timeout: default for waits and for connecting.
        wait_for_workers: count this client in, and (master) wait for ``world_size`` of them.
        multi_tenant: masters in one process on the same port share one server.
        master_listen_fd: an already listening socket for the server to use.
        use_libuv: accepted for torch compatibility; our server is always the native one.
        server_limits: (master only) the hosted server's bounds, as keyword arguments of
            :class:`~fastelastic._native.kvserver.KVServer` (``max_reply``, ``max_unsent``,
            ``buffer_budget``, ``handshake_ms``, ``max_key``, ``max_value``, ``max_keys``,
            ``max_actions``, ``max_action_bytes``).
        token: a shared secret (see :mod:`fastelastic.store.auth`). A master given one hosts a
            server that serves only clients proving it; a client proves it when the server
            asks. None: a client uses ``FASTELASTIC_STORE_TOKEN_FILE`` if set; a master hosts
            an open server (the env variable never guards a server implicitly, so the workers'
            store stays open to torch's clients).
        bind_host: (master only) one address of this host to listen on; "" (the default, as
            torch does) listens on every interface.

    In a process that has imported ``torch.distributed``, the object constructed is a
    ``torch.distributed.Store`` wrapping this class's instance (see ``as_torch_store``), so torch
    accepts it; it still answers ``isinstance(x, TCPStore)`` and has every attribute.
    """

    def __new__(cls, *args, **kwargs):
        if cls is TCPStore and _torch.torch_loaded():
            plain = super().__new__(cls)
            plain.__init__(*args, **kwargs)
            return _torch.as_torch_store(plain)
        return super().__new__(cls)

    def __init__(
        self,
        host_name: str,
        port: int,
        world_size: Optional[int] = None,
        is_master: bool = False,
        timeout: timedelta = _DEFAULT_TIMEOUT,
        wait_for_workers: bool = True,
        multi_tenant: bool = False,
        master_listen_fd: Optional[int] = None,
        use_libuv: bool = True,
        *,
        server_limits: Optional[dict[str, int]] = None,
        token: Optional[bytes] = None,
        bind_host: str = "",
    ) -> None:
        seconds = _seconds(timeout)
        self._server: Optional[ServerHandle] = None
        self._token = token if token is not None else token_from_env()
        # The one owner of this store's reference to the hosted server: a finalizer runs at
        # most once, whether called (shutdown_server, a failed constructor) or on collection.
        self._release_server: Optional[weakref.finalize] = None
        self._host = host_name
        self._world_size = world_size
        self._use_libuv = use_libuv
        if is_master:
            # Like torch's, the server listens on every interface whatever host_name says,
            # unless bind_host names one address.
            self._server = host_server(
                bind_host, port, multi_tenant=multi_tenant, listen_fd=master_listen_fd,
                **(server_limits or {}), **({"token": token} if token else {}),
            )
            self._release_server = weakref.finalize(self, self._server.release)
            port = self._server.port
            connect_host = self._server.loopback
        else:
            connect_host = host_name
        self._port = port
        deadline = time.monotonic() + seconds
        try:
            for attempt in range(_HANDSHAKE_ATTEMPTS):
                # A reset during the handshake (a server shedding a connect storm) is retried,
                # a bounded number of times, as torch's client does.
                sock = connect_socket(connect_host, port, deadline)
                try:
                    KVClient.__init__(
                        self, sock.detach(), f"{host_name}:{port}", seconds, spin_us=spin_us(),
                        token=self._token or b"",
                    )
                    break
                except HandshakeReset:
                    if attempt + 1 == _HANDSHAKE_ATTEMPTS or time.monotonic() >= deadline:
                        raise
                    time.sleep(min(0.01 * 2**attempt, max(0.0, deadline - time.monotonic())))
        except BaseException:
            self._drop_server()
            raise
        if world_size is not None and wait_for_workers:
            self._add_unprefixed(b"init/", 1)
            if is_master:
                self._wait_for_workers(world_size, seconds)

    def _wait_for_workers(self, world_size: int, seconds: float) -> None:
        # torch's master polls the raw counter too; it is bounded by the timeout.
        deadline = time.monotonic() + seconds
        delay = 0.001
        while True:
            arrived = self._add_unprefixed(b"init/", 0)
            if arrived >= world_size:
                return
            if time.monotonic() >= deadline:
                raise StoreTimeoutError(
                    f"timed out after {seconds:g}s waiting for {world_size} store clients; "
                    f"{arrived} connected"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.01)

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        return self._port

    @property
    def timeout(self) -> timedelta:
        return timedelta(milliseconds=self.timeout_ms)

    @property
    def libuvBackend(self) -> bool:  # noqa: N802 - torch's spelling
        return self._use_libuv

    def set_timeout(self, timeout: timedelta) -> None:
        """Sets the default timeout of later waits (and of replies)."""
        self.timeout_ms = int(_seconds(timeout) * 1000)

    def has_extended_api(self) -> bool:
        return True

    def clone(self) -> "TCPStore":
        """A new connection to the same server, with the same timeout and token."""
        return TCPStore(self._host, self._port, timeout=self.timeout, wait_for_workers=False,
                        use_libuv=self._use_libuv, token=self._token)

    @property
    def server(self):
        """The hosted :class:`KVServer` (master only), for its counters; else None."""
        return self._server.server if self._server is not None else None

    def shutdown_server(self) -> None:
        """Stops the hosted server now (master only); every client is disconnected."""
        if self._server is not None:
            self.close()
            self._drop_server()

    def _drop_server(self) -> None:
        """Gives back this store's reference to the hosted server, once."""
        self._server = None
        if self._release_server is not None:
            self._release_server()
            self._release_server = None


class PrefixStore(Store):
    """Puts every key of ``store`` under ``prefix/`` (torch's ``PrefixStore``).

    In a process that has imported ``torch.distributed`` the object constructed is a
    ``torch.distributed.Store`` wrapping this class's instance, as for ``TCPStore``.
    """

    def __new__(cls, *args, **kwargs):
        if cls is PrefixStore and _torch.torch_loaded():
            plain = super().__new__(cls)
            plain.__init__(*args, **kwargs)
            return _torch.as_torch_store(plain)
        return super().__new__(cls)

    def __init__(self, prefix: str, store) -> None:
        self._prefix = prefix
        self._store = _torch.unwrap(store)  # one adapter at the top is enough

    @property
    def underlying_store(self):
        return self._store

    def _k(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _ks(self, keys: Iterable[str]) -> list[str]:
        return [f"{self._prefix}/{k}" for k in keys]

    def set(self, key, value):
        self._store.set(self._k(key), value)

    def get(self, key, timeout=None):
        if timeout is None:
            return self._store.get(self._k(key))
        return self._store.get(self._k(key), timeout)

    def add(self, key, value):
        return self._store.add(self._k(key), value)

    def compare_set(self, key, expected_value, desired_value):
        return self._store.compare_set(self._k(key), expected_value, desired_value)

    def check(self, keys):
        return self._store.check(self._ks(keys))

    def wait(self, keys, timeout=None):
        if timeout is None:
            self._store.wait(self._ks(keys))
        else:
            self._store.wait(self._ks(keys), timeout)

    def delete_key(self, key):
        return self._store.delete_key(self._k(key))

    def num_keys(self):
        return self._store.num_keys()

    def append(self, key, value):
        self._store.append(self._k(key), value)

    def multi_get(self, keys):
        return self._store.multi_get(self._ks(keys))

    def multi_set(self, keys, values):
        self._store.multi_set(self._ks(keys), values)

    def queue_push(self, key, value):
        self._store.queue_push(self._k(key), value)

    def queue_pop(self, key, block=True):
        return self._store.queue_pop(self._k(key), block)

    def queue_len(self, key):
        return self._store.queue_len(self._k(key))

    def barrier(self, key, world_size, timeout=None):
        if timeout is None:
            self._store.barrier(self._k(key), world_size)
        else:
            self._store.barrier(self._k(key), world_size, timeout)

    def append_on_disconnect(self, key, value):
        self._store.append_on_disconnect(self._k(key), value)

    def append_on_disconnect_many(self, keys, values):
        self._store.append_on_disconnect_many(self._ks(keys), values)

    @property
    def supports_extensions(self) -> bool:
        return bool(getattr(self._store, "supports_extensions", False))

    def set_timeout(self, timeout):
        self._store.set_timeout(timeout)

    @property
    def timeout(self):
        return self._store.timeout

    def list_keys(self):
        pre = self._prefix + "/"
        return [k[len(pre):] for k in self._store.list_keys() if k.startswith(pre)]

    def clone(self) -> "PrefixStore":
        return PrefixStore(self._prefix, self._store.clone())
