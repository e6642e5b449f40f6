"""GPU index -> PCI address as CUDA numbers them: NVML (a stand-in C library loaded as the
real one is), sysfs/procfs where NVML cannot load (with a warning), the env."""

from __future__ import annotations

import logging

import pytest
from numa_testlib import NO_NVML, FakeGpu, build, fake_nvml, nvml_gpus, smt_host

from fastelastic.errors import NumaBindingError
from fastelastic.numa import NumaOptions, _gpus, bind_local_ranks
from fastelastic.numa._gpus import torch_pci, visible_gpu_addresses

A, B, C, D = "0000:1b:00.0", "0000:3b:00.0", "0000:9a:00.0", "0001:05:00.0"


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    monkeypatch.setattr(_gpus, "_warned", set())  # each test sees its own sysfs warning


@pytest.fixture(scope="module")
def nvml_lib(tmp_path_factory):
    return fake_nvml(tmp_path_factory.mktemp("nvml"))


@pytest.fixture
def tree(tmp_path):
    """4 GPUs (deliberately not created in PCI order) on a 2-node host."""
    topo = smt_host(2, 4)
    topo.gpus = [FakeGpu(C, 1, uuid="GPU-cccc0000-0000"), FakeGpu(A, 0, uuid="GPU-aaaa0000-0000"),
                 FakeGpu(D, 1, uuid="GPU-dddd0000-0000"), FakeGpu(B, 0, uuid="GPU-abcd0000-0000")]
    sysfs, procfs = build(tmp_path, topo)
    return {"sysfs_root": sysfs, "procfs_root": procfs}


def _addr(tree, **env):
    return visible_gpu_addresses({"FASTELASTIC_NVML_LIBRARY": NO_NVML, **env}, **tree)[0]


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


def test_mixed_models_need_pci_bus_id_order(tmp_path):
    topo = smt_host(1, 4)
    topo.gpus = [FakeGpu(A, 0, model="NVIDIA A100"), FakeGpu(B, 0, model="NVIDIA T4")]
    sysfs, procfs = build(tmp_path, topo)
    env = {"FASTELASTIC_NVML_LIBRARY": NO_NVML}
    with pytest.raises(NumaBindingError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        visible_gpu_addresses(env, sysfs, procfs)
    assert visible_gpu_addresses({**env, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, sysfs,
                                 procfs)[0] == [A, B]


def test_mig_needs_nvml_and_no_gpu_is_one_line(tree, tmp_path):
    with pytest.raises(NumaBindingError, match=r"needs NVML \(libnvidia-ml.so.1\)"):
        _addr(tree, CUDA_VISIBLE_DEVICES="MIG-1234")
    with pytest.raises(NumaBindingError, match="no NVIDIA GPU found") as e:
        visible_gpu_addresses({"FASTELASTIC_NVML_LIBRARY": NO_NVML}, str(tmp_path / "none"),
                              str(tmp_path / "none"))
    assert "\n" not in str(e.value)
    assert f"no NVML ({NO_NVML}: cannot open shared object file" in str(e.value)


def test_local_ranks_follow_cuda_visible_devices(tree):
    env = {"FASTELASTIC_NVML_LIBRARY": NO_NVML, "FASTELASTIC_SYSFS_ROOT": tree["sysfs_root"],
           "FASTELASTIC_PROCFS_ROOT": tree["procfs_root"], "CUDA_VISIBLE_DEVICES": "2,1"}
    node1 = frozenset([4, 5, 6, 7, 12, 13, 14, 15])
    got = bind_local_ranks(NumaOptions("node"), 2, env=env, allowed=range(16))
    assert got == {0: node1, 1: frozenset(range(16)) - node1}
    # more local ranks than visible GPUs: torch raises; so do we, unless the fallback is asked
    with pytest.raises(NumaBindingError, match="local rank 2: it has no GPU"):
        bind_local_ranks(NumaOptions("node"), 3, env=env, allowed=range(16))


def test_nvml_lists_fewer_gpus_than_sysfs_and_decides(tree, nvml_lib, monkeypatch, caplog):
    """A container given GPUs C and A of the host's four (the NVIDIA container runtime): sysfs
    still lists all four, NVML (a stand-in library, loaded with ctypes as the real one) only
    those two, and the binding follows NVML: local rank 1 is near C (node 1), not near B
    (node 0), the second GPU of the host's list. No warning: NVML loaded."""
    log = tree["sysfs_root"] + "/../nvml.log"
    monkeypatch.setenv("FAKE_NVML_LOG", log)
    monkeypatch.setenv("FAKE_NVML_GPUS", nvml_gpus(
        ("00000000:9A:00.0", "GPU-cccc0000-0000", "NVIDIA H100 80GB HBM3"),
        ("00000000:1B:00.0", "GPU-aaaa0000-0000", "NVIDIA H100 80GB HBM3")))
    env = {"FASTELASTIC_NVML_LIBRARY": nvml_lib}
    with caplog.at_level(logging.WARNING, logger="fastelastic.numa"):
        assert visible_gpu_addresses(env, **tree) == ([A, C], f"NVML ({nvml_lib})")
        assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "1"}, **tree)[0] == [C]
        assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "GPU-cccc,0"},
                                     **tree)[0] == [C, A]
        # an index past the container's GPUs ends the list, as in CUDA
        assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "0,2"}, **tree)[0] == [A]
        bind_env = {**env, "FASTELASTIC_SYSFS_ROOT": tree["sysfs_root"],
                    "FASTELASTIC_PROCFS_ROOT": tree["procfs_root"]}
        node0 = frozenset([0, 1, 2, 3, 8, 9, 10, 11])
        got = bind_local_ranks(NumaOptions("node"), 2, env=bind_env, allowed=range(16))
        assert got == {0: node0, 1: frozenset(range(16)) - node0}
        with pytest.raises(NumaBindingError, match="local rank 2: it has no GPU"):
            bind_local_ranks(NumaOptions("node"), 3, env=bind_env, allowed=range(16))
    assert not caplog.records, [r.getMessage() for r in caplog.records]
    with open(log) as f:
        assert f.read().split() == ["init", "shutdown"] * 6  # every start shut down
    # the same container with NVML unloadable: sysfs's second GPU (B, node 0) for rank 1,
    # and a warning that says so
    no_nvml = {**bind_env, "FASTELASTIC_NVML_LIBRARY": NO_NVML}
    with caplog.at_level(logging.WARNING, logger="fastelastic.numa"):
        got = bind_local_ranks(NumaOptions("node"), 2, env=no_nvml, allowed=range(16))
    assert got == {0: node0, 1: node0}
    assert len(caplog.records) == 1


def test_nvml_with_mig(tmp_path, nvml_lib, monkeypatch):
    monkeypatch.setenv("FAKE_NVML_GPUS", nvml_gpus(
        ("00000000:3B:00.0", "GPU-bbbb", "NVIDIA A100", ["MIG-b0", "MIG-b1"]),
        ("00000000:1B:00.0", "GPU-aaaa", "NVIDIA A100")))
    none = str(tmp_path / "no-sysfs")  # NVML alone finds the GPUs
    env = {"FASTELASTIC_NVML_LIBRARY": nvml_lib}
    assert visible_gpu_addresses(env, none, none)[0] == [A, B]
    assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "MIG-b1"}, none, none)[0] == [B]
    assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "GPU-aaaa,MIG-b0"}, none,
                                 none)[0] == [A, B]
    assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "MIG-GPU-bbbb/1/0"}, none,
                                 none)[0] == [B]
    assert visible_gpu_addresses({**env, "CUDA_VISIBLE_DEVICES": "MIG-GPU-aaaa/1/0"}, none,
                                 none)[0] == []  # GPU-aaaa has MIG off


def test_nvml_that_does_not_start_falls_back_to_sysfs_with_a_warning(tree, nvml_lib,
                                                                      monkeypatch, caplog):
    monkeypatch.setenv("FAKE_NVML_INIT_RC", "9")  # NVML_ERROR_DRIVER_NOT_LOADED
    env = {"FASTELASTIC_NVML_LIBRARY": nvml_lib}
    with caplog.at_level(logging.WARNING, logger="fastelastic.numa"):
        assert visible_gpu_addresses(env, **tree) == (
            [A, B, C, D], tree["sysfs_root"] + "/bus/pci/drivers/nvidia/")
        visible_gpu_addresses(env, **tree)
    [warning] = [r.getMessage() for r in caplog.records]  # once per cause and process
    assert "nvmlInit_v2 returned Driver Not Loaded (9)" in warning
    assert "shows every GPU of the host" in warning and "NVIDIA container runtime" in warning
    assert "bound near other GPUs than their own" in warning


def test_no_nvml_and_no_gpu_in_sysfs_is_no_warning(tmp_path, caplog):
    """A CPU-only host: the one-line error names NVML's failure; no warning beside it."""
    with caplog.at_level(logging.WARNING, logger="fastelastic.numa"):
        with pytest.raises(NumaBindingError, match="no NVIDIA GPU found: no NVML"):
            visible_gpu_addresses({"FASTELASTIC_NVML_LIBRARY": NO_NVML}, str(tmp_path),
                                  str(tmp_path))
    assert not caplog.records


def test_torch_pci_format():
    assert torch_pci("00000000:3B:00.0") == "0000:3b:00.0"
    assert torch_pci("0000:3b:00.1") == "0000:3b:00.0"  # torch always reads function 0
    with pytest.raises(NumaBindingError):
        torch_pci("nonsense")
