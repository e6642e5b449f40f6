"""The agent's memory owner in this process, real worker processes saving into it with torch.

Each "life" is a round, as an agent's start or restart of its workers is: the owner fixes the
round's restore step, then a worker process (tests/checkpoint/ckpt_worker.py) loads, trains
with Adam and saves every step.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from ckpt_testlib import REPO, WORKER, records, restored, saved

from fastelastic.checkpoint import _format
from fastelastic.checkpoint._owner import SEALED, MemoryOwner

pytestmark = pytest.mark.torch


def _env(out: Path, restart: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "CKPT_"))}
    env.pop(_room_limit := "FASTELASTIC_CHECKPOINT_MEMORY_LIMIT", None)
    env.update(CKPT_OUT=str(out), RANK="0", LOCAL_RANK="0",
               TORCHELASTIC_RESTART_COUNT=str(restart),
               PYTHONPATH=os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]))
    env.update(extra)
    assert _room_limit not in env or _room_limit in extra
    return env


def _life(owner: MemoryOwner, out: Path, restart: int, **extra: str
          ) -> subprocess.CompletedProcess[str]:
    envs = {0: _env(out, restart, **extra)}
    owner.start_round(1)
    return subprocess.run([sys.executable, str(WORKER)], env=envs[0], capture_output=True,
                          text=True, timeout=600)


@pytest.fixture
def owner():
    o = MemoryOwner(token=b"t" * 32)
    yield o
    o.close()


def test_round_trip_of_model_and_adam_state_that_grows(tmp_path: Path, need_torch, owner) -> None:
    r = _life(owner, tmp_path, 0, CKPT_STEPS="3", CKPT_WIDTH="256")
    assert r.returncode == 0, r.stderr[-3000:]
    # step 0 was saved before Adam's first step (no state): step 1 needed a larger buffer
    r = _life(owner, tmp_path, 1, CKPT_STEPS="5", CKPT_WIDTH="256")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    first, back = saved(recs, 0), restored(recs, 1)
    assert sorted(first) == [0, 1, 2, 3]
    assert back["step"] == 3 and back["digest"] == first[3]  # bit for bit
    assert owner.last_restore is not None and owner.last_restore["step"] == 3
    # the restored run trains on as the first would have: steps 4, 5 from step 3's state
    assert sorted(saved(recs, 1)) == [4, 5]


def test_round_trip_of_async_save(tmp_path: Path, need_torch, owner) -> None:
    r = _life(owner, tmp_path, 0, CKPT_STEPS="2", CKPT_ASYNC="1")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _life(owner, tmp_path, 1, CKPT_STEPS="2", CKPT_ASYNC="1")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    assert restored(recs, 1)["digest"] == saved(recs, 0)[2]


def test_killed_mid_save_restores_the_step_before(tmp_path: Path, need_torch, owner) -> None:
    r = _life(owner, tmp_path, 0, CKPT_STEPS="6", CKPT_CRASH_AT="4", CKPT_CRASH_HOW="mid_save")
    assert r.returncode == -signal.SIGKILL, r.stderr[-3000:]
    # step 4's buffer is half written: reserved, never committed
    assert sorted((s, st) for st, s, _g, _m in owner.buffers(0)) == [(3, SEALED), (4, "writing")]
    r = _life(owner, tmp_path, 1, CKPT_STEPS="6")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    back = restored(recs, 1)
    assert back["step"] == 3 and back["digest"] == saved(recs, 0)[3]


@pytest.mark.parametrize("where", ["skeleton", "tensor"])
def test_corrupted_shard_is_rejected_without_unpickling(tmp_path: Path, need_torch, owner,
                                                        where: str) -> None:
    r = _life(owner, tmp_path, 0, CKPT_STEPS="2", CKPT_TRIPWIRE_AT="2")
    assert r.returncode == 0, r.stderr[-3000:]
    owner.wait_sealed()
    (mm,) = [m for st, s, _g, m in owner.buffers(0) if s == 2 and st == SEALED]
    assert mm is not None
    h = _format.unpack_header(mm, len(mm))
    pos = h.skel_off + h.skel_len // 2 if where == "skeleton" else h.data_off + h.data_len // 2
    mm[pos] ^= 0x40  # a stray write after the seal
    r = _life(owner, tmp_path, 1, CKPT_STEPS="3")
    assert r.returncode == 0, r.stderr[-3000:]
    recs = records(tmp_path)
    back = restored(recs, 1)
    assert back["step"] == 1 and back["digest"] == saved(recs, 0)[1]
    assert not (tmp_path / "tripped.0").exists()  # step 2's pickle never ran
    assert saved(recs, 1)[2] == saved(recs, 0)[2]  # step 2 trained again from step 1


def test_tripwire_does_unpickle_when_the_shard_is_whole(tmp_path: Path, need_torch,
                                                       owner) -> None:
    r = _life(owner, tmp_path, 0, CKPT_STEPS="2", CKPT_TRIPWIRE_AT="2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _life(owner, tmp_path, 1, CKPT_STEPS="2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert restored(records(tmp_path), 1)["step"] == 2
    assert (tmp_path / "tripped.0").exists()  # the check above can fail


def test_no_room_is_one_clear_line(tmp_path: Path, need_torch) -> None:
    o = MemoryOwner(limit=64 << 20)
    try:
        # width 2048: ~50 MB of model and Adam state, ~100 MB double-buffered
        r = _life(o, tmp_path, 0, CKPT_STEPS="2", CKPT_WIDTH="2048")
    finally:
        o.close()
    assert r.returncode == 1, r.stderr[-3000:]  # an exception, not a signal (no SIGBUS)
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("fastelastic.checkpoint._owner.CheckpointError: local rank 0: "), last
    assert "FASTELASTIC_CHECKPOINT_MEMORY_LIMIT=64.0 MiB" in last and "raise" in last, last


def test_outside_fastrun_save_says_so(tmp_path: Path, need_torch) -> None:
    env = _env(tmp_path, 0)
    env.pop("FASTELASTIC_CHECKPOINT_SOCKET", None)
    r = subprocess.run([sys.executable, str(WORKER)], env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 1
    assert "run the script under fastrun" in r.stderr.strip().splitlines()[-1]
