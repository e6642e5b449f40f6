"""End to end: fastrun jobs whose workers save into the agent's memory every step and crash,
hang or run out of room; the restarted workers restore from the agent's memory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_testlib import REPO, WORKER, records, restored, saved

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _env(out: Path, **ckpt: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "CKPT_", "FASTELASTIC_"))}
    env.update(PYTHONPATH=str(REPO / "src"), CKPT_OUT=str(out), OMP_NUM_THREADS="1",
               LOGLEVEL="INFO")
    env.update(ckpt)
    return env


def _argv(nproc: int, max_restarts: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "fastelastic.run", "--standalone", "--nproc-per-node",
            str(nproc), "--max-restarts", str(max_restarts), *extra, str(WORKER)]


def _run(argv: list[str], env: dict[str, str], out: Path,
         timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, env=env, cwd=str(out), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=timeout)


def _check_restored(recs: list[dict], nproc: int, step: int) -> None:
    """Every rank's second life restored ``step``, bit for bit what it saved in its first."""
    for rank in range(nproc):
        back = restored(recs, 1, rank)
        assert back["step"] == step, (rank, back)
        assert back["digest"] == saved(recs, 0, rank)[step], rank
    done = {r["rank"] for r in recs if r["event"] == "done" and r["restart"] == 1}
    assert done == set(range(nproc)), recs[-6:]


@pytest.mark.parametrize("preload", [False, True], ids=["plain", "zygote"])
def test_crash_restart_restores_the_last_step_from_memory(tmp_path: Path, need_torch,
                                                          preload: bool) -> None:
    env = _env(tmp_path, CKPT_STEPS="8", CKPT_CRASH_AT="5", CKPT_CRASH_RANK="1")
    extra = ("--preload", "torch") if preload else ()
    r = _run(_argv(2, 1, *extra), env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    recs = records(tmp_path)
    _check_restored(recs, 2, 5)  # rank 1 died right after its save of step 5: nothing lost
    assert "this round restores step 5 on every local rank" in r.stdout
    # each restarted rank's buffer was mapped from its import of fastelastic.checkpoint on: the
    # load took that mapping (and its connection and reply) and only copied
    assert [restored(recs, 1, rank)["early"] for rank in range(2)] == [1.0, 1.0]


def test_a_rank_killed_mid_save_restores_the_step_before_on_every_rank(
        tmp_path: Path, need_torch) -> None:
    # rank 0 has step 5 whole in the agent's memory; rank 1 died writing its step 5
    env = _env(tmp_path, CKPT_STEPS="7", CKPT_CRASH_AT="5", CKPT_CRASH_RANK="1",
               CKPT_CRASH_HOW="mid_save")
    r = _run(_argv(2, 1), env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    recs = records(tmp_path)
    _check_restored(recs, 2, 4)  # one step lost, the same step on both ranks
    # rank 0's save of step 5 never returned: it waits for every local rank's shard
    assert 5 not in saved(recs, 0, 0)


def test_hang_verdict_restart_restores_from_memory(tmp_path: Path, need_torch) -> None:
    env = _env(tmp_path, CKPT_STEPS="7", CKPT_CRASH_AT="4", CKPT_CRASH_RANK="1",
               CKPT_CRASH_HOW="hang", CKPT_STEP_S="0.05")
    r = _run(_argv(2, 1, "--hang-timeout", "3"), env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    assert "hang: rank" in r.stdout, r.stdout[-4000:]
    _check_restored(records(tmp_path), 2, 4)


def test_no_room_fails_the_job_with_one_clear_line(tmp_path: Path, need_torch) -> None:
    env = _env(tmp_path, CKPT_STEPS="2", CKPT_WIDTH="2048",
               FASTELASTIC_CHECKPOINT_MEMORY_LIMIT="64M")
    r = _run(_argv(1, 0), env, tmp_path)
    assert r.returncode != 0, r.stdout[-4000:]
    lines = [x for x in r.stdout.splitlines() if "CheckpointError: local rank 0:" in x]
    assert lines, r.stdout[-4000:]
    assert "FASTELASTIC_CHECKPOINT_MEMORY_LIMIT=64.0 MiB" in lines[0]
    assert "SIGBUS" not in r.stdout and "Signal 7" not in r.stdout


def test_a_64mb_dev_shm_falls_back_to_memfd(tmp_path: Path, need_torch) -> None:
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-rm", "true"], capture_output=True)
    if unshare is None or probe.returncode != 0:
        pytest.skip(f"!!! no private mount namespace here ({probe.stderr!r}): the 64 MB /dev/shm"
                    " case is untested")
    # ~100 MB of model and Adam state per save, 200 MB double-buffered, in a 64 MB /dev/shm
    env = _env(tmp_path, CKPT_STEPS="4", CKPT_WIDTH="2048", CKPT_CRASH_AT="3")
    inner = " ".join(f"'{a}'" for a in _argv(1, 1))
    r = _run([unshare, "-rm", "sh", "-c",
              f"mount -t tmpfs -o size=64m tmpfs /dev/shm && df -m /dev/shm && exec {inner}"],
             env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    assert " 64 " in r.stdout.splitlines()[1], r.stdout[:500]  # df: the mount took
    assert "using memfd" in r.stdout, r.stdout[-4000:]
    _check_restored(records(tmp_path), 1, 3)
