"""Room for the agent's checkpoint memory: /dev/shm, the cgroup memory limit, the host.

The agent asks before it reserves a buffer; a buffer that cannot fit is refused with one line
naming the limit and the fix, and a buffer is reserved with ``posix_fallocate`` (every page
taken up front), so a later write never meets a full tmpfs (SIGBUS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

__all__ = ["LIMIT_ENV", "SHM_DIR", "Room", "measure", "parse_bytes", "fmt_bytes"]

LIMIT_ENV = "FASTELASTIC_CHECKPOINT_MEMORY_LIMIT"  # bytes the agent may hold, e.g. "8G"
SHM_DIR = "/dev/shm"
_UNLIMITED = 1 << 60


def parse_bytes(raw: str) -> int:
    """``"512M"``, ``"8G"``, ``"1048576"`` -> bytes.

    Raises:
        ValueError: not a size.
    """
    s = raw.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    try:
        value = float(s) * mult
    except ValueError:
        raise ValueError(f"{raw!r} is not a size (e.g. 512M, 8G)") from None
    if value < 0:
        raise ValueError(f"{raw!r} is not a size (e.g. 512M, 8G)")
    return int(value)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass
class Room:
    """Free bytes under each limit (``None``: that limit is absent or unreadable)."""

    shm: Optional[int]
    cgroup: Optional[int]
    cgroup_limit: Optional[int]
    host: Optional[int]

    def refuse(self, need: int, held: int, limit: Optional[int]) -> Optional[str]:
        """The one line that says why ``need`` more bytes cannot be held, or None if they can.

        /dev/shm alone is no reason: the caller falls back to memfd (``uses_memfd``).
        """
        want = fmt_bytes(need)
        if limit is not None and held + need > limit:
            return (f"the checkpoint memory needs {want} more but {LIMIT_ENV}={fmt_bytes(limit)}"
                    f" and {fmt_bytes(held)} are held: raise {LIMIT_ENV} or save a smaller state"
                    " per rank")
        if self.cgroup is not None and need > self.cgroup:
            return (f"the checkpoint memory needs {want} but the cgroup memory limit "
                    f"({fmt_bytes(self.cgroup_limit or 0)}) leaves {fmt_bytes(self.cgroup)}: "
                    "raise the container's memory limit (e.g. docker --memory) or save a smaller"
                    " state per rank")
        if self.host is not None and need > self.host:
            return (f"the checkpoint memory needs {want} but the host has "
                    f"{fmt_bytes(self.host)} available (MemAvailable): free memory, use more "
                    "nodes, or save a smaller state per rank")
        return None

    def uses_memfd(self, need: int) -> bool:
        return self.shm is None or need > self.shm


def _read_int(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    if raw == "max":
        return _UNLIMITED
    try:
        return int(raw)
    except ValueError:
        return None


def _inactive_file(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_room() -> tuple[Optional[int], Optional[int]]:
    """(free, limit) of this process's memory cgroup, v2 or v1; (None, None) when unlimited."""
    v2 = "/sys/fs/cgroup"
    for limit_f, usage_f, stat_f, key in (
        (f"{v2}/memory.max", f"{v2}/memory.current", f"{v2}/memory.stat", "inactive_file"),
        (f"{v2}/memory/memory.limit_in_bytes", f"{v2}/memory/memory.usage_in_bytes",
         f"{v2}/memory/memory.stat", "total_inactive_file"),
    ):
        limit = _read_int(limit_f)
        usage = _read_int(usage_f)
        if limit is None or usage is None:
            continue
        if limit >= _UNLIMITED >> 1:
            return None, None
        return max(0, limit - usage + _inactive_file(stat_f, key)), limit
    return None, None


def _host_available() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _shm_free() -> Optional[int]:
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def measure() -> Room:
    cg, cg_limit = _cgroup_room()
    return Room(shm=_shm_free(), cgroup=cg, cgroup_limit=cg_limit, host=_host_available())


def limit_from_env() -> Optional[int]:
    """``$FASTELASTIC_CHECKPOINT_MEMORY_LIMIT`` in bytes, or None.

    Raises:
        ValueError: the variable is set but is not a size.
    """
    raw = os.environ.get(LIMIT_ENV, "").strip()
    if not raw:
        return None
    try:
        return parse_bytes(raw)
    except ValueError as e:
        raise ValueError(f"{LIMIT_ENV}: {e}") from None
