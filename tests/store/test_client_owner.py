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


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _connect(master) -> KVClient:
    sock = socket.create_connection(("127.0.0.1", master.port), timeout=10)
    return KVClient(sock.detach(), f"127.0.0.1:{master.port}", 10.0)


def _unclosed(caught) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, ResourceWarning) and "KVClient" in str(w.message)]


def test_a_client_collected_unclosed_closes_its_socket_and_warns(master):
    gc.collect()
    before = _open_fds()
    leaked = _connect(master)
    leaked.set("k", b"v")
    assert _open_fds() != before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del leaked
        gc.collect()
    assert _unclosed(caught), [str(w.message) for w in caught]
    assert _open_fds() == before


def test_a_closed_client_does_not_warn(master):
    c = _connect(master)
    c.close()
    c.close()  # twice is fine
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
