"""The store's protocol core without sockets: each command's method, the state gate and the
measuring, driven through ``KVServer.execute_socketless`` on a server that is not serving.

Replies are checked byte for byte against ``shared/design/tcpstore-protocol.md``.
"""

from __future__ import annotations

import socket
import struct

import pytest

from fastelastic._native.kvserver import KVServer


def blob(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def keys(*ks: bytes) -> bytes:
    return struct.pack("<Q", len(ks)) + b"".join(blob(k) for k in ks)


VALIDATE = b"\x00" + struct.pack("<I", 0x3C85F7CE)


def SET(k: bytes, v: bytes) -> bytes:
    return b"\x01" + blob(k) + blob(v)


def GET(k: bytes) -> bytes:
    return b"\x03" + blob(k)


def ADD(k: bytes, d: int) -> bytes:
    return b"\x04" + blob(k) + struct.pack("<q", d)


def CAS(k: bytes, old: bytes, new: bytes) -> bytes:
    return b"\x02" + blob(k) + blob(old) + blob(new)


@pytest.fixture
def server():
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    srv = KVServer([lsock.fileno()])
    yield srv
    srv.close()
    lsock.detach()


def test_each_command_replies_as_the_protocol_says(server):
    run = server.execute_socketless
    assert run(SET(b"/k", b"v1") + GET(b"/k")) == (blob(b"v1"), 0, None)
    assert run(ADD(b"/n", 5) + ADD(b"/n", -2)) == (struct.pack("<qq", 5, 3), 0, None)
    # COMPARE_SET: the current value when expected does not match, else desired
    assert run(CAS(b"/k", b"nope", b"x")) == (blob(b"v1"), 0, None)
    assert run(CAS(b"/k", b"v1", b"v2")) == (blob(b"v2"), 0, None)
    assert run(b"\x05" + keys(b"/k", b"/absent")) == (b"\x01", 0, None)  # CHECK: NOT_READY
    assert run(b"\x05" + keys(b"/k")) == (b"\x00", 0, None)
    assert run(b"\x0a" + keys(b"/k", b"/n")) == (blob(b"v2") + blob(b"3"), 0, None)
    assert run(b"\x07") == (struct.pack("<q", 2), 0, None)  # GETNUMKEYS
    assert run(b"\x08" + blob(b"/n") + b"\x08" + blob(b"/n")) == (struct.pack("<qq", 1, 0), 0,
                                                                  None)
    assert run(b"\x09" + blob(b"/k") + blob(b"+") + GET(b"/k")) == (blob(b"v2+"), 0, None)
    ms = b"\x0b" + struct.pack("<q", 2) + blob(b"/a") + blob(b"1") + blob(b"/b") + blob(b"2")
    assert run(ms + b"\x0a" + keys(b"/a", b"/b")) == (blob(b"1") + blob(b"2"), 0, None)
    assert run(b"\x0d" + struct.pack("<I", 1234)) == (struct.pack("<I", 1234), 0, None)
    q = b"\x0e" + blob(b"q") + blob(b"item")
    assert run(q + b"\x10" + blob(b"q") + b"\x0f" + blob(b"q") + b"\x0f" + blob(b"q")) == (
        struct.pack("<q", 1) + struct.pack("<q", 1) + blob(b"item") + struct.pack("<q", 0), 0,
        None)
    replies, rest, closed = run(b"\x11")  # LIST_KEYS
    n = struct.unpack_from("<q", replies)[0]
    assert closed is None and rest == 0 and n == server.num_keys


def test_wait_is_answered_when_its_keys_appear(server):
    run = server.execute_socketless
    # a WAIT on a key its own later SET writes: answered STOP_WAITING once the key exists
    assert run(b"\x06" + keys(b"/w") + SET(b"/w", b"1")) == (b"\x00", 0, None)
    assert run(b"\x06" + keys(b"/w")) == (b"\x00", 0, None)  # present: at once
    assert run(b"\x06" + keys(b"/never") + b"\x0c") == (b"\x01", 0, None)  # CANCEL_WAIT


def test_a_partial_request_is_left_for_the_next_read(server):
    frame = SET(b"/p", b"value") + GET(b"/p")
    for cut in (1, 5, 9, len(SET(b"/p", b"value")) + 3):
        replies, rest, closed = server.execute_socketless(frame[:cut])
        assert closed is None and replies == b"" and rest == cut - (
            len(SET(b"/p", b"value")) if cut > len(SET(b"/p", b"value")) else 0)


@pytest.mark.parametrize("frame,handshaken,why", [
    (GET(b"/k"), False, "first request is not VALIDATE"),
    (b"\x00" + struct.pack("<I", 1), False, "VALIDATE without the TCPStore magic"),
    (VALIDATE, True, "VALIDATE sent twice"),
    (b"\x42" + blob(b"/k") + blob(b"x"), False, "first request is not VALIDATE"),
    (b"\x0a" + struct.pack("<Q", 1 << 62), True, "malformed or over-limit request"),
])
def test_the_gate_and_the_limits_close_only_that_connection(server, frame, handshaken, why):
    replies, _, closed = server.execute_socketless(frame, handshaken=handshaken)
    assert replies == b"" and closed is not None and why in closed
    # the server goes on serving the next connection
    assert server.execute_socketless(SET(b"/after", b"1") + GET(b"/after"))[0] == blob(b"1")


def test_validate_then_an_extension_before_ping_is_refused(server):
    ext = b"\x42" + blob(b"/gone") + blob(b"x")  # EXT_ON_DISCONNECT_APPEND
    replies, _, closed = server.execute_socketless(VALIDATE + ext, handshaken=False)
    assert closed is not None and "before the capability PING" in closed
    # after VALIDATE and the capability PING (answered with the complement of its nonce) it
    # is accepted (acknowledged with one 0 byte), and runs at the disconnect
    ping = b"\x0d" + struct.pack("<I", 0x7E57FA57)
    replies, _, closed = server.execute_socketless(VALIDATE + ping + ext, handshaken=False)
    assert closed is None and replies == struct.pack("<I", ~0x7E57FA57 & 0xFFFFFFFF) + b"\x00"
    assert server.execute_socketless(GET(b"/gone"))[0] == blob(b"x")


def test_a_server_with_a_token_refuses_requests_before_the_proof():
    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen()
    srv = KVServer([lsock.fileno()], token=b"0123456789abcdef-secret")
    try:
        replies, _, closed = srv.execute_socketless(VALIDATE + GET(b"/k"), handshaken=False)
        assert replies == b"" and "before the token proof" in closed
        # the capability PING answers with a challenge instead of the nonce's complement
        ping = b"\x0d" + struct.pack("<I", 0x7E57FA57)
        replies, _, closed = srv.execute_socketless(VALIDATE + ping, handshaken=False)
        assert closed is None and len(replies) > 4
        assert replies[:4] != struct.pack("<I", ~0x7E57FA57 & 0xFFFFFFFF)
        assert srv.num_keys == 0
    finally:
        srv.close()
        lsock.detach()
