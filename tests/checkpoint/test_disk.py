"""The disk copy behind training: fastrun jobs whose workers save with a checkpoint_id; the
agent writes the steps in torch DCP's format and torch's own ``dcp.load`` with a
``FileSystemReader`` reads them (in this process, without fastelastic's reader)."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
from ckpt_testlib import records, restored, saved
from jobtree import start_job
from test_ckpt_job import _argv, _run
from test_ckpt_job import _env as _job_env

import fastelastic.checkpoint as fc
from fastelastic.checkpoint import _disk

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _env(out: Path, **ckpt: str) -> dict[str, str]:
    return _job_env(out, CKPT_DISK=str(out / "ckpt"), **ckpt)


def _torch_reads(path: Path, rank: int, width: int = 64) -> tuple[str, dict]:
    """(digest, extra) of what torch's own dcp.load reads from ``path`` into ``rank``'s model
    and Adam (the worker's digest, computed the same way)."""
    import torch
    import torch.distributed.checkpoint as dcp

    torch.manual_seed(1234)  # other weights than the saved ones: the load must replace them
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()  # Adam's state exists, to be overwritten
    sd = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": {"step": -1}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... single process"
        dcp.load(sd, storage_reader=dcp.FileSystemReader(str(path)))
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for k in sorted(st):
            h.update(st[k].detach().contiguous().numpy().tobytes())
    return h.hexdigest(), sd["extra"]


def _disk_events(recs: list[dict], restart: int, rank: int = 0) -> dict[int, str]:
    return {r["step"]: r["status"] for r in recs
            if r["event"] == "disk" and r["restart"] == restart and r["rank"] == rank}


def test_torch_dcp_load_reads_every_step_the_agent_wrote(tmp_path: Path, need_torch) -> None:
    env = _env(tmp_path, CKPT_STEPS="3", CKPT_DISK_WAIT="each")
    r = _run(_argv(2, 0), env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    recs = records(tmp_path)
    root = tmp_path / "ckpt"
    for rank in (0, 1):
        assert _disk_events(recs, 0, rank) == {1: "written", 2: "written", 3: "written"}, recs
    assert fc.latest(root) == (3, str(root / "step-3"))
    # one directory per step, as DCP's FileSystemWriter lays it out; nothing temporary left
    assert sorted(os.listdir(root)) == ["step-1", "step-2", "step-3"]
    assert sorted(os.listdir(root / "step-3")) == [".fastelastic-step", ".metadata",
                                                   "__0_0.distcp", "__1_0.distcp"]
    for step in (1, 2, 3):
        # both ranks saved the same keys: the metadata keeps one copy (the higher rank's), as
        # DCP keeps one of a key saved by several ranks
        dig, extra = _torch_reads(root / f"step-{step}", 1)
        assert dig == saved(recs, 0, 1)[step], step
        assert extra == {"step": step}


def test_the_agent_sigkilled_mid_write_leaves_the_last_whole_step(tmp_path: Path,
                                                                  need_torch) -> None:
    # steps 1 and 2 are small and written; step 3 carries 24 MB written at 2 MB/s
    env = _env(tmp_path, CKPT_STEPS="3", CKPT_DISK_WAIT="each", CKPT_BALLAST="3:24",
               FASTELASTIC_CHECKPOINT_WRITE_RATE="2M")
    root = tmp_path / "ckpt"
    proc = start_job(_argv(1, 0), env=env, cwd=str(tmp_path), stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    partial = None
    while partial is None and time.monotonic() < deadline and proc.poll() is None:
        for tmp in root.glob(f"{_disk.TMP_PREFIX}step-3-*"):
            f = tmp / "__0_0.distcp"
            if f.exists() and f.stat().st_size > 0:
                partial = f
        if partial is None:
            time.sleep(0.05)  # polling the file system; bounded by the deadline
    assert partial is not None, (proc.poll(), records(tmp_path)[-4:])
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    recs = records(tmp_path)
    assert _disk_events(recs, 0) == {1: "written", 2: "written"}
    assert 3 in saved(recs, 0)  # in the agent's memory, half on disk when the agent died
    assert not (root / "step-3").exists()
    assert fc.latest(root) == (2, str(root / "step-2"))
    dig, extra = _torch_reads(root / "step-2", 0)
    assert dig == saved(recs, 0)[2] and extra == {"step": 2}


def test_an_older_step_is_skipped_when_a_newer_one_needs_its_memory(tmp_path: Path,
                                                                    need_torch) -> None:
    # step 1's 24 MB at 2 MB/s is still being written when step 3 needs its buffer: step 1 is
    # given up. Step 2 is written unless step 3 was whole before the write of step 2 began
    # (step 2's seal and step 3's save race): then step 2 is skipped too. Step 3 is written.
    env = _env(tmp_path, CKPT_STEPS="3", CKPT_DISK_WAIT="end", CKPT_BALLAST="1:24",
               FASTELASTIC_CHECKPOINT_WRITE_RATE="2M")
    r = _run(_argv(1, 0), env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    recs = records(tmp_path)
    got = _disk_events(recs, 0)
    assert got[1] == "skipped" and got[3] == "written" and got[2] in ("written", "skipped"), got
    root = tmp_path / "ckpt"
    # the directories that appear are the steps written, each whole
    assert sorted(os.listdir(root)) == [f"step-{s}" for s in (1, 2, 3) if got[s] == "written"]
    assert fc.latest(root) == (3, str(root / "step-3"))
    assert "checkpoint disk: step 1 skipped" in r.stdout
    assert _torch_reads(root / "step-3", 0)[0] == saved(recs, 0)[3]


@pytest.mark.parametrize("how", ["crash", "crash-zygote", "hang"])
def test_a_failure_s_step_is_written_behind_the_restart(tmp_path: Path, need_torch,
                                                        how: str) -> None:
    # step 3 (24 MB at 1 MB/s: ~16 s to disk after its first 8 MB) is saved, then its rank is
    # SIGKILLed or hangs (the verdict after 3 s): the agent writes step 3 while the workers
    # restart and restore it from memory
    hang = how == "hang"
    env = _env(tmp_path, CKPT_STEPS="5", CKPT_CRASH_AT="3", CKPT_BALLAST="3:24",
               CKPT_DISK_WAIT="end", FASTELASTIC_CHECKPOINT_WRITE_RATE="1M",
               CKPT_CRASH_HOW="hang" if hang else "after_save", CKPT_STEP_S="0.05")
    extra = (("--preload", "torch") if how == "crash-zygote" else
             ("--hang-timeout", "3") if hang else ())
    r = _run(_argv(1, 1, *extra), env, tmp_path)
    assert r.returncode == 0, r.stdout[-4000:]
    recs = records(tmp_path)
    back = restored(recs, 1)
    assert back["step"] == 3 and back["digest"] == saved(recs, 0)[3]
    # the restart did not wait for the write: step 3 was not on disk when it restored it
    assert back["latest"] is None or back["latest"] < 3, back
    (landed,) = [x for x in recs if x["event"] == "disk" and x["restart"] == 1 and x["step"] == 3]
    assert landed["status"] == "written" and landed["t"] > back["t"]
    root = tmp_path / "ckpt"
    dig, extra_items = _torch_reads(root / "step-3", 0)
    assert dig == saved(recs, 0)[3] and extra_items == {"step": 3}
    assert fc.latest(root) == (5, str(root / "step-5"))


def test_sigterm_s_exit_waits_for_the_write_within_its_budget(tmp_path: Path,
                                                              need_torch) -> None:
    # the worker hangs after saving step 2 (24 MB at 4 MB/s); SIGTERM mid-write: the agent ends
    # the workers and its exit waits for the write (default budget, 300 s)
    env = _env(tmp_path, CKPT_STEPS="2", CKPT_CRASH_AT="2", CKPT_CRASH_HOW="hang",
               CKPT_BALLAST="2:24", FASTELASTIC_CHECKPOINT_WRITE_RATE="4M")
    root = tmp_path / "ckpt"
    log = tmp_path / "fastrun.log"
    with open(log, "wb") as f:
        proc = start_job(_argv(1, 0), env=env, cwd=str(tmp_path), stdout=f,
                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and proc.poll() is None
               and not any(root.glob(f"{_disk.TMP_PREFIX}step-2-*/__0_0.distcp"))):
            time.sleep(0.05)  # polling the file system; bounded by the deadline
        assert proc.poll() is None, log.read_text()[-4000:]
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
    out = log.read_text()
    assert rc != 0, out[-4000:]  # a job ended by SIGTERM never exits 0
    assert "the exit waits up to 300 s" in out, out[-4000:]
    assert "checkpoint disk: step 2 written" in out, out[-4000:]
    assert fc.latest(root) == (2, str(root / "step-2"))
    recs = records(tmp_path)
    assert _torch_reads(root / "step-2", 0)[0] == saved(recs, 0)[2]


def test_the_exit_s_budget_bounds_the_wait(tmp_path: Path, need_torch) -> None:
    # the same, with --checkpoint-drain-timeout 1: 24 MB at 1 MB/s cannot land; step 1 stays
    env = _env(tmp_path, CKPT_STEPS="2", CKPT_CRASH_AT="2", CKPT_CRASH_HOW="hang",
               CKPT_BALLAST="2:24", CKPT_DISK_WAIT="each",
               FASTELASTIC_CHECKPOINT_WRITE_RATE="1M")
    root = tmp_path / "ckpt"
    log = tmp_path / "fastrun.log"
    with open(log, "wb") as f:
        proc = start_job(_argv(1, 0, "--checkpoint-drain-timeout", "1"), env=env,
                         cwd=str(tmp_path), stdout=f, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and proc.poll() is None
               and not any(root.glob(f"{_disk.TMP_PREFIX}step-2-*/__0_0.distcp"))):
            time.sleep(0.05)  # polling the file system; bounded by the deadline
        assert proc.poll() is None, log.read_text()[-4000:]
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)
        rc = proc.wait(timeout=120)
        took = time.monotonic() - t0
    out = log.read_text()
    assert rc != 0
    assert "step 2 not written: the exit's budget of 1 s ran out" in out, out[-4000:]
    assert took < 20, took  # not the 24 s the write needs
    assert fc.latest(root) == (1, str(root / "step-1"))
    assert not list(root.glob(f"{_disk.TMP_PREFIX}*")), os.listdir(root)


def test_a_bad_drain_timeout_is_one_line_and_status_2(tmp_path: Path) -> None:
    r = _run(_argv(1, 0, "--checkpoint-drain-timeout", "soon"), _env(tmp_path), tmp_path,
             timeout=60)
    assert r.returncode == 2, r.stdout
    assert "--checkpoint-drain-timeout 'soon': expected seconds" in r.stdout, r.stdout


def test_the_metadata_joins_ranks_with_keys_of_their_own(tmp_path: Path, need_torch) -> None:
    # two ranks' plans laid out as the workers lay them out, written as the agent writes them:
    # torch's dcp.load reads the shared key and each rank's own key (DCP keeps one item per key:
    # per-rank state needs per-rank keys)
    import torch
    import torch.distributed.checkpoint as dcp

    from fastelastic.checkpoint import _dcp, _format, _worker

    def lay_out(sd: dict, rank: int) -> tuple[bytearray, dict]:
        tensors: list = []
        ids: dict = {}
        _worker._flatten(sd, tensors, ids)
        plan = _dcp.plan(sd, tensors, ids, rank, 2, str(tmp_path / "step-7"))
        entries = [[str(t.dtype), list(t.shape), 0, t.numel() * t.element_size()]
                   for t in tensors]
        off = 0
        for e in entries:
            e[2] = off
            off = _format.align(off + e[3])
        end = plan.place(off, entries)
        buf = bytearray(end)
        for t, e in zip(tensors, entries, strict=True):
            buf[e[2]:e[2] + e[3]] = t.contiguous().view(torch.uint8).numpy().tobytes()
        buf[plan.blob_off:plan.blob_off + len(plan.blob)] = plan.blob
        return buf, plan.table()

    shared = torch.arange(5000, dtype=torch.float64)
    files, metas = {}, {}
    for rank in (0, 1):
        # tiny and empty tensors (their records made from zeros, or with no data), and a
        # second layout of the same state (the records reused)
        sd = {"w": shared, f"rng.{rank}": torch.full((3000,), rank, dtype=torch.int32),
              f"loader.{rank}": {"pos": 10 + rank}, "empty": torch.zeros(0),
              f"tiny.{rank}": torch.tensor([rank + 0.5, 0.0, -1.0])}
        lay_out(sd, rank)
        buf, table = lay_out(sd, rank)
        files[rank] = [(buf, a, n) for a, n in table["file"]]
        metas[rank] = tuple(bytes(buf[a:a + n]) for a, n in table["meta"])
    _disk.write_step(7, str(tmp_path / "step-7"), 2, table["version"], files, metas,
                     lambda n: None)
    assert fc.latest(tmp_path) == (7, str(tmp_path / "step-7"))
    back = {"w": torch.zeros(5000, dtype=torch.float64),
            "rng.0": torch.zeros(3000, dtype=torch.int32),
            "rng.1": torch.zeros(3000, dtype=torch.int32),
            "loader.0": {"pos": -1}, "loader.1": {"pos": -1}, "empty": torch.ones(0),
            "tiny.0": torch.ones(3), "tiny.1": torch.ones(3)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(back, storage_reader=dcp.FileSystemReader(str(tmp_path / "step-7")))
    assert torch.equal(back["w"], shared)
    assert back["rng.0"].eq(0).all() and back["rng.1"].eq(1).all()
    assert back["loader.0"] == {"pos": 10} and back["loader.1"] == {"pos": 11}
    assert back["tiny.0"].tolist() == [0.5, 0.0, -1.0] and back["tiny.1"].tolist() == [1.5, 0, -1]


def test_a_dead_agent_s_temporary_directory_goes_at_the_next_write(tmp_path: Path) -> None:
    # a pid that is surely not alive: a child we started and reaped
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                           capture_output=True, text=True, check=True)
    dead = int(child.stdout)
    stale = tmp_path / f"{_disk.TMP_PREFIX}step-1-1-{dead}"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    live = tmp_path / f"{_disk.TMP_PREFIX}step-1-1-{os.getppid()}"  # an agent still writing
    live.mkdir()
    meta = (b"", b"", b"")
    _disk.write_step(2, str(tmp_path / "step-2"), 1, "1.0.0", {0: [(b"abc", 0, 3)]},
                     {0: meta}, lambda n: None)
    assert not stale.exists() and live.exists()
    assert (tmp_path / "step-2" / "__0_0.distcp").read_bytes() == b"abc"
    assert fc.latest(tmp_path) == (2, str(tmp_path / "step-2"))
    assert fc.latest(tmp_path / "step-2") == (2, str(tmp_path / "step-2"))
    assert fc.latest(tmp_path / "nothing-here") is None
