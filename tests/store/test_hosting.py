"""Who owns the hosted server's listening fd: the socket object until a ``KVServer`` is built
on it, the server from then on; never both. A server collected unclosed says so."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import resource
import socket
import warnings

import pytest

from fastelastic._native.kvserver import KVServer
from fastelastic.store import _hosting

from .fdtest import isolated


def _open_fds() -> set[int]:
    return {int(x) for x in os.listdir("/proc/self/fd")}


@contextlib.contextmanager
def only_free_fds(n: int):
    """Until the block ends, this process can open only ``n`` more fds (then EMFILE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = max(_open_fds()) + 64
    if hard != resource.RLIM_INFINITY and limit > hard:
        pytest.skip(f"!!! RLIMIT_NOFILE hard limit {hard} is below {limit}")
    fillers: list[int] = []
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        while True:
            try:
                fillers.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))
            except OSError as e:
                assert e.errno == errno.EMFILE, e
                break
        for _ in range(n):
            os.close(fillers.pop())
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _listener() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    s.setblocking(False)
    return s


@isolated
def test_a_server_that_cannot_be_built_leaves_the_listening_fd_to_its_caller():
    lsock = _listener()
    fd, name = lsock.fileno(), lsock.getsockname()
    with only_free_fds(2):   # its epoll and eventfd fds, not its spare one
        with pytest.raises(OSError) as info:
            KVServer([fd])
    assert info.value.errno == errno.EMFILE
    del info
    gc.collect()
    assert lsock.getsockname() == name      # still open, still the caller's socket
    lsock.close()                           # and closed once, by its one owner


@isolated
def test_a_store_host_that_cannot_start_closes_its_listening_socket_once(monkeypatch):
    monkeypatch.setattr(_hosting, "raise_fd_limit", lambda: 0)
    gc.collect()
    before = _open_fds()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with only_free_fds(3):   # the listening socket, epoll and eventfd: no spare fd
            with pytest.raises(OSError) as info:
                _hosting.host_server("127.0.0.1", 0)
        assert info.value.errno == errno.EMFILE
        victim = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)   # may reuse the fd number
        try:
            del info
            gc.collect()
            os.fstat(victim)     # not closed under us by a second owner of the old number
        finally:
            os.close(victim)
    assert _open_fds() == before
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning)]
    assert not unclosed, [str(w.message) for w in unclosed]


def _fd_targets() -> set[tuple[int, str]]:
    out = set()
    for x in os.listdir("/proc/self/fd"):
        try:
            out.add((int(x), os.readlink(f"/proc/self/fd/{x}")))
        except FileNotFoundError:
            continue
    return out


@isolated
def test_a_server_collected_unclosed_closes_its_fds_and_warns():
    gc.collect()
    before = _fd_targets()
    leaked = KVServer([_listener().detach()])
    # what it holds, by number and target (its listener, epoll, eventfd): other threads of
    # the test process may open and close fds meanwhile, so the whole table is no measure
    owned = _fd_targets() - before
    assert owned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del leaked
        gc.collect()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)
            and "KVServer" in str(w.message)]
    assert not owned & _fd_targets(), owned & _fd_targets()


def test_a_closed_server_does_not_warn():
    srv = KVServer([_listener().detach()])
    srv.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del srv
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]
