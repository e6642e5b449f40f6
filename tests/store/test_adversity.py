"""Bad input loses one connection and nothing else: fuzzing, vanishing clients, memory."""

from __future__ import annotations

import os
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ._wire import (
    ADD,
    APPEND,
    BARRIER,
    CHECK,
    COMPARE_SET,
    GET,
    HANDSHAKE,
    MULTI_GET,
    MULTI_SET,
    QUEUE_POP,
    QUEUE_PUSH,
    SET,
    WAIT,
    Raw,
    blob,
    req,
    u64,
)
from .conftest import wait_until

VALID = [
    req(SET, blob("/f"), blob("v")),
    req(GET, blob("/f")),
    req(ADD, blob("/cnt"), u64(1)),
    req(COMPARE_SET, blob("/f"), blob("v"), blob("w")),
    req(CHECK, u64(2), blob("/a"), blob("/b")),
    req(MULTI_GET, u64(1), blob("/f")),
    req(MULTI_SET, u64(2), blob("/x"), blob("1"), blob("/y"), blob("2")),
    req(APPEND, blob("/f"), blob("z")),
    req(QUEUE_PUSH, blob("fq"), blob("i")),
    req(QUEUE_POP, blob("fq")),
    req(BARRIER, blob("/fb"), u64(1000)),
    req(WAIT, u64(1), blob("/never")),
]


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _send_and_drop(port: int, payload: bytes) -> None:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        s.sendall(HANDSHAKE + payload)
    except OSError:
        pass  # the server may already have closed on a bad prefix: that is the point
    finally:
        s.close()


def mutate(frame: bytes, data) -> bytes:
    kind = data.draw(st.sampled_from(["flip", "truncate", "extend", "splice_len"]))
    b = bytearray(frame)
    if kind == "flip":
        i = data.draw(st.integers(0, len(b) - 1))
        b[i] ^= data.draw(st.integers(1, 255))
    elif kind == "truncate":
        b = b[: data.draw(st.integers(0, len(b) - 1))]
    elif kind == "extend":
        b += data.draw(st.binary(min_size=1, max_size=64))
    else:
        i = data.draw(st.integers(1, max(1, len(b) - 8)))
        b[i:i + 8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    return bytes(b)


class TestFuzz:
    @pytest.fixture(autouse=True)
    def _sentinel(self, master):
        master.set("sentinel", "kept")
        self.master = master

    def _check_alive(self):
        c = Raw(self.master.port)
        c.send(req(GET, blob("/sentinel")))
        assert c.recv_blob() == b"kept"
        c.close()

    @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(payload=st.binary(min_size=1, max_size=300))
    def test_random_frames(self, payload):
        _send_and_drop(self.master.port, payload)
        self._check_alive()

    @settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def test_mutated_frames(self, data):
        frame = data.draw(st.sampled_from(VALID))
        _send_and_drop(self.master.port, mutate(frame, data))
        self._check_alive()


def test_fuzzing_leaks_no_memory_or_connections(master):
    import random

    rng = random.Random(1234)
    master.set("sentinel", "kept")

    def batch(n):
        for _ in range(n):
            frame = bytearray(rng.choice(VALID))
            frame[rng.randrange(len(frame))] ^= rng.randrange(1, 256)
            _send_and_drop(master.port, bytes(frame))

    batch(2000)                           # warm up allocator pools
    wait_until(lambda: master.server.num_connections == 1, what="fuzz connections closed")
    before = _rss_kib()
    batch(3000)
    wait_until(lambda: master.server.num_connections == 1, what="fuzz connections closed")
    grown = _rss_kib() - before
    assert grown < 8 * 1024, f"RSS grew {grown} KiB over 3000 bad connections"
    assert master.get("sentinel") == b"kept"
    assert master.server.waiting == 0


def test_vanish_mid_request_and_mid_wait(master):
    for i in range(200):
        s = socket.create_connection(("127.0.0.1", master.port), timeout=5)
        full = HANDSHAKE + req(SET, blob(f"/half{i}"), blob("x" * 10000))
        s.sendall(full[: len(full) // 2])         # half a request, then gone
        s.close()
        w = Raw(master.port)
        w.send(req(WAIT, u64(2), blob(f"/w{i}"), blob("/never")))
        w.close()
    wait_until(lambda: master.server.num_connections == 1 and master.server.waiting == 0,
               what="all vanished clients cleaned up")
    assert not master.check(["half0"])          # a half-received SET has no effect
    master.set("w5", "1")                        # writes to keys of gone waiters are harmless
    assert master.get("w5") == b"1"


def test_slow_reader_does_not_block_others(master):
    big = "v" * (4 * 1024 * 1024)
    master.set("big", big)
    slow = Raw(master.port)
    # Ask for the 4 MiB value 8 times and never read: the server must buffer, not block.
    slow.send(req(MULTI_GET, u64(8), *[blob("/big")] * 8))
    fast = Raw(master.port)
    for i in range(100):
        fast.send(req(ADD, blob("/c"), u64(1)))
        assert fast.recv_i64() == i + 1
    slow.close()


def test_fd_table_is_clean_after_many_clients(master):
    before = len(os.listdir("/proc/self/fd"))
    conns = [Raw(master.port) for _ in range(300)]
    for c in conns:
        c.close()
    wait_until(lambda: master.server.num_connections == 1, what="clients closed")
    assert len(os.listdir("/proc/self/fd")) == before
