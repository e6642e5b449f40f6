"""``fastrun`` as PID 1 of its own PID namespace, as a container's entry point runs (a
Kubernetes pod: ``unshare --pid --fork --mount-proc``): it reaps the orphans it inherits,
forwards signals to the launcher and exits with its status."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from run_testlib import HERE, base_env, launcher_cmd

WORKER = HERE / "orphan_worker.py"


def _unshare() -> list[str]:
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("!!! needs root and unshare (util-linux) for a PID namespace")
    return ["unshare", "--pid", "--fork", "--mount-proc"]


def _start(tmp_path: Path, **env: str) -> subprocess.Popen[str]:
    args = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.1", str(WORKER)]
    return subprocess.Popen([*_unshare(), *launcher_cmd("fastrun"), *args],
                            env=base_env(DUMP_DIR=str(tmp_path), **env),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _zombies(tmp_path: Path) -> dict[str, list[str]]:
    return {p.name: p.read_text().splitlines() for p in sorted(tmp_path.glob("zombies.*"))}


@pytest.mark.timeout(120)
def test_as_pid_1_the_launcher_leaves_no_zombie_and_exits_with_the_job_s_status(tmp_path):
    p = _start(tmp_path)
    out, _ = p.communicate(timeout=90)
    assert p.returncode == 0, out
    z = _zombies(tmp_path)
    assert set(z) == {"zombies.0", "zombies.1"}, (z, out)
    # orphans are PID 1's (a rank that already finished may be the launcher's, for now)
    orphans = {k: [x for x in v if x.split()[1] == "1"] for k, v in z.items()}
    assert orphans == {"zombies.0": [], "zombies.1": []}, (z, out)


@pytest.mark.timeout(120)
def test_the_check_sees_the_zombies_of_a_pid_1_that_does_not_reap(tmp_path):
    """The same job with the reaper off (``FASTELASTIC_PID1_INIT=0``): the orphans stay
    zombies of PID 1, the launcher, which never waits for them."""
    p = _start(tmp_path, FASTELASTIC_PID1_INIT="0")
    out, _ = p.communicate(timeout=90)
    assert p.returncode == 0, out
    z = _zombies(tmp_path)
    # each worker lists the namespace's zombies: its own 3 orphans at least (and maybe a
    # rank that finished first, not yet reaped by the launcher: PID 1 here too)
    assert len(z) == 2 and all(sum(x.split()[1:] == ["1", "sleep"] for x in lines) >= 3
                               for lines in z.values()), (z, out)


def _pid1(unshare: subprocess.Popen[str]) -> int:
    """The global pid of the namespace's PID 1 (unshare's only child)."""
    path = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        kids = path.read_text().split()
        if kids:
            return int(kids[0])
        time.sleep(0.02)
    raise AssertionError("unshare started no child")


@pytest.mark.timeout(120)
def test_as_pid_1_a_sigterm_reaches_the_launcher(tmp_path):
    """A pod's stop: SIGTERM to PID 1. It reaches the launcher, which stops its workers and
    exits 128+15, as it does outside a container."""
    p = _start(tmp_path, WORKER_SLEEP="60")
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("zombies.*"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the workers are up (their report written)
    assert len(list(tmp_path.glob("zombies.*"))) == 2, p.poll()
    t = time.monotonic()
    os.kill(_pid1(p), signal.SIGTERM)
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM, out
    assert time.monotonic() - t < 30, out  # not the workers' 60 s sleep
    assert "SIGTERM" in out or "Signal 15" in out or "signal 15" in out, out
