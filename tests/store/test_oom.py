"""Out of memory in the server is the affected connection's own error.

A reply is whole or not started, for every connection: a wake-up reply the server cannot build
closes the woken connection (with nothing of that reply sent), never the writer that woke it nor
the next, unrelated connection. ``KVCore.fail_wakeup_reply`` makes the next wake-up reply fail
as if memory ran out.
"""

from __future__ import annotations

import socket
import struct

import pytest

from fastelastic._native.kvserver import KVServer

from ._wire import EXT_ON_DISCONNECT_APPEND, EXT_WAIT_GET, GET, SET, WAIT, Raw, blob, req, u64
from .conftest import wait_until

OOM = "out of memory writing a reply"


def received_until_closed(r: Raw, within: float = 5.0) -> bytes:
    """Every byte r receives until the server closes it; fails if it is not closed in time."""
    r.sock.settimeout(within)
    got = b""
    try:
        while True:
            chunk = r.sock.recv(65536)
            if not chunk:
                return got
            got += chunk
    except (ConnectionResetError, BrokenPipeError):
        return got
    except socket.timeout:
        raise AssertionError(f"not closed within {within}s; received {got!r}") from None


@pytest.mark.parametrize("size", [100, 200 * 1024], ids=["copied", "streamed"])
def test_a_wakeup_reply_out_of_memory_closes_the_waiter_not_the_writer(master, raw, size):
    server = master.server
    waiter = raw(ext=True)
    waiter.send(req(EXT_WAIT_GET, blob("/k")))
    wait_until(lambda: server.waiting == 1, what="the wait registered")
    server.fail_wakeup_reply()
    writer = raw()
    writer.send(req(SET, blob("/k"), blob(b"v" * size)) + req(GET, blob("/k")))
    assert writer.recv_blob() == b"v" * size       # the writer is still served
    assert received_until_closed(waiter) == b""    # no length without its value
    assert server.last_error == OOM
    later = raw()
    later.send(req(GET, blob("/k")))
    assert later.recv_blob() == b"v" * size


def test_a_disconnect_action_out_of_memory_closes_only_the_woken_waiter(master, raw):
    server = master.server
    dying = raw(ext=True)
    dying.send(req(EXT_ON_DISCONNECT_APPEND, blob("/gone"), blob("node1;")))
    assert dying.recv_u8() == 0
    waiter = raw()
    waiter.send(req(WAIT, u64(1), blob("/gone")))
    wait_until(lambda: server.waiting == 1, what="the wait registered")
    server.fail_wakeup_reply()
    dying.close()                                  # its action runs outside any request
    assert received_until_closed(waiter) == b""
    bystander = raw()                              # the next, unrelated connection is served
    bystander.send(req(GET, blob("/gone")))
    assert bystander.recv_blob() == b"node1;"


def _wait(k: bytes) -> bytes:
    return b"\x06" + struct.pack("<Q", 1) + blob(k)


def test_a_request_waking_its_own_connection_out_of_memory_closes_it():
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    server = KVServer([lsock.fileno()])
    try:
        server.fail_wakeup_reply()
        set_k = b"\x01" + blob(b"/k") + blob(b"1")
        get_k = b"\x03" + blob(b"/k")
        assert server.execute_socketless(_wait(b"/k") + set_k + get_k) == (b"", 0, OOM)
        # nothing outlives that request: the next connection is served
        assert server.execute_socketless(set_k + get_k) == (blob(b"1"), 0, None)
    finally:
        server.close()
        lsock.detach()
