"""Fake sysfs/procfs trees of real NUMA topologies, built in a test's tmp_path.

A topology is a list of CPUs (id, node, package, physical core, L3 group), the nodes (memory-only
ones have an empty cpulist), the possible nodes and the GPUs (PCI address, NUMA node as its sysfs
file reads, model, UUID). :func:`build` writes what Linux and the nvidia driver show:

* ``sys/devices/system/node/{possible,nodeN/cpulist}``;
* ``sys/devices/system/cpu/cpuN/topology/{physical_package_id,thread_siblings_list}`` and
  ``cache/index{0..3}/{type,level,shared_cpu_list}`` (L1d, L1i, L2 per core, L3 per group);
* ``sys/bus/pci/devices/ADDR/{numa_node,device}``, ``sys/bus/pci/drivers/nvidia/ADDR``;
* ``proc/driver/nvidia/gpus/ADDR/information``.

NVML: ``NO_NVML`` is a library path that cannot load (so a fake tree decides, even on a host
with a driver); :func:`fake_nvml` builds ``fake_nvml.c``, a stand-in ``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from fastelastic.numa import format_cpulist

NO_NVML = "/nonexistent/libnvidia-ml.so.1"  # FASTELASTIC_NVML_LIBRARY that cannot load


def fake_nvml(out_dir: Path) -> str:
    """Builds the stand-in NVML library (``fake_nvml.c``) with ``cc``; its path."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("!!! no C compiler (cc): the NVML path is untested")
    lib = out_dir / "libnvidia-ml.so.1"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(lib),
                    str(Path(__file__).with_name("fake_nvml.c"))], check=True)
    return str(lib)


def nvml_gpus(*gpus: tuple[str, str, str] | tuple[str, str, str, list[str]]) -> str:
    """``$FAKE_NVML_GPUS`` for (busId, uuid, name[, MIG uuids]) of each GPU, in NVML's order."""
    return ";".join(",".join([*g[:3], *(g[3] if len(g) > 3 else [])]) for g in gpus)


@dataclass(frozen=True)
class Cpu:
    id: int
    node: int
    package: int
    core: int  # a physical core id, unique on the host
    l3: int  # an L3 group id, unique on the host


@dataclass(frozen=True)
class FakeGpu:
    pci: str  # 0000:3b:00.0
    numa_node: int  # as sysfs reads (-1: unknown)
    model: str = "NVIDIA H100 80GB HBM3"
    uuid: str = ""


@dataclass
class Topo:
    name: str
    cpus: list[Cpu]
    nodes: dict[int, list[int]]  # node -> its CPUs ([] for a memory-only node)
    gpus: list[FakeGpu]
    allowed: frozenset[int] = field(default_factory=frozenset)  # empty: every CPU

    def launcher_cpus(self) -> frozenset[int]:
        return self.allowed or frozenset(c.id for c in self.cpus)


def _w(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def build(root: Path, topo: Topo) -> tuple[str, str]:
    """Writes ``topo`` under ``root``; returns (sysfs root, procfs root)."""
    sys_root, proc_root = root / "sys", root / "proc"
    nodes = root / "sys/devices/system/node"
    _w(nodes / "possible", format_cpulist(topo.nodes))
    for n, cpus in topo.nodes.items():
        _w(nodes / f"node{n}/cpulist", format_cpulist(cpus))
    by_core: dict[int, list[int]] = {}
    by_l3: dict[int, list[int]] = {}
    for c in topo.cpus:
        by_core.setdefault(c.core, []).append(c.id)
        by_l3.setdefault(c.l3, []).append(c.id)
    for c in topo.cpus:
        d = root / f"sys/devices/system/cpu/cpu{c.id}"
        _w(d / "topology/physical_package_id", str(c.package))
        _w(d / "topology/thread_siblings_list", format_cpulist(by_core[c.core]))
        caches = [("Data", 1, by_core[c.core]), ("Instruction", 1, by_core[c.core]),
                  ("Unified", 2, by_core[c.core]), ("Unified", 3, by_l3[c.l3])]
        for i, (kind, level, shared) in enumerate(caches):
            _w(d / f"cache/index{i}/type", kind)
            _w(d / f"cache/index{i}/level", str(level))
            _w(d / f"cache/index{i}/shared_cpu_list", format_cpulist(shared))
    driver = root / "sys/bus/pci/drivers/nvidia"
    driver.mkdir(parents=True, exist_ok=True)
    for f in ("bind", "unbind", "new_id", "remove_id", "uevent"):
        (driver / f).write_text("")
    for i, g in enumerate(topo.gpus):
        dev = root / f"sys/bus/pci/devices/{g.pci}"
        _w(dev / "numa_node", str(g.numa_node))
        _w(dev / "device", "0x2330")
        os.symlink(dev, driver / g.pci)
        uuid = g.uuid or f"GPU-{i:08x}-1111-2222-3333-444455556666"
        _w(root / f"proc/driver/nvidia/gpus/{g.pci}/information",
           f"Model: \t\t {g.model}\nIRQ:   \t\t 42\nGPU UUID: \t {uuid}\n"
           f"Video BIOS: \t 96.00.99.00.01\nBus Type: \t PCIe\nBus Location: \t {g.pci}")
    return str(sys_root), str(proc_root)


def _pci(bus: int) -> str:
    return f"0000:{bus:02x}:00.0"


def smt_host(sockets: int, cores_per_node: int, nodes_per_socket: int = 1, cores_per_l3: int = 0,
             gpu_nodes: list[int] | None = None, name: str = "", smt: int = 2) -> Topo:
    """Linux numbering on an SMT-2 host: first threads 0..N-1 by node, their siblings N..2N-1
    (``smt=1``: no siblings)."""
    n_cores = sockets * nodes_per_socket * cores_per_node
    per_l3 = cores_per_l3 or cores_per_node * nodes_per_socket
    cpus = []
    nodes: dict[int, list[int]] = {}
    for core in range(n_cores):
        node = core // cores_per_node
        package = node // nodes_per_socket
        for thread in (core, core + n_cores)[:smt]:
            cpus.append(Cpu(thread, node, package, core, core // per_l3))
            nodes.setdefault(node, []).append(thread)
    gpus = [FakeGpu(_pci(0x10 + 0x10 * i), n) for i, n in enumerate(gpu_nodes or [])]
    return Topo(name, sorted(cpus, key=lambda c: c.id), nodes, gpus)


def topologies() -> list[Topo]:
    """The issue's topologies, and a few of torch's failure cases."""
    out = []
    # DGX-like: 2 sockets x 16 cores, SMT, 1 node per socket, 4 GPUs on each
    out.append(smt_host(2, 16, gpu_nodes=[0, 0, 0, 0, 1, 1, 1, 1], name="2s-4gpu-smt"))
    # AMD NPS4: 2 sockets x 4 nodes x 4 cores, SMT, an L3 (CCX) per 2 cores; GPUs unevenly
    out.append(smt_host(2, 4, nodes_per_socket=4, cores_per_l3=2,
                        gpu_nodes=[0, 0, 1, 3, 4, 4, 4, 6], name="amd-nps4"))
    # the same seen from a cpuset that leaves node 0's first L3 complex one CPU of four: the
    # complexes are uneven, and torch gives out the fuller ones first
    t = smt_host(2, 4, nodes_per_socket=4, cores_per_l3=2,
                 gpu_nodes=[0, 0, 0, 1, 4, 4, 4, 6], name="amd-nps4-uneven-l3")
    t.allowed = frozenset(c.id for c in t.cpus) - {0, 32, 33}
    out.append(t)
    # a single-node host whose GPUs read numa_node -1 (torch: node 0)
    t = smt_host(1, 8, gpu_nodes=[0, 0], name="numa-minus-1")
    t.gpus = [FakeGpu(g.pci, -1) for g in t.gpus]
    out.append(t)
    # the DGX-like host seen from a restricted cpuset (cores 0-5 and 20-23 with siblings)
    t = smt_host(2, 16, gpu_nodes=[0, 0, 0, 0, 1, 1, 1, 1], name="restricted-cpuset")
    t.allowed = frozenset([*range(0, 6), *range(20, 24), *range(32, 38), 52, 53])
    out.append(t)
    # a memory-only node (CXL / HBM): in the possible nodes, no CPU (socket mode fails)
    t = smt_host(2, 4, gpu_nodes=[0, 1], name="memory-only-node")
    t.nodes[2] = []
    out.append(t)
    # more GPUs than physical cores on a node (exclusive fails), 2 cores, 3 GPUs
    out.append(smt_host(1, 2, gpu_nodes=[0, 0, 0], name="too-few-cores"))
    # a cpuset that leaves node 1 no CPU at all (its GPU cannot be bound in any mode)
    t = smt_host(2, 4, gpu_nodes=[0, 1], name="node-outside-cpuset")
    t.allowed = frozenset([0, 1, 2, 3, 8, 9, 10, 11])
    out.append(t)
    return out
