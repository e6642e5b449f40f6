"""The copy port (``checkpoint._copy``) between two agents' memory owners in this process, over
loopback TCP: a sealed shard copied and fetched back bit for bit, the store token's challenge,
a copy that fails its MAC dropped on receipt, the head's bound. No torch: the shards are laid
out by hand in the owner's own buffers, as a worker lays them out."""

from __future__ import annotations

import hmac
import mmap
import os
import socket
import struct
import time

import pytest
from jobtree import wait_until

from fastelastic.checkpoint import _format, _owner
from fastelastic.checkpoint._copy import Copier, CopyError, parse_copy_to
from fastelastic.checkpoint._format import HEADER_SIZE, Header

TOKEN = b"k" * 32
MB = 1 << 20


def _seal(owner: _owner.MemoryOwner, lr: int, step: int, rank: int, world: int,
          payload: bytes, era: int = 1) -> _owner._Buf:
    """A sealed shard of ``payload`` in buffer 0 of local rank ``lr``, as a save leaves it."""
    cap = (len(payload) + HEADER_SIZE + 2 * MB) // MB * MB
    fd, _kind = _owner._alloc(cap, False)
    b = _owner._Buf()
    b.fd, b.capacity = fd, cap
    b.mm = mmap.mmap(fd, cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    data_off = _format.align(HEADER_SIZE + 2)
    h = Header(step, 7 + step, rank, lr, 2, 0, data_off, len(payload), data_off + len(payload))
    b.mm[HEADER_SIZE:HEADER_SIZE + 2] = b"[]"
    b.mm[data_off:data_off + len(payload)] = payload
    _format.pack_header(b.mm, h)
    mac = _format.compute_mac(owner._key, b.mm, h.total)
    b.mm[_format.MAC_OFFSET:_format.MAC_OFFSET + _format.MAC_SIZE] = mac
    b.state, b.step, b.gen, b.total, b.mac = _owner.SEALED, step, h.generation, h.total, mac
    b.era, b.world, b.rank = era, world, rank
    with owner._cond:
        owner._ranks[lr] = [b, _owner._Buf()]
    return b


@pytest.fixture
def pair():
    owners = [_owner.MemoryOwner(token=TOKEN, name=f"fe-copy-test-{os.getpid()}-{i}")
              for i in range(2)]
    copiers = [Copier(o, host="127.0.0.1", advertise="127.0.0.1") for o in owners]
    for o, c in zip(owners, copiers, strict=True):
        o.copier = c
    yield owners, copiers
    for o in owners:
        o.close()


def test_a_sealed_shard_is_copied_and_fetched_back_bit_for_bit(pair) -> None:
    (a, _b), (ca, cb) = pair
    payload = os.urandom(9 * MB)
    src = _seal(a, 0, 5, 2, 4, payload)
    ca.set_target(cb.address)
    ca.offer(0, 0, src.gen)
    assert wait_until(lambda: cb.held() == [(2, 4, 5, 1, src.gen)], 30), ca.stats()
    got = bytearray(src.total)
    head = ca.fetch(cb.address, 2, 5, 1, lambda h: got)
    assert head["total"] == src.total and head["gen"] == src.gen
    assert src.mm is not None and bytes(got) == src.mm[:src.total]
    st = ca.stats()
    assert (st["copies"], st["bytes"], st["dropped"]) == (1, src.total, 0)
    assert st["cpu_s"]["send"] > 0 and cb.stats()["cpu_s"]["serve"] > 0  # its own CPU time
    assert ca.summary().startswith("1 copies sent (9.0 MiB") and "CPU" in ca.summary()
    assert "9.0 MiB of copies held" in cb.summary() or "10.0 MiB of copies held" in cb.summary()
    with pytest.raises(CopyError, match="no copy of rank 2's step 6"):
        ca.fetch(cb.address, 2, 6, 1, lambda h: bytearray(int(h["total"])))


def test_a_copy_that_fails_its_check_is_dropped_on_receipt(pair) -> None:
    (a, _b), (ca, cb) = pair
    src = _seal(a, 0, 3, 0, 2, os.urandom(2 * MB))
    assert src.mm is not None
    src.mm[src.total - 1] ^= 0xFF  # one byte changed after the seal (a save over it, a bit flip)
    ca.set_target(cb.address)
    ca.offer(0, 0, src.gen)
    assert wait_until(lambda: ca.stats()["dropped"] == 1, 30), ca.stats()
    assert cb.held() == []  # never held: never served, never unpickled


def test_a_peer_without_the_job_s_token_is_refused(pair) -> None:
    (_a, _b), (_ca, cb) = pair
    stranger = _owner.MemoryOwner(token=b"z" * 32, name=f"fe-copy-test-{os.getpid()}-x")
    try:
        cs = Copier(stranger, host="127.0.0.1", advertise="127.0.0.1")
        stranger.copier = cs
        src = _seal(stranger, 0, 1, 0, 2, os.urandom(MB))
        cs.set_target(cb.address)
        cs.offer(0, 0, src.gen)
        assert wait_until(lambda: cs.stats()["dropped"] == 1, 30), cs.stats()
        assert cb.held() == []
    finally:
        stranger.close()


def test_a_head_over_its_bound_ends_the_connection(pair) -> None:
    (_a, _b), (_ca, cb) = pair
    host, port = cb.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        challenge = s.recv(32)
        s.sendall(hmac.new(TOKEN, b"fastelastic.checkpoint.copy/1" + challenge,
                           "sha256").digest())
        (n,) = struct.unpack("<I", s.recv(4))
        assert b'"ok":true' in s.recv(n)
        s.sendall(struct.pack("<I", 1 << 30))  # a head of 1 GiB: never read, nor allocated
        assert s.recv(1) == b""  # closed
    assert cb.held() == []


def test_copy_to_values() -> None:
    assert [parse_copy_to(v) for v in ("next", "", "+2", "off")] == [1, 1, 2, 0]
    for bad in ("prev", "+0", "2", "+x"):
        with pytest.raises(ValueError, match="--checkpoint-copy-to"):
            parse_copy_to(bad)


def test_a_sender_killed_mid_copy_leaves_no_slot_taken(pair) -> None:
    (a, _b), (ca, cb) = pair
    host, port = cb.address.rsplit(":", 1)
    for _ in range(2):  # each slot once: neither is left taken by a copy that never ended
        with socket.create_connection((host, int(port)), timeout=10) as s:
            challenge = s.recv(32)
            s.sendall(hmac.new(TOKEN, b"fastelastic.checkpoint.copy/1" + challenge,
                               "sha256").digest())
            (n,) = struct.unpack("<I", s.recv(4))
            s.recv(n)
            head = (b'{"op":"put","rank":1,"world":2,"step":4,"era":1,"gen":3,'
                    b'"total":4194304,"mac":"' + b"00" * 32 + b'"}')
            s.sendall(struct.pack("<I", len(head)) + head + b"x" * (1 << 20))
        # closed with 3 MiB of the shard unsent: the sender's node died mid-copy
    ca.set_target(cb.address)
    for step in (5, 6, 7):  # three copies of the same rank: both slots in turn
        src = _seal(a, 0, step, 1, 2, os.urandom(2 * MB))
        ca.offer(0, 0, src.gen)
        assert wait_until(lambda s=step: (1, 2, s, 1, 7 + s) in cb.held(), 30), ca.stats()
    assert sorted(x[2] for x in cb.held()) == [6, 7] and ca.stats()["dropped"] == 0


def test_the_sender_is_paced(pair) -> None:
    (a, _b), (ca, cb) = pair
    ca.rate = 4 * MB  # FASTELASTIC_CHECKPOINT_COPY_RATE=4M
    src = _seal(a, 0, 2, 0, 2, os.urandom(8 * MB))
    ca.set_target(cb.address)
    t0 = time.monotonic()
    ca.offer(0, 0, src.gen)
    assert wait_until(lambda: cb.held() == [(0, 2, 2, 1, src.gen)], 60), ca.stats()
    # a lower bound, not a speed: the 8th MiB may start only 7 MiB / (4 MiB/s) after the first
    assert time.monotonic() - t0 >= 1.75 - 0.05
