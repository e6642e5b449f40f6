"""torch 2.13's own selection, run on the same fake trees, gives the same CPUs or also fails.

Inside ``torch.numa.binding`` (only there) ``open`` reads the fake tree, ``os.listdir`` lists it,
``os.sched_getaffinity`` is the topology's launcher cpuset, ``shutil.which`` finds numactl (we
need none: its absence is torch's failure only) and ``torch.cuda`` sees the fake GPUs in PCI
order. Every mode, every topology, every local rank up to one past the GPU count.
"""

from __future__ import annotations

import os
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from numa_testlib import NO_NVML, FakeGpu, build, smt_host, topologies

from fastelastic.errors import NumaBindingError
from fastelastic.numa import MODES, NumaOptions, bind_local_ranks


@pytest.fixture(scope="module")
def binding():
    try:
        from torch.numa import binding
    except ImportError:
        pytest.skip("!!! torch 2.13 is not installed: cannot compare with torch.numa.binding")
    return binding


def _patch(monkeypatch, binding, sysfs: str, allowed: frozenset[int], pcis: list[str]) -> None:
    real_open = open

    def fake_open(path, *a, **k):
        path = str(path)
        if path.startswith("/sys/"):
            path = os.path.join(sysfs, path[len("/sys/"):])
        return real_open(path, *a, **k)

    def fake_listdir(path):
        path = str(path)
        if path.startswith("/sys/"):
            path = os.path.join(sysfs, path[len("/sys/"):])
        return os.listdir(path)

    fake_os = types.SimpleNamespace(
        path=os.path, listdir=fake_listdir, sched_getaffinity=lambda pid: set(allowed),
        sched_setaffinity=None,
    )

    def props(i: int):
        if not 0 <= i < len(pcis):
            raise AssertionError("Invalid device id")
        dom, bus, dev = pcis[i].split(".")[0].split(":")
        return types.SimpleNamespace(pci_domain_id=int(dom, 16), pci_bus_id=int(bus, 16),
                                     pci_device_id=int(dev, 16))

    cuda = types.SimpleNamespace(device_count=lambda: len(pcis), get_device_properties=props)
    monkeypatch.setattr(binding, "open", fake_open, raising=False)
    monkeypatch.setattr(binding, "os", fake_os)
    monkeypatch.setattr(binding, "shutil", types.SimpleNamespace(which=lambda n: "/usr/bin/" + n))
    monkeypatch.setattr(binding, "torch", types.SimpleNamespace(cuda=cuda))


def _compare(binding, monkeypatch, root, topos) -> tuple[list[str], int, int]:
    """(mismatches, bound, failed) over every mode and local rank of each topology."""
    mismatches: list[str] = []
    bound = failed = 0
    for topo in topos:
        sysfs, procfs = build(root / topo.name, topo)
        allowed = topo.launcher_cpus()
        pcis = sorted(g.pci for g in topo.gpus)
        env = {"FASTELASTIC_SYSFS_ROOT": sysfs, "FASTELASTIC_PROCFS_ROOT": procfs,
               "FASTELASTIC_NVML_LIBRARY": NO_NVML}
        with monkeypatch.context() as m:
            _patch(m, binding, sysfs, allowed, pcis)
            for mode in MODES:
                for rank in range(len(pcis) + 1):
                    try:
                        theirs: object = binding._get_validated_logical_cpus_to_bind_to(
                            gpu_index=rank,
                            numa_options=binding.NumaOptions(binding.AffinityMode(mode)))
                    except Exception as e:  # noqa: BLE001 - any failure of torch's
                        theirs = f"fails ({type(e).__name__}: {e})"
                    try:
                        got = bind_local_ranks(NumaOptions(mode), len(pcis) + 1, env=env,
                                               allowed=allowed, only=rank)
                        ours: object = set(got[rank])
                    except NumaBindingError as e:
                        ours = f"fails ({e})"
                    same = (isinstance(theirs, str) and isinstance(ours, str)) or theirs == ours
                    if not same:
                        mismatches.append(f"{topo.name} {mode} rank {rank}: torch {theirs}, "
                                          f"fastelastic {ours}")
                    elif isinstance(ours, str):
                        failed += 1
                    else:
                        bound += 1
    return mismatches, bound, failed


def test_same_cpus_or_same_failure_as_torch(binding, tmp_path, monkeypatch):
    mismatches, bound, failed = _compare(binding, monkeypatch, tmp_path, topologies())
    assert mismatches == [], "\n".join(mismatches)
    # the comparison covered both outcomes, many times
    assert bound > 100 and failed > 20, (bound, failed)


def test_the_topologies_bind_as_documented(tmp_path):
    """A few sets spelled out, so a shared misreading of torch would still be caught."""
    topo = topologies()[0]  # 2 sockets x 16 cores, SMT; GPUs 0-3 on node 0, 4-7 on node 1
    sysfs, procfs = build(tmp_path, topo)
    env = {"FASTELASTIC_SYSFS_ROOT": sysfs, "FASTELASTIC_PROCFS_ROOT": procfs,
               "FASTELASTIC_NVML_LIBRARY": NO_NVML}
    allowed = topo.launcher_cpus()

    def bind(mode):
        return bind_local_ranks(NumaOptions(mode), 8, env=env, allowed=allowed)

    node0 = frozenset([*range(0, 16), *range(32, 48)])
    assert bind("node")[0] == node0 and bind("node")[5] == frozenset(range(64)) - node0
    assert bind("socket")[3] == node0
    ex = bind("exclusive")  # 16 cores among 4 GPUs: 4 cores each, siblings together
    assert ex[0] == frozenset([0, 1, 2, 3, 32, 33, 34, 35])
    assert ex[7] == frozenset([28, 29, 30, 31, 60, 61, 62, 63])
    assert bind("core-complex")[1] == node0  # one L3 per socket: every GPU shares it


@st.composite
def _random_topology(draw):
    sockets = draw(st.integers(1, 2))
    per_socket = draw(st.integers(1, 4))
    cores = draw(st.integers(1, 4))
    smt = draw(st.integers(1, 2))
    l3 = draw(st.integers(1, cores * per_socket))
    n_nodes = sockets * per_socket
    gpu_nodes = draw(st.lists(st.integers(-1, n_nodes - 1), min_size=1, max_size=6))
    topo = smt_host(sockets, cores, per_socket, l3, [max(n, 0) for n in gpu_nodes], "random",
                    smt)
    topo.gpus = [FakeGpu(g.pci, n) for g, n in zip(topo.gpus, gpu_nodes, strict=True)]
    every = sorted(c.id for c in topo.cpus)
    if draw(st.booleans()):  # a restricted launcher cpuset (never empty)
        topo.allowed = frozenset(draw(st.lists(st.sampled_from(every), min_size=1, unique=True)))
    if draw(st.booleans()):  # a memory-only node
        topo.nodes[n_nodes] = []
    return topo


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(topo=_random_topology())
def test_random_topologies_match_torch(binding, tmp_path_factory, monkeypatch, topo):
    root = tmp_path_factory.mktemp("random")
    mismatches, _, _ = _compare(binding, monkeypatch, root, [topo])
    assert mismatches == [], "\n".join(mismatches)
