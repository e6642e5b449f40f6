"""numa_options in every form (torch's NumaOptions by attributes), the fallback, the log line."""

from __future__ import annotations

import logging
import types

import pytest
from numa_testlib import NO_NVML, build, topologies

from fastelastic.errors import NumaBindingError
from fastelastic.launcher.api import LaunchConfig
from fastelastic.numa import (
    FALLBACK_ENV,
    AffinityMode,
    NumaOptions,
    as_numa_options,
    bind_local_ranks,
    describe,
    fallback_from_env,
)
from fastelastic.watch.view import JobView


def test_forms_of_numa_options(monkeypatch):
    monkeypatch.delenv(FALLBACK_ENV, raising=False)
    assert as_numa_options(None) is None
    assert as_numa_options("socket") == NumaOptions(AffinityMode.SOCKET, False)
    # torch's NumaOptions, read by its attributes (an enum whose value is the mode's name)
    mode = types.SimpleNamespace(value="exclusive")
    theirs = types.SimpleNamespace(affinity_mode=mode, should_fall_back_if_binding_fails=True)
    assert as_numa_options(theirs) == NumaOptions(AffinityMode.EXCLUSIVE, True)
    monkeypatch.setenv(FALLBACK_ENV, "1")
    assert as_numa_options("node") == NumaOptions(AffinityMode.NODE, True)
    with pytest.raises(ValueError, match="not one of node, socket"):
        as_numa_options("nodes")
    with pytest.raises(ValueError, match="expected a NumaOptions"):
        as_numa_options(3)
    with pytest.raises(ValueError, match="core-complex"):
        LaunchConfig(1, 1, 1, numa_options="l3")
    assert LaunchConfig(1, 1, 1, numa_options="node").numa_options == NumaOptions("node", True)


@pytest.mark.parametrize("raw,want", [("", False), ("0", False), ("no", False), ("1", True),
                                      ("true", True), (" YES ", True)])
def test_fallback_env(raw, want):
    assert fallback_from_env({FALLBACK_ENV: raw}) is want


def test_fallback_env_rejects_other_values():
    with pytest.raises(ValueError, match=f"{FALLBACK_ENV}='maybe'"):
        fallback_from_env({FALLBACK_ENV: "maybe"})


@pytest.mark.torch
def test_torchs_own_numa_options_object():
    binding = pytest.importorskip("torch.numa.binding",
                                  reason="!!! torch 2.13 is not installed: torch's NumaOptions")
    opts = binding.NumaOptions(binding.AffinityMode.CORE_COMPLEX, True)
    assert as_numa_options(opts) == NumaOptions(AffinityMode.CORE_COMPLEX, True)


def test_fallback_leaves_only_the_failing_ranks_unbound(tmp_path, caplog):
    topo = next(t for t in topologies() if t.name == "too-few-cores")  # 2 cores, 3 GPUs
    sysfs, procfs = build(tmp_path, topo)
    env = {"FASTELASTIC_SYSFS_ROOT": sysfs, "FASTELASTIC_PROCFS_ROOT": procfs,
               "FASTELASTIC_NVML_LIBRARY": NO_NVML}
    with pytest.raises(NumaBindingError, match="physical core") as e:
        bind_local_ranks(NumaOptions("exclusive"), 3, env=env, allowed=range(4))
    assert "\n" not in str(e.value) and str(e.value).startswith("--numa-binding exclusive:")
    with caplog.at_level(logging.WARNING, logger="fastelastic.numa"):
        got = bind_local_ranks(NumaOptions("node", True), 4, env=env, allowed=range(4))
        assert got == {r: frozenset(range(4)) for r in range(3)}  # rank 3 has no GPU
        assert [r.getMessage() for r in caplog.records] == [
            "--numa-binding node: local rank 3 runs without binding (fallback asked for): it has"
            " no GPU: 3 visible, and torch binds local rank i to GPU i"]
        caplog.clear()
        got_ex = bind_local_ranks(NumaOptions("exclusive", True), 3, env=env, allowed=range(4))
    assert got_ex == {}  # 2 cores for 3 GPUs: torch fails every rank of that node
    assert len(caplog.records) == 3
    assert all("runs without binding" in r.getMessage() for r in caplog.records)


def test_describe_and_watch_column():
    line = describe("node", {0: frozenset({0, 1, 2, 5}), 2: frozenset({7})}, 3)
    assert line == "node: 0->0-2,5 1->unbound 2->7"
    view = JobView()
    base = {"v": 1, "kind": "status", "agent": "h:1", "host": "h", "pid": 1, "state": "HEALTHY"}
    view.update(json_bytes(base))
    assert "NUMA" not in view.render(0.0)
    view.update(json_bytes({**base, "seq": 1, "numa": line}))
    table = view.render(0.0)
    assert "NUMA" in table.splitlines()[0] and line in table


def json_bytes(obj) -> bytes:
    import json

    return json.dumps(obj).encode()

