"""Hosting the native store server: listening sockets, the serving thread, fd limits."""

from __future__ import annotations

import errno
import logging
import os
import resource
import socket
import threading
from typing import Any, Optional

from fastelastic._native.kvserver import KVServer
from fastelastic.errors import StoreError

log = logging.getLogger("fastelastic.store")

_lock = threading.RLock()
_tenants: dict[int, "ServerHandle"] = {}


SPIN_ENV = "FASTELASTIC_STORE_SPIN_US"
DEFAULT_SPIN_US = 50
_MAX_SPIN_US = 100_000


def spin_us() -> int:
    """The store's spin budget in microseconds, from ``FASTELASTIC_STORE_SPIN_US``.

    Before a server or client thread sleeps waiting for the socket, it polls for this long
    (yielding the CPU between polls), because waking a sleeping thread costs more than a
    loopback round trip; a spin that finds nothing makes the next few waits sleep at once.
    0 turns spinning off.
    """
    return _env_whole_number(
        SPIN_ENV, DEFAULT_SPIN_US, _MAX_SPIN_US,
        f"microseconds as a whole number from 0 (no spinning) to {_MAX_SPIN_US}",
    )


def _env_whole_number(name: str, default: int, maximum: int, expected: str) -> int:
    """The whole number from 0 to ``maximum`` in ``$name`` (``default`` if unset or blank).

    Raises:
        StoreError: anything else, naming the variable, what it holds, ``expected`` (what a
            good value is) and the default.
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= maximum:
        raise StoreError(f"{name}={raw!r}: expected {expected}; the default is {default}")
    return value


HANDSHAKE_ENV = "FASTELASTIC_STORE_HANDSHAKE_MS"
DEFAULT_HANDSHAKE_MS = 1000
_MAX_HANDSHAKE_MS = 3_600_000


def handshake_ms() -> int:
    """How long a hosted server lets a new connection take to complete its handshake.

    From ``FASTELASTIC_STORE_HANDSHAKE_MS`` (default 1000). A connection that has not sent
    VALIDATE (and, on a guarded server, its token proof) by then is closed, so silent
    connections cannot hold the server's descriptors. Raise it where clients can be starved of
    the CPU for longer between their connect and their first send (thousands of simulated
    nodes as threads of a few processes, say).
    """
    value = _env_whole_number(
        HANDSHAKE_ENV, DEFAULT_HANDSHAKE_MS, _MAX_HANDSHAKE_MS,
        f"milliseconds as a whole number from 1 to {_MAX_HANDSHAKE_MS}",
    )
    if value == 0:
        raise StoreError(f"{HANDSHAKE_ENV}='0': expected milliseconds as a whole number from 1 "
                         f"to {_MAX_HANDSHAKE_MS}; the default is {DEFAULT_HANDSHAKE_MS}")
    return value


KEEPALIVE_ENV = "FASTELASTIC_STORE_KEEPALIVE_S"
DEFAULT_KEEPALIVE_S = 5
_MAX_KEEPALIVE_S = 3600


def keepalive_s() -> int:
    """Seconds after which a store connection whose peer went silent is ended (0: never).

    From ``FASTELASTIC_STORE_KEEPALIVE_S`` (default 5). A peer whose host lost power or its
    link sends no FIN; TCP keep-alive probes (idle connections) and ``TCP_USER_TIMEOUT``
    (unacknowledged data) end such a connection within this window, so the server runs its
    disconnect actions and a client's call fails instead of waiting forever. A live but busy
    peer's kernel still answers, so only a dead or unreachable host is cut off.
    """
    return _env_whole_number(
        KEEPALIVE_ENV, DEFAULT_KEEPALIVE_S, _MAX_KEEPALIVE_S,
        f"whole seconds from 0 (off) to {_MAX_KEEPALIVE_S}",
    )


def set_keepalive(sock: socket.socket, seconds: Optional[int] = None) -> None:
    """Makes ``sock`` end within ``seconds`` (default :func:`keepalive_s`) of its peer vanishing.

    For our clients' connections. The server arms the same on each connection that registers
    disconnect actions (an agent in the rendezvous), not on the listener: on every accepted
    connection, keep-alive probes dropped during a connect storm would reset live clients.
    """
    window = keepalive_s() if seconds is None else seconds
    if window <= 0 or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = max(1, window // 2)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, max(1, window - idle))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, window * 1000)


def raise_fd_limit() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (connections are fds); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        hard = 1 << 20
    if soft == resource.RLIM_INFINITY or soft >= hard:
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    except (ValueError, OSError) as e:
        log.warning("could not raise RLIMIT_NOFILE from %d to %d: %s", soft, hard, e)
        return soft


def _somaxconn() -> int:
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(128, int(f.read()))
    except (OSError, ValueError):
        return 4096


def listen_socket(host: str, port: int) -> socket.socket:
    """Binds and listens on host:port; all interfaces (IPv6 dual-stack when possible) for ''.

    The backlog is ``somaxconn``, so a storm of connecting clients is queued, not refused.
    """
    wildcard = host in ("", "*", "0.0.0.0", "::")
    candidates: list[tuple[Any, Any]] = []
    if wildcard:
        if host != "0.0.0.0" and socket.has_ipv6:
            candidates.append((socket.AF_INET6, ("::", port)))
        candidates.append((socket.AF_INET, ("0.0.0.0", port)))
    else:
        for fam, _, _, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            candidates.append((fam, addr))
    last: Optional[OSError] = None
    for fam, addr in candidates:
        sock = socket.socket(fam, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6 and wildcard:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            sock.bind(addr)
            sock.listen(_somaxconn())
            return sock
        except OSError as e:
            sock.close()
            last = e
            if e.errno == errno.EADDRINUSE:
                break
    assert last is not None
    if last.errno == errno.EADDRINUSE:
        raise StoreError(
            f"cannot host the store on {host or '*'}:{port}: the address is already in use. "
            "Another job or store is listening there; pick another port (or port 0 for a free one)."
        ) from last
    raise StoreError(f"cannot host the store on {host or '*'}:{port}: {last}") from last


class ServerHandle:
    """One running :class:`KVServer` and its thread; shared by multi-tenant stores on a port.

    The listening fd has one owner at a time: ``sock`` (the caller's) until the server is
    built on it, then the server, which closes it; ``sock`` is detached at that moment. If the
    constructor raises, ``sock`` still owns the fd and the caller closes it.
    """

    def __init__(self, sock: socket.socket, **limits: Any) -> None:
        raise_fd_limit()
        sock.setblocking(False)
        self.family = sock.family
        bound = sock.getsockname()
        self._bound = str(bound[0])
        self.port: int = bound[1]
        limits.setdefault("spin_us", spin_us())
        limits.setdefault("handshake_ms", handshake_ms())
        limits.setdefault("keepalive_s", keepalive_s())
        self.server = KVServer([sock.fileno()], **limits)
        sock.detach()   # the server owns the fd now
        self._refs = 1
        self._thread: Optional[threading.Thread] = threading.Thread(
            target=self._serve, name=f"fastelastic-store:{self.port}", daemon=True
        )
        try:
            self._thread.start()
        except BaseException:
            self._thread = None
            self.server.close()
            raise

    def _serve(self) -> None:
        try:
            self.server.serve_forever()
        except BaseException:  # the loop only returns on stop(); anything else is a bug to see
            log.exception("store server on port %d stopped unexpectedly", self.port)

    @property
    def loopback(self) -> str:
        """An address of this host on which the server accepts: its own when bound to one."""
        if self._bound not in ("::", "0.0.0.0"):
            return self._bound
        return "::1" if self.family == socket.AF_INET6 else "127.0.0.1"

    def acquire(self) -> "ServerHandle":
        with _lock:
            self._refs += 1
        return self

    def release(self) -> None:
        with _lock:
            self._refs -= 1
            if self._refs > 0:
                return
            if _tenants.get(self.port) is self:
                del _tenants[self.port]
        self.shutdown()

    def shutdown(self) -> None:
        if self._thread is None:
            return
        self.server.stop()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
        self.server.close()   # closes the listening fd too


def host_server(
    host: str, port: int, *, multi_tenant: bool = False, listen_fd: Optional[int] = None,
    **limits: Any,
) -> ServerHandle:
    """Starts (or, multi-tenant, shares) a server listening on host:port."""
    with _lock:
        if multi_tenant and port in _tenants:
            return _tenants[port].acquire()
    if listen_fd is not None:
        sock = socket.socket(fileno=os.dup(listen_fd))
    else:
        sock = listen_socket(host, port)
    try:
        handle = ServerHandle(sock, **limits)
    except BaseException:
        sock.close()   # still sock's: the server was not built (or was closed) on it
        raise
    if multi_tenant:
        with _lock:
            _tenants[handle.port] = handle
    return handle
