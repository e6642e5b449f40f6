"""Owns the CPU choice of each ``--numa-binding`` mode: sysfs reads and pure set arithmetic.

Behaviour follows torch 2.13's ``torch/numa/binding.py`` (read, not copied), mode by mode:

* ``node``: the allowed CPUs of the GPU's NUMA node.
* ``socket``: the allowed CPUs of every possible node whose lowest allowed CPU is on the same
  package as the GPU's node's lowest allowed CPU (a possible node without an allowed CPU, e.g.
  a memory-only node, is torch's failure, so it is ours).
* ``exclusive``: the node's allowed physical cores (a core is named by the lowest CPU of its
  ``thread_siblings_list``), in that order, split evenly among the node's GPUs (all visible
  GPUs, not only the local ranks), siblings together, one extra core to the lowest GPU
  indices; fewer cores than GPUs fails.
* ``core-complex``: the node's allowed CPUs grouped by their largest Data/Unified cache (named
  by its lowest CPU), groups ordered by size (largest first) then name; the GPU's position
  among the node's GPUs, modulo the number of groups, picks one.

"Allowed" is the launcher's own affinity (``sched_getaffinity``). A GPU whose PCI ``numa_node``
reads -1 counts as node 0, as in torch. Every failure is a :class:`NumaBindingError` whose
text is one line; torch fails in the same cases (with its own exceptions).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from fastelastic.errors import NumaBindingError

__all__ = ["MODES", "Topology", "cpus_for_gpu", "parse_cpulist", "format_cpulist"]

MODES = ("node", "socket", "exclusive", "core-complex")


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` (a sysfs cpulist) as a set of ints; ``""`` is empty.

    Raises:
        ValueError: not a cpulist.
    """
    out: set[int] = set()
    for item in text.strip().split(","):
        item = item.strip()
        if not item:
            continue
        lo, sep, hi = item.partition("-")
        first = int(lo)
        last = int(hi) if sep else first
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {item!r}")
        out.update(range(first, last + 1))
    return out


def format_cpulist(cpus: Iterable[int]) -> str:
    """The compact form of a CPU set (``{0,1,2,5}`` -> ``"0-2,5"``), as numactl prints it."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(cpus):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [c]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


class Topology:
    """Reads the CPU and NUMA topology from a sysfs tree (``sysfs_root``, default ``/sys``).

    Args:
        sysfs_root: the directory mounted as ``/sys`` (tests pass a fake tree).
        allowed: the launcher's CPUs (default: ``os.sched_getaffinity(0)``, read once).
    """

    def __init__(self, sysfs_root: str = "/sys", allowed: Iterable[int] | None = None) -> None:
        self.root = sysfs_root
        self._allowed = None if allowed is None else frozenset(allowed)

    @property
    def allowed(self) -> frozenset[int]:
        if self._allowed is None:
            self._allowed = frozenset(os.sched_getaffinity(0))
        return self._allowed

    def _read(self, rel: str) -> str:
        """The text of ``<root>/<rel>``.

        Raises:
            NumaBindingError: it cannot be read.
        """
        path = os.path.join(self.root, rel)
        try:
            with open(path) as f:
                return f.read()
        except OSError as e:
            raise NumaBindingError(f"cannot read {path}: {e.strerror or e}") from None

    def _cpus(self, rel: str) -> set[int]:
        text = self._read(rel)
        try:
            return parse_cpulist(text)
        except ValueError:
            raise NumaBindingError(
                f"{os.path.join(self.root, rel)} is not a CPU list: {text.strip()[:40]!r}"
            ) from None

    def _int(self, rel: str) -> int:
        text = self._read(rel)
        try:
            return int(text.strip())
        except ValueError:
            raise NumaBindingError(
                f"{os.path.join(self.root, rel)} is not an integer: {text.strip()[:40]!r}"
            ) from None

    def pci_numa_node(self, pci: str) -> int:
        """The NUMA node of PCI device ``pci`` (-1, i.e. unknown, counts as node 0)."""
        return max(self._int(f"bus/pci/devices/{pci}/numa_node"), 0)

    def node_cpus(self, node: int) -> set[int]:
        """The allowed CPUs of NUMA node ``node`` (possibly empty)."""
        return self._cpus(f"devices/system/node/node{node}/cpulist") & self.allowed

    def possible_nodes(self) -> set[int]:
        return self._cpus("devices/system/node/possible")

    def package_of(self, cpu: int) -> int:
        return self._int(f"devices/system/cpu/cpu{cpu}/topology/physical_package_id")

    def core_of(self, cpu: int) -> int:
        """The lowest CPU of ``cpu``'s physical core (its SMT siblings included)."""
        siblings = self._cpus(f"devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if not siblings:
            raise NumaBindingError(f"CPU {cpu} has an empty thread_siblings_list")
        return min(siblings)

    def cache_group_of(self, cpu: int) -> int:
        """The lowest CPU sharing ``cpu``'s highest-level Data or Unified cache."""
        rel = f"devices/system/cpu/cpu{cpu}/cache"
        try:
            entries = sorted(os.listdir(os.path.join(self.root, rel)))
        except OSError as e:
            raise NumaBindingError(
                f"cannot list {os.path.join(self.root, rel)}: {e.strerror or e}"
            ) from None
        best_level = -1
        shared: set[int] = set()
        for entry in entries:
            if not (entry.startswith("index") and entry[5:].isdecimal()):
                continue
            if self._read(f"{rel}/{entry}/type").strip() not in ("Data", "Unified"):
                continue
            level = self._int(f"{rel}/{entry}/level")
            if level > best_level:
                best_level = level
                shared = self._cpus(f"{rel}/{entry}/shared_cpu_list")
        if not shared:
            raise NumaBindingError(f"CPU {cpu} has no Data or Unified cache in {rel}")
        return min(shared)

    def package_of_node(self, node: int) -> int:
        cpus = self.node_cpus(node)
        if not cpus:
            raise NumaBindingError(
                f"NUMA node {node} has no CPU the launcher may use (a memory-only node, or "
                "outside its affinity), so its socket is unknown"
            )
        return self.package_of(min(cpus))


def _groups(cpus: set[int], key: Callable[[int], int]) -> dict[int, set[int]]:
    out: dict[int, set[int]] = {}
    for c in cpus:
        out.setdefault(key(c), set()).add(c)
    return out


def cpus_for_gpu(
    mode: str, gpu: int, gpu_count: int, node_of: Callable[[int], int], topo: Topology
) -> set[int]:
    """The CPUs that the worker using GPU ``gpu`` is bound to in ``mode``.

    Args:
        mode: one of :data:`MODES`.
        gpu: the worker's GPU index (its local rank), in ``0..gpu_count-1``.
        gpu_count: how many GPUs CUDA would see.
        node_of: the NUMA node of a GPU index (read lazily: torch reads only what it needs).
        topo: the CPU topology.

    Raises:
        NumaBindingError: this GPU cannot be bound in ``mode`` (one-line reason).
    """
    if not 0 <= gpu < gpu_count:
        raise NumaBindingError(
            f"it has no GPU: {gpu_count} visible, and torch binds local rank i to GPU i"
        )
    node = node_of(gpu)
    if mode == "node":
        chosen = topo.node_cpus(node)
    elif mode == "socket":
        package = topo.package_of_node(node)
        chosen = set()
        for other in sorted(topo.possible_nodes()):
            if topo.package_of_node(other) == package:
                chosen |= topo.node_cpus(other)
    elif mode in ("exclusive", "core-complex"):
        peers = [g for g in range(gpu_count) if node_of(g) == node]
        position = peers.index(gpu)
        cpus = topo.node_cpus(node)
        if mode == "exclusive":
            chosen = _exclusive(cpus, position, len(peers), node, topo)
        else:
            chosen = _core_complex(cpus, position, node, topo)
    else:
        raise NumaBindingError(f"unknown mode {mode!r} (expected one of {', '.join(MODES)})")
    if not chosen:
        raise NumaBindingError(
            f"GPU {gpu}'s NUMA node {node} has no CPU the launcher may use (its affinity is "
            f"{format_cpulist(topo.allowed)})"
        )
    return chosen


def _exclusive(cpus: set[int], position: int, peers: int, node: int, topo: Topology) -> set[int]:
    cores = sorted(_groups(cpus, topo.core_of).items())
    share, extra = divmod(len(cores), peers)
    if share < 1:
        raise NumaBindingError(
            f"exclusive: NUMA node {node} has {len(cores)} physical core(s) the launcher may "
            f"use for its {peers} GPUs"
        )
    start = position * share + min(position, extra)
    stop = start + share + (1 if position < extra else 0)
    return {c for _, group in cores[start:stop] for c in group}


def _core_complex(cpus: set[int], position: int, node: int, topo: Topology) -> set[int]:
    groups = sorted(_groups(cpus, topo.cache_group_of).items(), key=lambda kv: (-len(kv[1]), kv[0]))
    if not groups:
        raise NumaBindingError(f"core-complex: NUMA node {node} has no CPU the launcher may use")
    return groups[position % len(groups)][1]

