"""A KVClient owns its socket: close() closes it; one dropped unclosed closes it and warns."""

from __future__ import annotations

import gc
import os
import socket
import threading
import warnings

import pytest

from fastelastic._native.kvclient import KVClient
from fastelastic.errors import StoreConnectionError

from .fdtest import isolated


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _connect(master) -> KVClient:
    sock = socket.create_connection(("127.0.0.1", master.port), timeout=10)
    return KVClient(sock.detach(), f"127.0.0.1:{master.port}", 10.0)


def _unclosed(caught) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, ResourceWarning) and "KVClient" in str(w.message)]


def _target(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except FileNotFoundError:
        return None


@isolated
def test_a_client_collected_unclosed_closes_its_socket_and_warns(master):
    # its own socket, by number and inode: other threads of the test process (daemons of
    # earlier tests) may open and close fds meanwhile, so the whole fd table is no measure
    sock = socket.create_connection(("127.0.0.1", master.port), timeout=10)
    fd = sock.detach()
    inode = _target(fd)
    assert inode is not None and inode.startswith("socket:")
    leaked = KVClient(fd, f"127.0.0.1:{master.port}", 10.0)
    leaked.set("k", b"v")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del leaked
        gc.collect()
    assert _unclosed(caught), [str(w.message) for w in caught]
    assert _target(fd) != inode, "the socket is still open"


def test_a_closed_client_does_not_warn(master):
    c = _connect(master)
    c.close()
    c.close()  # twice is fine
    gc.collect()  # garbage of earlier tests warns outside the window watched here
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del c
        gc.collect()
    assert not _unclosed(caught)


def test_a_client_whose_handshake_fails_leaves_no_socket_and_no_warning():
    """A peer that answers the handshake with a wrong nonce: the constructor raises, the socket
    is closed at once (not when the half-made object is collected) and nothing warns."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]

    def answer_garbage():
        conn, _ = srv.accept()
        with conn:
            conn.recv(64)
            conn.sendall(b"\x00\x00\x00\x00\x00\x00\x00\x00")  # ping reply with a wrong nonce
            conn.recv(64)  # until the client closes

    t = threading.Thread(target=answer_garbage)
    t.start()
    gc.collect()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fd = socket.create_connection(("127.0.0.1", port), timeout=10).detach()
            client = KVClient.__new__(KVClient)
            try:
                client.__init__(fd, f"127.0.0.1:{port}", 10.0)
            except StoreConnectionError as e:
                assert "wrong nonce" in str(e)
            else:
                raise AssertionError("the handshake was accepted")
            t.join(10)  # the peer saw the client close (EOF)
            assert not t.is_alive()
            with pytest.raises(OSError):  # closed by the failed constructor itself
                os.fstat(fd)
            del client
            gc.collect()
        assert not _unclosed(caught)
    finally:
        srv.close()
        t.join(10)
