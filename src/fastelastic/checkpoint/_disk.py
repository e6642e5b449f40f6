"""The agent's side of the disk copy: a step's shards moved to files in torch DCP's format.

No torch here: the workers laid out each rank's ``__<rank>_0.distcp`` as byte ranges of their
shards and pickled their parts of the metadata (``_dcp``); this module only writes those bytes
and joins the parts into ``.metadata``.

A step appears whole or not at all: it is written into ``<parent>/.fastelastic-tmp-<name>-
<step>-<agent pid>/``, every file and the directory fsynced, the marker ``.fastelastic-step``
(JSON: step, world size) written last, then the directory renamed to ``checkpoint_id`` (an
existing directory of that name is moved aside first and removed after) and the parent fsynced.
``latest`` only counts directories that hold the marker and not a temporary name.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
import time
from typing import Any, Callable, Optional

__all__ = ["MARKER", "TMP_PREFIX", "metadata_pickle", "write_step", "latest", "Skipped"]

MARKER = ".fastelastic-step"
TMP_PREFIX = ".fastelastic-tmp-"
OLD_PREFIX = ".fastelastic-old-"
_CHUNK = 8 << 20
_MODULE = b"torch.distributed.checkpoint.metadata"


class Skipped(Exception):
    """The write was given up: a newer step needs its memory."""


def _unicode(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def metadata_pickle(parts: list[tuple[bytes, bytes, bytes]], version: str) -> bytes:
    """The pickle of torch's ``Metadata`` whose three dicts hold every rank's fragments.

    What ``pickle.dumps(Metadata(...), protocol=2)`` writes: the class by name, ``NEWOBJ``, then
    ``BUILD`` with the instance's dict. Each fragment is a run of ``MARK ... SETITEMS`` blocks
    that fills the dict on top of the stack; a rank's entries replace a lower rank's under the
    same key (as DCP keeps one copy of a key saved by several ranks). A fragment's memo
    references stay inside the fragment (pickle writes an object before any reference to it),
    and this outer frame uses no memo, so the fragments compose.
    """
    out = bytearray(b"\x80\x02c" + _MODULE + b"\nMetadata\n)\x81}(")
    for i, key in enumerate(("state_dict_metadata", "planner_data", "storage_data")):
        out += _unicode(key) + b"}"
        for p in parts:
            out += p[i]
    out += _unicode("storage_meta") + b"N" + _unicode("version") + _unicode(version)
    out += b"ub."
    return bytes(out)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, chunks: list[tuple[Any, int, int]], pace: Callable[[int], None]) -> int:
    """Writes the byte ranges ``(buffer, offset, length)`` to ``path`` in order and fsyncs it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    written = 0
    try:
        for buf, off, n in chunks:
            mv = memoryview(buf)
            try:
                end = off + n
                while off < end:
                    k = min(_CHUNK, end - off)
                    pace(k)
                    done = os.write(fd, mv[off:off + k])
                    off += done
                    written += done
            finally:
                mv.release()
        os.fsync(fd)
    finally:
        os.close(fd)
    return written


def write_step(step: int, path: str, world: int, version: str,
               files: dict[int, list[tuple[Any, int, int]]],
               metas: dict[int, tuple[bytes, bytes, bytes]],
               pace: Callable[[int], None]) -> int:
    """Writes one step to ``path`` whole (see the module's docstring); returns bytes written.

    ``files[rank]`` are the byte ranges of ``__<rank>_0.distcp``; ``metas`` every rank's three
    fragments. ``pace(n)`` runs before each chunk: it throttles, or raises ``Skipped``.

    Raises:
        Skipped: ``pace`` gave the write up (the temporary directory is removed).
        OSError: the disk refused (the temporary directory is removed).
    """
    path = os.path.abspath(path)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    clean_stale(parent)
    tmp = os.path.join(parent, f"{TMP_PREFIX}{name}-{step}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.mkdir(tmp, 0o755)
    total = 0
    try:
        for rank in sorted(files):
            total += _write_file(os.path.join(tmp, f"__{rank}_0.distcp"), files[rank], pace)
        meta = metadata_pickle([metas[r] for r in sorted(metas)], version)
        total += _write_file(os.path.join(tmp, ".metadata"), [(meta, 0, len(meta))], pace)
        marker = json.dumps({"step": step, "world_size": world}).encode()
        _write_file(os.path.join(tmp, MARKER), [(marker, 0, len(marker))], lambda n: None)
        _fsync_dir(tmp)
        old = None
        if os.path.lexists(path):
            old = os.path.join(parent, f"{OLD_PREFIX}{name}-{os.getpid()}-{time.monotonic_ns()}")
            os.rename(path, old)
        os.rename(tmp, path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return total


def clean_stale(parent: str) -> None:
    """Removes temporary and set-aside directories left in ``parent`` by agents no longer
    alive (an agent SIGKILLed mid-write)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for n in names:
        if not n.startswith((TMP_PREFIX, OLD_PREFIX)):
            continue
        try:
            pid = int(n.rsplit("-", 1)[1] if n.startswith(TMP_PREFIX) else n.rsplit("-", 2)[1])
        except (IndexError, ValueError):
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(os.path.join(parent, n), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_marker(path: str) -> Optional[int]:
    """The step of the whole step directory ``path`` (None: not one)."""
    if os.path.basename(path).startswith((TMP_PREFIX, OLD_PREFIX)):
        return None
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            step = json.loads(f.read())["step"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def latest(path: str) -> Optional[tuple[int, str]]:
    """(step, directory) of the newest whole step at ``path``: the directory itself when it is
    one, else the newest of its subdirectories. None when there is none."""
    path = os.path.abspath(os.fspath(path))
    best: Optional[tuple[int, str]] = None
    own = read_marker(path)
    if own is not None:
        best = (own, path)
    try:
        names = os.listdir(path)
    except OSError:
        return best
    for n in names:
        sub = os.path.join(path, n)
        step = read_marker(sub)
        if step is not None and (best is None or step > best[0]):
            best = (step, sub)
    return best


class Pacer:
    """Paces a write to ``rate`` bytes a second (0: unpaced); gives it up when ``abort`` or
    ``stop`` is set (checked before each chunk)."""

    def __init__(self, rate: float, abort: threading.Event, stop: threading.Event) -> None:
        self.rate = rate
        self.abort, self.stop = abort, stop
        self.t0 = time.monotonic()
        self.done = 0

    def __call__(self, n: int) -> None:
        if self.abort.is_set() or self.stop.is_set():
            raise Skipped()
        if self.rate > 0:
            due = self.t0 + self.done / self.rate
            while True:
                wait = due - time.monotonic()
                if wait <= 0:
                    break
                if self.stop.wait(min(wait, 0.05)) or self.abort.is_set():
                    raise Skipped()
        self.done += n
