"""``FileStore``: a key-value store in one file, in torch's on-disk format (no torch needed).

The file is an append-only log of ``(key, value)`` records, each field a little-endian uint32
length and its bytes, written under an exclusive ``flock`` and read under a shared one, exactly
as ``torch.distributed.FileStore`` does: user keys carry a ``/`` prefix, a delete appends
``-/key`` with an empty value, ``add`` stores decimal text, and every instance counts itself in
``refcount/`` (out in ``cleanup/`` on ``close``). torch's FileStore and ours can therefore share
one file, in either direction.

Waiting for a key re-reads the file's new tail every few milliseconds (a file offers nothing to
block on across hosts sharing it over NFS), bounded by the store's timeout.
"""

from __future__ import annotations

import fcntl
import os
import struct
import threading
import time
from datetime import timedelta
from typing import Iterable, Optional, Union

from fastelastic.errors import StoreError, StoreTimeoutError
from fastelastic.store import Store

__all__ = ["FileStore"]

_LEN = struct.Struct("<I")
_MAX_FIELD = (1 << 32) - 1
_USER = "/"
_DELETED = "-"
_REFCOUNT = "refcount/"
_CLEANUP = "cleanup/"
_POLL_MIN = 0.001
_POLL_MAX = 0.01  # torch's FileStore polls every 10 ms
_DEFAULT_TIMEOUT = timedelta(seconds=300)
Value = Union[str, bytes]


def _b(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class FileStore(Store):
    """A store kept in the file ``path`` (torch's ``FileStore`` signature and file format).

    Args:
        path: the file; created (mode 0644 less the umask) if missing.
        numWorkers: with a positive count, the last of that many instances to ``close`` removes
            the file (torch's rule); ``-1`` keeps it.

    Raises:
        StoreError: the file cannot be opened or locked.
    """

    def __init__(self, path: str, numWorkers: int = -1) -> None:  # noqa: N803 - torch's name
        self._path = os.fspath(path)
        self._num_workers = int(numWorkers)
        self._timeout = _DEFAULT_TIMEOUT
        self._cache: dict[bytes, bytes] = {}
        self._pos = 0
        self._fd = -1
        self._mu = threading.Lock()  # flock does not exclude threads sharing our descriptor
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise StoreError(f"cannot open the file store {self._path!r}: {e}") from e
        self._add_raw(_REFCOUNT.encode(), 1)

    # ------------------------------------------------------------------ the log

    def _read_tail(self) -> None:
        """Applies the records appended since the last read (caller holds a lock)."""
        size = os.fstat(self._fd).st_size
        if size <= self._pos:
            return
        data = os.pread(self._fd, size - self._pos, self._pos)
        off = 0
        while True:
            fields = []
            at = off
            for _ in range(2):
                if at + 4 > len(data):
                    break
                (n,) = _LEN.unpack_from(data, at)
                if at + 4 + n > len(data):
                    break
                fields.append(data[at + 4 : at + 4 + n])
                at += 4 + n
            if len(fields) < 2:
                break  # an incomplete record: not ours to read yet
            key, value = fields
            if key.startswith(b"-"):
                self._cache.pop(key[1:], None)
            else:
                self._cache[key] = value
            off = at
        self._pos += off

    def _append(self, key: bytes, value: bytes) -> None:
        """Appends one record (caller holds the exclusive lock and has read the tail)."""
        if len(key) > _MAX_FIELD or len(value) > _MAX_FIELD:
            raise ValueError("a FileStore key or value must be shorter than 4 GiB")
        record = _LEN.pack(len(key)) + key + _LEN.pack(len(value)) + value
        end = os.fstat(self._fd).st_size
        written = 0
        while written < len(record):
            written += os.pwrite(self._fd, record[written:], end + written)
        self._read_tail()

    def _locked(self, exclusive: bool) -> "_Flock":
        return _Flock(self._mu, self._fd, exclusive)

    def _check_open(self) -> None:
        if self._fd < 0:
            raise StoreError(f"the file store {self._path!r} is closed")

    def _add_raw(self, key: bytes, value: int) -> int:
        with self._locked(True):
            self._read_tail()
            current = self._cache.get(key)
            total = (int(current) if current else 0) + int(value)
            self._append(key, str(total).encode())
            return total

    def _k(self, key: str) -> bytes:
        return (_USER + key).encode()

    # ------------------------------------------------------------------ torch's Store API

    def set(self, key: str, value: Value) -> None:
        self._check_open()
        with self._locked(True):
            self._read_tail()
            self._append(self._k(key), _b(value))

    def get(self, key: str) -> bytes:
        """Returns the value of ``key``, waiting up to the store's timeout for it to be set."""
        self._wait([self._k(key)], self._timeout)
        with self._locked(False):
            self._read_tail()
            value = self._cache.get(self._k(key))
        if value is None:  # deleted between the wait and the read
            raise StoreError(f"key {key!r} was deleted while being read")
        return value

    def add(self, key: str, value: int) -> int:
        self._check_open()
        return self._add_raw(self._k(key), value)

    def append(self, key: str, value: Value) -> None:
        self._check_open()
        k = self._k(key)
        with self._locked(True):
            self._read_tail()
            self._append(k, self._cache.get(k, b"") + _b(value))

    def compare_set(self, key: str, expected_value: Value, desired_value: Value) -> bytes:
        """Sets ``desired_value`` if the value is ``expected_value`` (or the key is missing and
        ``expected_value`` is empty); returns the value after the call."""
        self._check_open()
        k, expected, desired = self._k(key), _b(expected_value), _b(desired_value)
        with self._locked(True):
            self._read_tail()
            current = self._cache.get(k)
            if (current is None and not expected) or current == expected:
                self._append(k, desired)
                return desired
            return expected if current is None else current

    def check(self, keys: Iterable[str]) -> bool:
        self._check_open()
        with self._locked(False):
            self._read_tail()
            return all(self._k(k) in self._cache for k in keys)

    def wait(self, keys: Iterable[str], timeout: Optional[timedelta] = None) -> None:
        """Blocks until every key is set, or raises StoreTimeoutError after ``timeout``."""
        self._wait([self._k(k) for k in keys], self._timeout if timeout is None else timeout)

    def _wait(self, keys: list[bytes], timeout: timedelta) -> None:
        self._check_open()
        seconds = timeout.total_seconds()
        deadline = time.monotonic() + seconds if seconds > 0 else None
        delay = _POLL_MIN
        while True:
            with self._locked(False):
                self._read_tail()
                if all(k in self._cache for k in keys):
                    return
            if deadline is not None and time.monotonic() >= deadline:
                names = ", ".join(k.decode("utf-8", "replace") for k in keys)
                raise StoreTimeoutError(f"wait timeout after {seconds * 1000:g}ms, keys: {names}")
            left = deadline - time.monotonic() if deadline is not None else delay
            time.sleep(max(0.0, min(delay, left)))
            delay = min(delay * 2, _POLL_MAX)

    def delete_key(self, key: str) -> bool:
        self._check_open()
        k = self._k(key)
        with self._locked(True):
            self._read_tail()
            if k not in self._cache:
                return False
            self._append(_DELETED.encode() + k, b"")
            return True

    def num_keys(self) -> int:
        """Number of keys, torch's bookkeeping keys included (as torch's FileStore counts)."""
        self._check_open()
        with self._locked(False):
            self._read_tail()
            return len(self._cache)

    def multi_get(self, keys: Iterable[str]) -> list[bytes]:
        keys = list(keys)
        self._wait([self._k(k) for k in keys], self._timeout)
        with self._locked(False):
            self._read_tail()
            return [self._cache[self._k(k)] for k in keys]

    def multi_set(self, keys: Iterable[str], values: Iterable[Value]) -> None:
        self._check_open()
        pairs = list(zip(keys, values, strict=True))
        with self._locked(True):
            self._read_tail()
            for k, v in pairs:
                self._append(self._k(k), _b(v))

    def list_keys(self) -> list[str]:
        self._check_open()
        with self._locked(False):
            self._read_tail()
            return [k[1:].decode() for k in self._cache if k.startswith(b"/")]

    def has_extended_api(self) -> bool:
        return True

    @property
    def timeout(self) -> timedelta:
        return self._timeout

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def path(self) -> str:
        """The store's file."""
        return self._path

    def clone(self) -> "FileStore":
        """Another instance on the same file, with the same timeout."""
        other = FileStore(self._path, self._num_workers)
        other.set_timeout(self._timeout)
        return other

    def close(self) -> None:
        """Counts this instance out; the last of ``numWorkers`` removes the file (torch's rule)."""
        if self._fd < 0:
            return
        try:
            if os.path.exists(self._path):
                finished = self._add_raw(_CLEANUP.encode(), 1)
                refs = self._add_raw(_REFCOUNT.encode(), -1)
                if refs == 0 and self._num_workers >= 0 and finished >= self._num_workers:
                    try:
                        os.remove(self._path)
                    except FileNotFoundError:
                        pass
        finally:
            os.close(self._fd)
            self._fd = -1

    def __del__(self) -> None:
        if getattr(self, "_fd", -1) >= 0:
            try:
                self.close()
            except Exception:
                pass


class _Flock:
    """``with``-able: this object's thread lock, then ``flock`` on its file."""

    __slots__ = ("_mu", "_fd", "_op")

    def __init__(self, mu: threading.Lock, fd: int, exclusive: bool) -> None:
        self._mu = mu
        self._fd = fd
        self._op = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH

    def __enter__(self) -> None:
        self._mu.acquire()
        try:
            fcntl.flock(self._fd, self._op)
        except BaseException:
            self._mu.release()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._mu.release()
