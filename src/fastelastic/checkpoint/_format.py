"""One rank's shard in the agent's memory: a fixed header, a tensor table, a pickle, the bytes.

Layout (little-endian; no torch needed to read or check it)::

    0        header (HEADER_SIZE bytes): magic, version, step, generation, ranks, lengths, MAC
    128      tensor table: JSON list of [dtype, shape, offset, nbytes], offsets from byte 0
    ...      skeleton: the state_dict pickled with every tensor replaced by TensorRef(i)
    aligned  tensor bytes, each at a 64-byte boundary

The MAC is HMAC-SHA256 under the job's store token (or a fixed key when the job has none: then
it is a checksum, not a proof of origin) over the header with its MAC field zeroed, ``total``
and the SHA-256 of each 32 MiB chunk of the bytes after the header up to ``total`` (the chunks
are hashed on several threads). The worker writes everything but the MAC; the agent
seals the shard (writes the MAC) once the worker committed it, and checks it before any worker
may read the shard: a shard whose MAC does not match is never unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import struct
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["HEADER_SIZE", "ALIGN", "Header", "TensorRef", "ShardError", "align", "pack_header",
           "unpack_header", "compute_mac", "mac_key"]

MAGIC = b"FECKPT01"
VERSION = 1
HEADER_SIZE = 128
ALIGN = 64
_FMT = "<8sIIqQiiQQQQQ"  # magic version flags step generation rank local_rank meta skel data_off
_FIXED = struct.calcsize(_FMT)  # data_len total
MAC_OFFSET = _FIXED
MAC_SIZE = 32
_NO_TOKEN_KEY = b"fastelastic.checkpoint: no store token"
_CHUNK = 32 << 20  # the hash list's chunk
assert MAC_OFFSET + MAC_SIZE <= HEADER_SIZE


class ShardError(ValueError):
    """A shard that is malformed, from another generation, or fails its MAC."""


class TensorRef:
    """Stands for tensor ``index`` of the table in the pickled skeleton."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple:
        return (TensorRef, (self.index,))

    def __repr__(self) -> str:
        return f"TensorRef({self.index})"


@dataclass
class Header:
    step: int
    generation: int
    rank: int
    local_rank: int
    meta_len: int
    skel_len: int
    data_off: int
    data_len: int
    total: int
    mac: bytes = b"\0" * MAC_SIZE

    @property
    def meta_off(self) -> int:
        return HEADER_SIZE

    @property
    def skel_off(self) -> int:
        return HEADER_SIZE + self.meta_len


def align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def pack_header(buf: Any, h: Header) -> None:
    """Writes ``h`` at the start of ``buf`` (its MAC field as given: zeros before the seal)."""
    struct.pack_into(_FMT, buf, 0, MAGIC, VERSION, 0, h.step, h.generation, h.rank, h.local_rank,
                     h.meta_len, h.skel_len, h.data_off, h.data_len, h.total)
    buf[MAC_OFFSET:MAC_OFFSET + MAC_SIZE] = h.mac


def unpack_header(buf: Any, capacity: int) -> Header:
    """The header at the start of ``buf``, its lengths checked against ``capacity``.

    Raises:
        ShardError: not a shard of this version, or lengths that overrun the buffer.
    """
    if capacity < HEADER_SIZE:
        raise ShardError(f"buffer of {capacity} bytes holds no header")
    (magic, version, _flags, step, gen, rank, lrank, meta_len, skel_len, data_off, data_len,
     total) = struct.unpack_from(_FMT, buf, 0)
    if magic != MAGIC or version != VERSION:
        raise ShardError(f"not a shard (magic {magic!r}, version {version})")
    h = Header(step, gen, rank, lrank, meta_len, skel_len, data_off, data_len, total,
               bytes(buf[MAC_OFFSET:MAC_OFFSET + MAC_SIZE]))
    if not (HEADER_SIZE + meta_len + skel_len <= data_off and data_off % ALIGN == 0
            and data_off + data_len == total <= capacity):
        raise ShardError(f"shard lengths overrun its buffer: {h}")
    return h


def mac_key(token: Optional[bytes]) -> bytes:
    return token if token else _NO_TOKEN_KEY


def compute_mac(key: bytes, buf: Any, total: int, pool: Optional[Executor] = None,
                stop: Optional[Callable[[], bool]] = None) -> bytes:
    """The shard's MAC: HMAC-SHA256 under ``key`` of its header (MAC field as zeros), its
    length and the SHA-256 of each 32 MiB chunk after the header (a hash list: the chunks are
    hashed on ``pool``'s threads at once; hashlib releases the GIL).

    Raises:
        ShardError: ``stop()`` said so before a chunk (the shard is no longer wanted).
    """
    mv = memoryview(buf)
    try:
        spans = [(p, min(total, p + _CHUNK)) for p in range(HEADER_SIZE, total, _CHUNK)]

        def digest(span: tuple[int, int]) -> bytes:
            if stop is not None and stop():
                raise ShardError("the hashing was stopped")
            return hashlib.sha256(mv[span[0]:span[1]]).digest()

        if pool is not None and len(spans) > 1:
            futs = [pool.submit(digest, sp) for sp in spans]
            # every chunk done (or stopped) before the view is released below
            errors = [f.exception() for f in futs]
            stopped = next((e for e in errors if e is not None), None)
            if stopped is not None:
                raise stopped
            digests = [f.result() for f in futs]
        else:
            digests = [digest(sp) for sp in spans]
        m = hmac.new(key, digestmod=hashlib.sha256)
        m.update(mv[:MAC_OFFSET])
        m.update(b"\0" * (HEADER_SIZE - MAC_OFFSET))
        m.update(struct.pack("<Q", total))
        for d in digests:
            m.update(d)
        return m.digest()
    finally:
        mv.release()


def encode_table(entries: list[list], dcp: Optional[dict[str, Any]] = None) -> bytes:
    """The tensor table; with ``dcp`` (the disk copy's plan, see ``_dcp``) an object
    ``{"t": entries, "dcp": dcp}``."""
    obj: Any = entries if dcp is None else {"t": entries, "dcp": dcp}
    return json.dumps(obj, separators=(",", ":")).encode()


def decode_full(raw: bytes) -> tuple[list[list], Optional[dict[str, Any]]]:
    """(tensor table, the disk copy's plan or None)."""
    table = json.loads(raw)
    if isinstance(table, dict):
        entries, dcp = table.get("t"), table.get("dcp")
        if not isinstance(entries, list) or not isinstance(dcp, dict):
            raise ShardError("tensor table holds no list and plan")
        return entries, dcp
    if not isinstance(table, list):
        raise ShardError("tensor table is not a list")
    return table, None


def decode_table(raw: bytes) -> list[list]:
    return decode_full(raw)[0]
