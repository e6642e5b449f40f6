"""fastrun under the training frameworks people launch with, each beside torchrun in one test.

* PyTorch Lightning's ``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` under
  ``fastrun --nproc-per-node 2``, plain and with ``--preload torch,pytorch_lightning``: Lightning
  must find the same elastic environment, train the same steps to bit-identical weights, and the
  workers must get the same environment as under ``torchrun --nproc-per-node 2``.
* ``accelerate launch`` runs torch's launcher in its own process (``torch.distributed.run``), so
  fastrun cannot replace it; our rendezvous and store can, through the ``torchrun.handlers``
  plugin: ``--rdzv_backend fastelastic`` must run the same job as torch's ``c10d`` backend, on
  one machine with a restart and on two machines.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from run_testlib import (
    HERE,
    base_env,
    env_diff,
    finish_all,
    free_port,
    module_available,
    read_dumps,
    run_launcher,
    start,
    wait_listening,
)

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("need_torch")]

# Differ between any two runs of one command, with either launcher: the workers' store port
# (picked when the rendezvous completes), the error file (under a fresh temporary directory) and
# the test's own dump directory. TORCHELASTIC_RUN_ID is left in when the command names the run.
PER_RUN = frozenset({"DUMP_DIR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE"})
LIGHTNING_FIELDS = ("cluster_environment", "creates_processes_externally", "global_rank",
                    "local_rank", "node_rank", "world_size", "global_step", "backend", "weight",
                    "bias")


def _need(module: str, pin: str) -> None:
    if not module_available(module):
        pytest.skip(f"!!! {module} is not installed (CI installs {pin}): untested here")


def _lightning_run(which: str, out: Path, extra: list[str]) -> dict[int, dict]:
    out.mkdir()
    r = run_launcher(which, ["--nproc-per-node", "2", *extra, str(HERE / "lightning_job.py")],
                     base_env(DUMP_DIR=str(out)), timeout=150)
    assert r.returncode == 0, f"{which} {extra}: exit {r.returncode}\n{r.stderr[-3000:]}"
    return read_dumps(out)


@pytest.fixture(scope="module")
def lightning_under_torchrun(tmp_path_factory) -> dict[int, dict]:
    _need("pytorch_lightning", "pytorch-lightning==2.6.6")
    return _lightning_run("torchrun", tmp_path_factory.mktemp("lightning") / "torchrun", [])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("preload", [False, True], ids=["plain", "preload"])
def test_lightning_ddp_trains_as_under_torchrun(tmp_path, lightning_under_torchrun, preload):
    theirs = lightning_under_torchrun
    extra = ["--preload", "torch,pytorch_lightning"] if preload else []
    ours = _lightning_run("fastrun", tmp_path / "fastrun", extra)
    assert sorted(ours) == sorted(theirs) == [0, 1]
    for rank in (0, 1):
        # Lightning recognised torchelastic (it neither forks nor spawns ranks of its own)
        assert ours[rank]["cluster_environment"] == "TorchElasticEnvironment"
        assert ours[rank]["creates_processes_externally"] is True
        assert ours[rank]["global_rank"] == rank and ours[rank]["global_step"] == 4
        got = {k: ours[rank][k] for k in LIGHTNING_FIELDS}
        want = {k: theirs[rank][k] for k in LIGHTNING_FIELDS}
        assert got == want  # same ranks, same steps, bit-identical weights after the all-reduces
        assert ours[rank]["preloaded"] is preload  # forked by the zygote, no plain fallback
        # no --rdzv-id: each run's id is a fresh UUID (test_run_env checks its form)
        diff = env_diff(theirs[rank]["env"], ours[rank]["env"], PER_RUN | {"TORCHELASTIC_RUN_ID"})
        assert not diff, f"rank {rank}: worker env differs (torchrun, fastrun): {diff}"


def _accelerate(args: list[str]) -> list[str]:
    # accelerate's console script is accelerate.commands.accelerate_cli; its launch module runs
    # the same launch_command with this interpreter
    return [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--mixed_precision", "no", "--dynamo_backend", "no", *args,
            str(HERE / "accelerate_job.py")]


def _check_accelerate_pair(got: dict[str, dict[int, dict]], world: int, restarts: str) -> None:
    theirs, ours = got["c10d"], got["fastelastic"]
    assert sorted(ours) == sorted(theirs) == list(range(world))
    for rank in range(world):
        for dumps in (theirs, ours):
            assert dumps[rank]["sum"] == world * (world + 1) / 2
            assert dumps[rank]["num_processes"] == world
            assert dumps[rank]["distributed_type"] == "DistributedType.MULTI_CPU"
            assert dumps[rank]["env"]["TORCHELASTIC_RESTART_COUNT"] == restarts
        assert ours[rank]["local_process_index"] == theirs[rank]["local_process_index"]
        diff = env_diff(theirs[rank]["env"], ours[rank]["env"], PER_RUN)
        assert not diff, f"rank {rank}: worker env differs (c10d, fastelastic): {diff}"


@pytest.mark.timeout(300)
def test_accelerate_launch_with_the_fastelastic_rendezvous_and_a_restart(tmp_path):
    _need("accelerate", "accelerate==1.15.0")
    got = {}
    for backend in ("c10d", "fastelastic"):
        out = tmp_path / backend
        out.mkdir()
        env = base_env(DUMP_DIR=str(out), FAIL_ON_FIRST_ATTEMPT="1", LOGLEVEL="INFO")
        cmd = _accelerate(["--num_processes", "2", "--main_process_port", "0",
                           "--max_restarts", "1", "--monitor_interval", "0.1",
                           "--rdzv_backend", backend])
        [(rc, output)] = finish_all([start(cmd, env)], timeout=150)
        assert rc == 0, f"{backend}: exit {rc}\n{output[-3000:]}"
        # torch's launcher ran the backend we named ("fastelastic" exists only as our plugin:
        # without it torch fails with "not registered"), and restarted the group once
        assert f"rdzv_backend             : {backend}" in output
        got[backend] = read_dumps(out)
    _check_accelerate_pair(got, world=2, restarts="1")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_accelerate_launch_two_machines_with_the_fastelastic_rendezvous(tmp_path):
    _need("accelerate", "accelerate==1.15.0")
    got = {}
    for backend in ("c10d", "fastelastic"):
        out = tmp_path / backend
        out.mkdir()
        env = base_env(DUMP_DIR=str(out))
        port = free_port()
        procs = []
        for rank in (0, 1):
            procs.append(start(_accelerate(
                ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip",
                 "127.0.0.1", "--main_process_port", str(port), "--num_processes", "4",
                 "--rdzv_backend", backend]), env))
            if rank == 0:
                # On a cluster only machine 0 has the endpoint's address and hosts the store;
                # here it is every machine's, so machine 1 must not start first and host it
                # (machine 0's accelerate then finds its port taken and gives up).
                wait_listening(port, procs[0])
        for rc, output in finish_all(procs, timeout=150):
            assert rc == 0, f"{backend}: exit {rc}\n{output[-3000:]}"
        got[backend] = read_dumps(out)
    _check_accelerate_pair(got, world=4, restarts="0")
    for dumps in got.values():  # two machines of two processes each
        assert sorted(d["env"]["GROUP_RANK"] for d in dumps.values()) == ["0", "0", "1", "1"]

