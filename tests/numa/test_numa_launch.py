"""Real launches on this machine with an injected topology mapped onto its CPUs.

Two NUMA nodes of one real CPU each, one GPU on each: every worker's ``sched_getaffinity`` must
be its GPU's node, plainly started, forked by the ``--preload`` zygote, and after a restart; the
launcher never imports torch; a CPU-only host fails in one line (exit 1, as torchrun).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from numa_testlib import NO_NVML, Cpu, FakeGpu, Topo, build, fake_nvml, nvml_gpus

from fastelastic.multiprocessing import DefaultLogsSpecs, start_processes

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = str(HERE / "numa_worker.py")
MINE = sorted(os.sched_getaffinity(0))
needs_two = pytest.mark.skipif(
    len(MINE) < 2, reason=f"!!! needs 2 CPUs in this process's affinity, has {MINE}")


def _tree(tmp_path: Path) -> tuple[dict[str, str], int, int]:
    a, b = MINE[0], MINE[1]
    topo = Topo("real-2x1", [Cpu(a, 0, 0, 0, 0), Cpu(b, 1, 0, 1, 1)], {0: [a], 1: [b]},
                [FakeGpu("0000:01:00.0", 0), FakeGpu("0000:02:00.0", 1)])
    sysfs, procfs = build(tmp_path / "tree", topo)
    return {"FASTELASTIC_SYSFS_ROOT": sysfs, "FASTELASTIC_PROCFS_ROOT": procfs}, a, b


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "FASTELASTIC_", "CUDA_"))}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = str(REPO / "src")
    env["LOGLEVEL"] = "INFO"  # the agent's line of each rank's CPUs
    env["FASTELASTIC_NVML_LIBRARY"] = NO_NVML  # the fake tree decides, even beside a driver
    env.update(extra)
    return env


def _fastrun(args: list[str], env: dict[str, str], timeout: float = 120):
    return subprocess.Popen([sys.executable, "-m", "fastelastic.run", "--standalone", *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(p: subprocess.Popen, timeout: float = 120) -> tuple[int, str]:
    try:
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, err


def _records(out: Path) -> dict[tuple[int, int], dict]:
    return {(d["restart"], d["rank"]): d
            for d in (json.loads(f.read_text()) for f in out.glob("*.json"))}


@needs_two
@pytest.mark.parametrize("preload", [False, True], ids=["plain", "preload"])
def test_each_worker_is_bound_to_its_gpus_node_on_every_start(tmp_path, preload):
    tree, a, b = _tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = _env({**tree, "NUMA_TEST_OUT": str(out), "NUMA_TEST_FAIL_ONCE": "1"})
    args = ["--nproc-per-node", "2", "--numa-binding", "node", "--max-restarts", "1"]
    if preload:
        args += ["--preload", "json"]
    p = _fastrun([*args, WORKER], env)
    rc, err = _finish(p)
    assert rc == 0, err[-3000:]
    recs = _records(out)
    assert set(recs) == {(0, 0), (0, 1), (1, 0), (1, 1)}, err[-2000:]  # 2 starts, 2 ranks
    for (_, rank), rec in recs.items():
        assert rec["cpus"] == [a if rank == 0 else b], rec
        forked = rec["ppid"] != p.pid  # the zygote, not the agent, is its parent
        assert forked is preload, (rec, p.pid, err[-2000:])
    assert err.count(f"NUMA binding node: 0->{a} 1->{b}") == 2, err[-3000:]


@needs_two
def test_a_container_given_one_of_two_gpus_binds_by_nvml(tmp_path):
    """The NVIDIA container runtime gave this container the host's second GPU only: sysfs
    lists both, NVML (a stand-in library, by FASTELASTIC_NVML_LIBRARY) the second: the one
    worker is bound near the second GPU (node 1). Without NVML the sysfs list puts it near
    the first, and a warning says that this may be so."""
    tree, a, b = _tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    lib = fake_nvml(tmp_path)
    env = _env({**tree, "NUMA_TEST_OUT": str(out), "FASTELASTIC_NVML_LIBRARY": lib,
                "FAKE_NVML_GPUS": nvml_gpus(("00000000:02:00.0", "GPU-2222", "NVIDIA H100"))})
    args = ["--nproc-per-node", "1", "--numa-binding", "node", WORKER]
    rc, err = _finish(_fastrun(args, env))
    assert rc == 0, err[-3000:]
    assert _records(out)[(0, 0)]["cpus"] == [b], err[-2000:]
    assert "no NVML" not in err
    for f in out.iterdir():
        f.unlink()
    rc, err = _finish(_fastrun(args, {**env, "FASTELASTIC_NVML_LIBRARY": NO_NVML}))
    assert rc == 0, err[-3000:]
    assert _records(out)[(0, 0)]["cpus"] == [a], err[-2000:]  # the host's first GPU's node
    assert err.count("which shows every GPU of the host") == 1, err[-3000:]


@needs_two
def test_function_workers_are_bound_too(tmp_path, monkeypatch):
    tree, a, b = _tree(tmp_path)
    for k, v in {**tree, "FASTELASTIC_NVML_LIBRARY": NO_NVML}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pc = start_processes("numa", os.sched_getaffinity, {0: (0,), 1: (0,)}, {0: {}, 1: {}},
                         DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), start_method="spawn",
                         numa_options="node")
    try:
        assert pc.numa_cpus == {0: frozenset({a}), 1: frozenset({b})}
        result = pc.wait(60)
    finally:
        pc.close()
    assert result is not None and not result.is_failed()
    assert result.return_values == {0: {a}, 1: {b}}


@pytest.mark.slow
@needs_two
@pytest.mark.parametrize("threads_env", [{"OMP_NUM_THREADS": "1"},
                                         {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "2"},
                                         {"OMP_NUM_THREADS": "2"}],
                         ids=["omp1", "omp1-mkl2", "omp2"])
def test_preloaded_torch_gets_a_plain_workers_thread_count(tmp_path, threads_env):
    """A worker bound to one CPU has torch's intra-op thread count of a plainly started one,
    whether it was forked by a zygote that imported torch while it could use every CPU."""
    pytest.importorskip("torch", reason="!!! torch is not installed: no thread count to compare")
    tree, a, _ = _tree(tmp_path)
    threads = {}
    forked = {}
    for preload in (False, True):
        out = tmp_path / f"out-{preload}"
        out.mkdir()
        env = _env({**tree, **threads_env, "NUMA_TEST_OUT": str(out), "NUMA_TEST_TORCH": "1"})
        args = ["--nproc-per-node", "1", "--numa-binding", "node"]
        p = _fastrun([*args, *(["--preload", "torch"] if preload else []), WORKER], env)
        rc, err = _finish(p, 300)
        assert rc == 0, err[-3000:]
        rec = _records(out)[(0, 0)]
        assert rec["cpus"] == [a]
        forked[preload] = rec["ppid"] != p.pid
        threads[preload] = rec["threads"]
    assert forked == {False: False, True: threads_env["OMP_NUM_THREADS"] == "1"}, err[-2000:]
    assert threads[True] == threads[False], threads


def test_cpu_only_host_fails_in_one_line_like_torchrun(tmp_path):
    """No GPU (this machine): exit 1 and one line; the fallback runs unbound with a warning."""
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    out.mkdir()
    env = _env({"FASTELASTIC_SYSFS_ROOT": str(empty), "FASTELASTIC_PROCFS_ROOT": str(empty),
                "NUMA_TEST_OUT": str(out), "LOGLEVEL": "WARNING"})  # fastrun's default
    rc, err = _finish(_fastrun(["--nproc-per-node", "1", "--numa-binding", "node", WORKER], env))
    assert rc == 1
    assert err.strip().splitlines() == [
        "fastrun: error: --numa-binding node: cannot bind every local rank: no NVIDIA GPU found:"
        f" no NVML ({NO_NVML}: cannot open shared object file: No such file or directory),"
        f" and nothing is bound to the nvidia driver in {empty}"
        "/bus/pci/drivers/nvidia/"]
    assert list(out.iterdir()) == []  # no worker ran
    rc, err = _finish(_fastrun(["--nproc-per-node", "1", "--numa-binding", "node", WORKER],
                               {**env, "FASTELASTIC_NUMA_FALLBACK": "1"}))
    assert rc == 0, err[-2000:]
    assert "every local rank runs without binding (fallback asked for)" in err
    assert _records(out)[(0, 0)]["cpus"] == MINE


@pytest.mark.slow
def test_cpu_only_host_with_preload_is_one_line_too(tmp_path):
    """The launch fails while the zygote still imports: it leaves quietly (no BrokenPipeError
    traceback from a zygote whose agent is gone)."""
    pytest.importorskip("torch", reason="!!! torch is not installed: no slow import to preload")
    empty = tmp_path / "empty"
    empty.mkdir()
    env = _env({"FASTELASTIC_SYSFS_ROOT": str(empty), "FASTELASTIC_PROCFS_ROOT": str(empty),
                "NUMA_TEST_OUT": str(tmp_path), "LOGLEVEL": "WARNING", "OMP_NUM_THREADS": "1"})
    rc, err = _finish(_fastrun(["--nproc-per-node", "1", "--numa-binding", "node",
                                "--preload", "torch", WORKER], env))
    assert rc == 1
    assert err.strip().splitlines() == [
        "fastrun: error: --numa-binding node: cannot bind every local rank: no NVIDIA GPU found:"
        f" no NVML ({NO_NVML}: cannot open shared object file: No such file or directory),"
        f" and nothing is bound to the nvidia driver in {empty}"
        "/bus/pci/drivers/nvidia/"]


@needs_two
def test_the_launcher_never_imports_torch(tmp_path):
    tree, _, _ = _tree(tmp_path)
    code = ("import sys, fastelastic.run as r\n"
            "try:\n    r.main(sys.argv[1:])\n"
            "finally:\n    print('TORCH', 'torch' in sys.modules)\n")
    out = tmp_path / "out"
    out.mkdir()
    env = _env({**tree, "NUMA_TEST_OUT": str(out)})
    res = subprocess.run([sys.executable, "-c", code, "--standalone", "--nproc-per-node", "2",
                          "--numa-binding", "exclusive", WORKER], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "TORCH False" in res.stdout
    assert {r["rank"]: r["cpus"] for r in _records(out).values()} == {0: [MINE[0]], 1: [MINE[1]]}


@needs_two
def test_torchs_subprocess_handler_shape_binds_from_numa_options(tmp_path, monkeypatch):
    """get_subprocess_handler(numa_options=...) as torch's contexts call it: the child is bound
    before exec (its /proc status, read by the child itself, says so)."""
    from fastelastic.multiprocessing.subprocess_handler import get_subprocess_handler

    tree, _, b = _tree(tmp_path)
    for k, v in {**tree, "FASTELASTIC_NVML_LIBRARY": NO_NVML}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    out = tmp_path / "status"
    code = ("import sys\nsys.stdout.write([l for l in open('/proc/self/status')"
            " if l.startswith('Cpus_allowed_list')][0])")
    with open(out, "w") as f:
        h = get_subprocess_handler(sys.executable, ("-c", code), {}, f.fileno(), None, 1,
                                   numa_options="node")
        assert h.proc.wait(60) == 0
    assert out.read_text().split() == ["Cpus_allowed_list:", str(b)]


def test_agent_status_carries_the_binding_for_watch():
    import types

    from fastelastic.watch.publisher import agent_status

    agent = types.SimpleNamespace(numa_binding="node: 0->0 1->1")
    assert agent_status(agent)["numa"] == "node: 0->0 1->1"
    assert "numa" not in agent_status(types.SimpleNamespace())


@needs_two
def test_fastelastic_watch_shows_each_ranks_cpus(tmp_path):
    """A real job publishing to a real watcher: its table has the NUMA column with the line."""
    import io
    import socket
    import threading

    pytest.importorskip("zmq", reason="!!! pyzmq (a fastelastic dependency) is not installed")
    from fastelastic.watch.view import watch

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    endpoint = f"tcp://127.0.0.1:{port}"
    shown = io.StringIO()
    codes: list[int] = []
    watcher = threading.Thread(target=lambda: codes.append(
        watch(endpoint, until_done=True, timeout=90, out=shown)), daemon=True)
    watcher.start()
    tree, a, b = _tree(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    env = _env({**tree, "NUMA_TEST_OUT": str(out)})
    rc, err = _finish(_fastrun(["--nproc-per-node", "2", "--numa-binding", "node",
                                "--events-endpoint", endpoint, WORKER], env))
    assert rc == 0, err[-2000:]
    watcher.join(100)
    assert codes == [0], shown.getvalue()[-2000:]
    text = shown.getvalue()
    last = text[text.rindex("NODE"):].split("\n")  # the final table
    assert "NUMA" in last[0], text[-2000:]
    assert f"node: 0->{a} 1->{b}" in last[1] and "SUCCEEDED" in last[1], text[-2000:]
