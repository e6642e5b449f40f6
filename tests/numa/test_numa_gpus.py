"""GPU index -> PCI address as CUDA numbers them: sysfs/procfs, NVML (a fake pynvml), the env."""

from __future__ import annotations

import sys
import types

import pytest
from numa_testlib import FakeGpu, build, smt_host

from fastelastic.errors import NumaBindingError
from fastelastic.numa import NumaOptions, bind_local_ranks
from fastelastic.numa._gpus import torch_pci, visible_gpu_addresses

A, B, C, D = "0000:1b:00.0", "0000:3b:00.0", "0000:9a:00.0", "0001:05:00.0"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """4 GPUs (deliberately not created in PCI order) on a 2-node host; no pynvml."""
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails even if installed
    topo = smt_host(2, 4)
    topo.gpus = [FakeGpu(C, 1, uuid="GPU-cccc0000-0000"), FakeGpu(A, 0, uuid="GPU-aaaa0000-0000"),
                 FakeGpu(D, 1, uuid="GPU-dddd0000-0000"), FakeGpu(B, 0, uuid="GPU-abcd0000-0000")]
    sysfs, procfs = build(tmp_path, topo)
    return {"sysfs_root": sysfs, "procfs_root": procfs}


def _addr(tree, **env):
    return visible_gpu_addresses(env, **tree)[0]


def test_pci_order_and_cuda_visible_devices(tree):
    assert _addr(tree) == [A, B, C, D]
    assert _addr(tree, CUDA_DEVICE_ORDER="PCI_BUS_ID") == [A, B, C, D]
    assert _addr(tree, CUDA_VISIBLE_DEVICES="2,0") == [C, A]
    assert _addr(tree, CUDA_VISIBLE_DEVICES=" 3 , 1") == [D, B]
    assert _addr(tree, CUDA_VISIBLE_DEVICES="GPU-dddd,GPU-aaaa0000-0000") == [D, A]
    # as CUDA: the list ends at an invalid, unknown, ambiguous or repeated entry
    assert _addr(tree, CUDA_VISIBLE_DEVICES="1,7,0") == [B]
    assert _addr(tree, CUDA_VISIBLE_DEVICES="1,-1,0") == [B]
    assert _addr(tree, CUDA_VISIBLE_DEVICES="0,GPU-a,1") == [A]  # GPU-a: two GPUs match
    assert _addr(tree, CUDA_VISIBLE_DEVICES="0,0,1") == [A]
    assert _addr(tree, CUDA_VISIBLE_DEVICES="") == []


def test_mixed_models_need_pci_bus_id_order(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    topo = smt_host(1, 4)
    topo.gpus = [FakeGpu(A, 0, model="NVIDIA A100"), FakeGpu(B, 0, model="NVIDIA T4")]
    sysfs, procfs = build(tmp_path, topo)
    with pytest.raises(NumaBindingError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        visible_gpu_addresses({}, sysfs, procfs)
    assert visible_gpu_addresses({"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, sysfs, procfs)[0] == [A, B]


def test_mig_needs_nvml_and_no_gpu_is_one_line(tree, tmp_path):
    with pytest.raises(NumaBindingError, match="nvidia-ml-py"):
        _addr(tree, CUDA_VISIBLE_DEVICES="MIG-1234")
    with pytest.raises(NumaBindingError, match="no NVIDIA GPU found") as e:
        visible_gpu_addresses({}, str(tmp_path / "none"), str(tmp_path / "none"))
    assert "\n" not in str(e.value)


def test_local_ranks_follow_cuda_visible_devices(tree):
    env = {"FASTELASTIC_SYSFS_ROOT": tree["sysfs_root"],
           "FASTELASTIC_PROCFS_ROOT": tree["procfs_root"], "CUDA_VISIBLE_DEVICES": "2,1"}
    node1 = frozenset([4, 5, 6, 7, 12, 13, 14, 15])
    got = bind_local_ranks(NumaOptions("node"), 2, env=env, allowed=range(16))
    assert got == {0: node1, 1: frozenset(range(16)) - node1}
    # more local ranks than visible GPUs: torch raises; so do we, unless the fallback is asked
    with pytest.raises(NumaBindingError, match="local rank 2: it has no GPU"):
        bind_local_ranks(NumaOptions("node"), 3, env=env, allowed=range(16))


def _fake_pynvml(gpus, calls):
    """pynvml's API as nvidia-ml-py has it, over ``gpus``: (busId, uuid, name, [mig uuids])."""
    class NVMLError(Exception):
        pass

    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.nvmlInit = lambda: calls.append("init")
    m.nvmlShutdown = lambda: calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(gpus)
    m.nvmlDeviceGetHandleByIndex = lambda i: ("gpu", i)

    def mig_handle(h, j):
        migs = gpus[h[1]][3]
        if j >= len(migs):
            raise NVMLError("Not Found")
        return ("mig", h[1], j)

    def uuid(h):
        return gpus[h[1]][1] if h[0] == "gpu" else gpus[h[1]][3][h[2]]

    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=gpus[h[1]][0].encode())
    m.nvmlDeviceGetUUID = uuid
    m.nvmlDeviceGetName = lambda h: gpus[h[1]][2]
    m.nvmlDeviceGetMigMode = lambda h: (1 if gpus[h[1]][3] else 0, 0)
    m.nvmlDeviceGetMaxMigDeviceCount = lambda h: 7
    m.nvmlDeviceGetMigDeviceHandleByIndex = mig_handle
    return m


def test_nvml_path_with_mig(tmp_path, monkeypatch):
    calls: list[str] = []
    gpus = [("00000000:3B:00.0", "GPU-bbbb", "NVIDIA A100", ["MIG-b0", "MIG-b1"]),
            ("00000000:1B:00.0", "GPU-aaaa", "NVIDIA A100", [])]
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(gpus, calls))
    none = str(tmp_path / "no-sysfs")  # NVML alone finds the GPUs
    assert visible_gpu_addresses({}, none, none) == ([A, B], "NVML")
    assert visible_gpu_addresses({"CUDA_VISIBLE_DEVICES": "MIG-b1"}, none, none)[0] == [B]
    assert visible_gpu_addresses({"CUDA_VISIBLE_DEVICES": "GPU-aaaa,MIG-b0"}, none,
                                 none)[0] == [A, B]
    assert visible_gpu_addresses({"CUDA_VISIBLE_DEVICES": "MIG-GPU-bbbb/1/0"}, none,
                                 none)[0] == [B]
    assert visible_gpu_addresses({"CUDA_VISIBLE_DEVICES": "MIG-GPU-aaaa/1/0"}, none,
                                 none)[0] == []  # GPU-aaaa has MIG off
    assert calls == ["init", "shutdown"] * 5


def test_nvml_that_does_not_start_falls_back_to_sysfs(tree, monkeypatch):
    mod = _fake_pynvml([], [])

    def no_driver():
        raise mod.NVMLError("Driver Not Loaded")

    mod.nvmlInit = no_driver
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert visible_gpu_addresses({}, **tree) == ([A, B, C, D], tree["sysfs_root"] +
                                                 "/bus/pci/drivers/nvidia/")


def test_torch_pci_format():
    assert torch_pci("00000000:3B:00.0") == "0000:3b:00.0"
    assert torch_pci("0000:3b:00.1") == "0000:3b:00.0"  # torch always reads function 0
    with pytest.raises(NumaBindingError):
        torch_pci("nonsense")
