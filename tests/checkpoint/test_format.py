"""The shard's header and MAC, and the room check's arithmetic (no torch, no processes)."""

from __future__ import annotations

import mmap

import pytest

from fastelastic.checkpoint import _format, _room
from fastelastic.checkpoint._format import HEADER_SIZE, Header, ShardError


def _shard(step: int = 7, gen: int = 3, body: bytes = b"x" * 1000) -> tuple[mmap.mmap, Header]:
    data_off = _format.align(HEADER_SIZE + 10 + 5)
    total = data_off + len(body)
    mm = mmap.mmap(-1, _format.align(total) + 4096)
    h = Header(step=step, generation=gen, rank=2, local_rank=1, meta_len=10, skel_len=5,
               data_off=data_off, data_len=len(body), total=total)
    _format.pack_header(mm, h)
    mm[HEADER_SIZE:HEADER_SIZE + 15] = b"[]        abcde"
    mm[data_off:total] = body
    return mm, h


def test_header_round_trip() -> None:
    mm, h = _shard()
    got = _format.unpack_header(mm, len(mm))
    assert got == h
    assert (got.skel_off, got.meta_off) == (HEADER_SIZE + 10, HEADER_SIZE)


def test_header_rejects_garbage_and_overruns() -> None:
    mm, h = _shard()
    with pytest.raises(ShardError, match="overrun"):
        _format.unpack_header(mm, h.total - 1)  # a shard longer than its buffer
    mm[0:8] = b"NOTASHRD"
    with pytest.raises(ShardError, match="not a shard"):
        _format.unpack_header(mm, len(mm))
    with pytest.raises(ShardError, match="no header"):
        _format.unpack_header(mm, 10)


@pytest.mark.parametrize("where", ["header", "table", "body", "last"])
def test_mac_sees_any_flipped_byte(where: str) -> None:
    mm, h = _shard()
    key = _format.mac_key(b"k" * 32)
    mac = _format.compute_mac(key, mm, h.total)
    pos = {"header": 16, "table": HEADER_SIZE + 3, "body": h.data_off + 100,
           "last": h.total - 1}[where]
    mm[pos] ^= 0x01
    assert _format.compute_mac(key, mm, h.total) != mac
    mm[pos] ^= 0x01
    assert _format.compute_mac(key, mm, h.total) == mac


def test_mac_ignores_its_own_field_and_depends_on_the_key() -> None:
    mm, h = _shard()
    key = _format.mac_key(b"k" * 32)
    mac = _format.compute_mac(key, mm, h.total)
    mm[_format.MAC_OFFSET:_format.MAC_OFFSET + _format.MAC_SIZE] = mac  # the seal
    assert _format.compute_mac(key, mm, h.total) == mac
    assert _format.compute_mac(_format.mac_key(b"j" * 32), mm, h.total) != mac
    assert _format.compute_mac(_format.mac_key(None), mm, h.total) != mac


def test_parse_bytes() -> None:
    assert _room.parse_bytes("64M") == 64 << 20
    assert _room.parse_bytes("1.5GiB") == 3 << 29
    assert _room.parse_bytes("4096") == 4096
    for bad in ("lots", "-1G", ""):
        with pytest.raises(ValueError, match="not a size"):
            _room.parse_bytes(bad)


def test_refusal_names_the_limit_and_the_fix() -> None:
    big = 1 << 40
    room = _room.Room(shm=big, cgroup=big, cgroup_limit=big, host=big)
    assert room.refuse(1 << 30, 0, None) is None
    line = room.refuse(100 << 20, 0, 64 << 20)
    assert line is not None and "\n" not in line
    assert "FASTELASTIC_CHECKPOINT_MEMORY_LIMIT=64.0 MiB" in line and "raise" in line
    room = _room.Room(shm=big, cgroup=50 << 20, cgroup_limit=1 << 30, host=big)
    line = room.refuse(100 << 20, 0, None)
    assert line is not None and "cgroup memory limit (1.0 GiB) leaves 50.0 MiB" in line
    room = _room.Room(shm=big, cgroup=None, cgroup_limit=None, host=10 << 20)
    line = room.refuse(100 << 20, 0, None)
    assert line is not None and "host has 10.0 MiB available" in line


def test_shm_alone_is_no_refusal_but_memfd() -> None:
    room = _room.Room(shm=64 << 20, cgroup=None, cgroup_limit=None, host=1 << 40)
    assert room.refuse(256 << 20, 0, None) is None
    assert room.uses_memfd(256 << 20) and not room.uses_memfd(32 << 20)


def test_measure_reads_this_machine() -> None:
    room = _room.measure()
    assert room.shm is not None and room.shm > 0  # /dev/shm is mounted here
    assert room.host is not None and room.host > 0


def test_limit_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_room.LIMIT_ENV, "64M")
    assert _room.limit_from_env() == 64 << 20
    monkeypatch.setenv(_room.LIMIT_ENV, "much")
    with pytest.raises(ValueError, match="FASTELASTIC_CHECKPOINT_MEMORY_LIMIT"):
        _room.limit_from_env()


def test_mac_of_many_chunks_is_the_same_on_threads_and_sees_a_flip_in_any() -> None:
    from concurrent.futures import ThreadPoolExecutor

    total = HEADER_SIZE + 3 * (32 << 20) + 17  # four chunks, the last one short
    mm = mmap.mmap(-1, total)
    key = _format.mac_key(None)
    with ThreadPoolExecutor(2) as pool:
        mac = _format.compute_mac(key, mm, total, pool)
        assert _format.compute_mac(key, mm, total) == mac
        for pos in (HEADER_SIZE, HEADER_SIZE + (32 << 20), total - 1):
            mm[pos] ^= 0x80
            assert _format.compute_mac(key, mm, total, pool) != mac, pos
            mm[pos] ^= 0x80
        assert _format.compute_mac(key, mm, total - 1, pool) != mac  # the length counts
