"""fastrun under the schedulers people launch with, each beside torchrun in one test.

* Kubeflow (Trainer v2's torch runtime; a PyTorchJob, with and without an elastic policy): every pod
  runs the launcher with no flags and only the ``PET_*`` variables the operator sets. Two pods
  are two launcher processes on loopback; the workers must get the values torchrun gives them.
* Slurm: ``srun ... fastrun --signals-to-handle ...,SIGUSR1`` in a simulated ``SLURM_*``
  environment, and ``SIGUSR1`` sent to the launcher as Slurm's ``--signal=USR1@<time>``
  warning does: the signal reaches the workers, then they are stopped (SIGKILL after
  ``--shutdown-timeout``), as torchrun does. Without SIGUSR1 in the list the launcher dies of it.
  Two differences are pinned here (README, "Moving from torchrun"): fastrun's workers do not
  outlive a launcher killed by the signal, and a SIGTERM during the stop SIGKILLs them at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from run_testlib import (
    DUMP,
    HERE,
    base_env,
    env_diff,
    finish_all,
    free_port,
    launcher_cmd,
    read_dumps,
    start,
    wait_listening,
)

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("need_torch")]

# Differ between two runs whatever the launcher: the test's dump directory, the error file
# (under a fresh temporary directory of each run) and, where the rendezvous picks it when the
# round completes, the workers' store port (static: it is PET_MASTER_PORT, compared below).
PER_RUN = frozenset({"DUMP_DIR", "TORCHELASTIC_ERROR_FILE"})


def _pod_env(case: str, node: int, master_port: int, rdzv_port: int) -> dict[str, str]:
    """What the operator puts in pod ``node``'s environment (no launcher flags at all)."""
    # kubeflow/training-operator sets PYTHONUNBUFFERED=0 in every PyTorchJob container
    env = {"PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": str(node),
           "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(master_port),
           "PYTHONUNBUFFERED": "0"}
    if case == "trainer-v2":
        env["PET_NNODES"] = "2"
    elif case == "pytorchjob":  # Master + Worker replicas: the pod's own rank and world size too
        env.update(PET_NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
                   WORLD_SIZE="4", RANK=str(node))
    else:  # elasticPolicy: minReplicas 1, maxReplicas 2, rdzvBackend c10d, maxRestarts 3
        env.update(PET_NNODES="1:2", PET_RDZV_BACKEND="c10d",
                   PET_RDZV_ENDPOINT=f"127.0.0.1:{rdzv_port}", PET_RDZV_ID="pytorchjob-7f3c",
                   PET_RDZV_CONF="join_timeout=120", PET_MAX_RESTARTS="3")
    return env


def _run_pods(which: str, case: str, out: Path) -> tuple[dict[int, dict], dict[str, str]]:
    """Runs the two pods; returns the workers' dumps and {port: placeholder} for the run."""
    master_port, rdzv_port = free_port(), free_port()
    procs = []
    for node in (0, 1):
        env = base_env(DUMP_DIR=str(out), **_pod_env(case, node, master_port, rdzv_port))
        procs.append(start([*launcher_cmd(which), str(DUMP)], env))
        if node == 0:
            # In the cluster only pod 0 owns the endpoint's address and hosts the store there;
            # on loopback both pods could: pod 1 starts once pod 0 listens.
            wait_listening(rdzv_port if case == "pytorchjob-elastic" else master_port, procs[0])
    for rc, output in finish_all(procs, timeout=120):
        assert rc == 0, f"{which} ({case}): exit {rc}\n{output[-3000:]}"
    return read_dumps(out), {str(master_port): "<master port>", str(rdzv_port): "<rdzv port>"}


def _normalise(env: dict[str, str], ports: dict[str, str]) -> dict[str, str]:
    """The run's ports (the test's choice, fresh per run) replaced by what they stand for."""
    out = {}
    for k, v in env.items():
        host, _, port = v.rpartition(":")
        out[k] = ports.get(v, f"{host}:{ports[port]}" if host and port in ports else v)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", ["trainer-v2", "pytorchjob", "pytorchjob-elastic"])
def test_kubeflow_pods_with_only_pet_variables_match_torchrun(tmp_path, case):
    got = {}
    for which in ("torchrun", "fastrun"):
        (tmp_path / which).mkdir()
        dumps, ports = _run_pods(which, case, tmp_path / which)
        assert sorted(dumps) == [0, 1, 2, 3]
        got[which] = {r: _normalise(d["env"], ports) for r, d in dumps.items()}
    ignore = set(PER_RUN)
    if case == "pytorchjob-elastic":
        # c10d ignores the node rank (both launchers warn so). Which pod's agent becomes group 0
        # is the join order for fastrun and the pid order for torchrun, both arbitrary: the
        # PET_NODE_RANK a worker inherits from its pod is checked per pod below instead.
        ignore |= {"PET_NODE_RANK", "MASTER_PORT"}  # MASTER_PORT: picked as the round completes
    for rank in range(4):
        diff = env_diff(got["torchrun"][rank], got["fastrun"][rank], ignore)
        assert not diff, f"rank {rank}: worker env differs (torchrun, fastrun): {diff}"
    for which, envs in got.items():
        pods = {(e["PET_NODE_RANK"], e["GROUP_RANK"]) for e in envs.values()}
        # each pod's two workers are one group; the two pods, groups 0 and 1
        assert len(pods) == 2 and {p for p, _ in pods} == {g for _, g in pods} == {"0", "1"}, pods
        e = envs[0]
        assert (e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["GROUP_WORLD_SIZE"]) == ("4", "2", "2")
        if case != "pytorchjob-elastic":  # static: node rank = group rank, store on the master
            assert all(e["PET_NODE_RANK"] == e["GROUP_RANK"] for e in envs.values()), which
            assert e["MASTER_PORT"] == "<master port>" and e["TORCHELASTIC_RUN_ID"] == "none"
        else:
            assert e["TORCHELASTIC_RUN_ID"] == "pytorchjob-7f3c"
            assert e["TORCHELASTIC_MAX_RESTARTS"] == "3"


# What srun puts in the environment of a one-node, one-task step (the launcher is the task).
SLURM_ENV = {
    "SLURM_JOB_ID": "4242", "SLURM_JOBID": "4242", "SLURM_JOB_NAME": "train",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "0", "SLURM_NTASKS": "1", "SLURM_NPROCS": "1", "SLURM_NNODES": "1",
    "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "localhost", "SLURM_NODELIST": "localhost",
    "SLURM_STEP_NODELIST": "localhost", "SLURMD_NODENAME": "localhost",
    "SLURM_TASKS_PER_NODE": "1", "SLURM_CPUS_ON_NODE": "2", "SLURM_CLUSTER_NAME": "test",
}
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT = 3


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _gone_within(pids: list[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _wait_for(what: str, cond, proc: subprocess.Popen[str], log: Path) -> None:
    deadline = time.monotonic() + 90
    while not cond():
        assert proc.poll() is None, f"exited before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} in 90 s:\n{log.read_text()[-3000:]}"
        time.sleep(0.05)


def _slurm_step(which: str, out: Path, mode: str, signals: str | None,
                shutdown_timeout: int | None = SHUTDOWN_TIMEOUT, then: int | None = None,
                linger: float = 10) -> dict:
    """One step: the launcher as srun's task; SIGUSR1 to it once both workers are ready, and
    signal ``then`` once both workers have seen SIGUSR1. ``gone``: no worker is left ``linger``
    seconds after the launcher's exit."""
    port = free_port()
    env = base_env(DUMP_DIR=str(out), SIGNAL_WORKER_MODE=mode, **SLURM_ENV)
    args = ["--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", SLURM_ENV["SLURM_JOB_ID"]]
    if shutdown_timeout is not None:  # None: torch's default (30 s)
        args += ["--shutdown-timeout", str(shutdown_timeout)]
    if signals is not None:
        args += ["--signals-to-handle", signals]
    # output to a file, not a pipe: workers that outlive the launcher would hold a pipe open
    log = out.parent / f"{which}.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([*launcher_cmd(which), *args, str(HERE / "signal_worker.py")],
                                env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    pids: list[int] = []
    try:
        # each worker's handlers are installed
        _wait_for("workers ready", lambda: len(list(out.glob("*.json"))) == 2, proc, log)
        dumps = read_dumps(out)
        pids = [d["pid"] for d in dumps.values()]
        sent = time.monotonic()
        proc.send_signal(signal.SIGUSR1)  # what slurmstepd sends the task at the warning time
        if then is not None:
            _wait_for("SIGUSR1 in both workers", lambda: len(list(out.glob("usr1.*"))) == 2,
                      proc, log)
            proc.send_signal(then)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{which} still running 60 s after SIGUSR1") from None
        took = time.monotonic() - sent
        alive_at_exit = [p for p in pids if _alive(p)]
        gone = _gone_within(pids, linger)
    finally:
        for p in pids:  # torchrun leaves its workers behind when it dies of the signal
            if _alive(p):
                os.kill(p, signal.SIGKILL)
    output = log.read_text()
    usr1, term = (sorted(int(p.name.split(".")[1]) for p in out.glob(f"{m}.*"))
                  for m in ("usr1", "term"))
    return {"rc": rc, "output": output, "took": took, "usr1": usr1, "term": term, "dumps": dumps,
            "alive_at_exit": alive_at_exit, "gone": gone}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["exit", "stay"])
def test_slurm_warning_signal_reaches_the_workers_then_they_are_stopped(tmp_path, mode):
    got = {}
    for which in ("torchrun", "fastrun"):
        (tmp_path / which).mkdir()
        # "exit" at torch's default shutdown timeout (30 s): the workers leave on their own
        timeout = SHUTDOWN_TIMEOUT if mode == "stay" else None
        got[which] = r = _slurm_step(which, tmp_path / which, mode, SIGNALS, timeout)
        assert r["usr1"] == [0, 1], (which, r["output"][-3000:])  # forwarded to every worker
        assert r["alive_at_exit"] == [], (which, r["output"][-3000:])  # stopped before exit
        if mode == "stay":  # the handler returned: SIGKILL once the shutdown timeout passed
            assert SHUTDOWN_TIMEOUT * 0.9 <= r["took"] < SHUTDOWN_TIMEOUT + 30, (which, r["took"])
        else:  # no waiting for the timeout once the workers are gone
            assert r["took"] < 30, (which, r["took"])
        assert r["term"] == []
    # the job ends as one stopped by a signal: torchrun exits 1 with a SignalException
    # traceback, fastrun 128 + 10 with one line (README, "Differences from torch")
    assert got["torchrun"]["rc"] == 1 and "SignalException" in got["torchrun"]["output"]
    assert got["fastrun"]["rc"] == 128 + signal.SIGUSR1
    assert "fastrun: received SIGUSR1; workers were stopped" in got["fastrun"]["output"]
    assert "Traceback" not in got["fastrun"]["output"]
    for rank in (0, 1):  # the workers saw the same environment, SLURM_* passed through
        te, fe = (got[w]["dumps"][rank]["env"] for w in ("torchrun", "fastrun"))
        assert {k: fe[k] for k in SLURM_ENV} == SLURM_ENV
        diff = env_diff(te, fe, PER_RUN | {"MASTER_PORT"})
        assert not diff, f"rank {rank}: worker env differs (torchrun, fastrun): {diff}"
        assert fe["TORCHELASTIC_SIGNALS_TO_HANDLE"] == SIGNALS


@pytest.mark.timeout(200)
def test_slurm_warning_signal_not_handled_kills_the_launcher(tmp_path):
    got = {}
    for which in ("torchrun", "fastrun"):
        (tmp_path / which).mkdir()
        # torchrun's orphans are expected to stay: 2 s shows it without waiting 10
        got[which] = r = _slurm_step(which, tmp_path / which, "stay", None,
                                     linger=2 if which == "torchrun" else 10)
        # torch's default list has no SIGUSR1: the launcher dies of it, workers never see it
        assert r["rc"] == -signal.SIGUSR1 and r["usr1"] == [], (which, r["output"][-3000:])
    # the difference: torchrun's workers outlive it (orphans, killed above by the test);
    # fastrun's guardian SIGKILLs them when their agent dies
    assert got["torchrun"]["alive_at_exit"] and not got["torchrun"]["gone"]
    assert got["fastrun"]["gone"]


@pytest.mark.timeout(200)
def test_slurm_time_limit_sigterm_during_the_warning_stop(tmp_path):
    """Slurm's SIGTERM at the time limit, when the warning came less than the shutdown timeout
    before it: the workers are still being stopped (they handled SIGUSR1 and went on)."""
    got = {}
    for which in ("torchrun", "fastrun"):
        (tmp_path / which).mkdir()
        got[which] = r = _slurm_step(which, tmp_path / which, "stay", SIGNALS,
                                     shutdown_timeout=60, then=signal.SIGTERM)
        assert r["usr1"] == [0, 1] and r["alive_at_exit"] == [], (which, r["output"][-3000:])
        assert r["took"] < 30, (which, r["took"])  # neither waits out the 60 s
    # the difference (README): torchrun stops again with SIGTERM, so the workers' SIGTERM
    # handlers run; fastrun takes a second signal as "stop now" and SIGKILLs them
    assert got["torchrun"]["term"] == [0, 1] and got["torchrun"]["rc"] == 1
    assert got["fastrun"]["term"] == [] and got["fastrun"]["rc"] == 128 + signal.SIGTERM
    assert "SIGTERM during shutdown: SIGKILLing the workers now" in got["fastrun"]["output"]
