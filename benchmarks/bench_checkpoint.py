"""Checkpoints in the agent's memory (issue 37): the stall per save, the restore.

Under fastrun, ``benchmarks/ckpt_bench_worker.py``; 4 ranks of 64 MB and of 256 MB
(``FE_CKPT_NPROC``, ``FE_CKPT_SIZES_MB``), and 2 ranks of 1 GB with ``FE_CKPT_BIG=1``:

* stall per save, float32 tensors (16 per state): ``fastelastic.checkpoint.save`` (returns once
  every local rank's state is in the agent's memory) and ``async_save`` (the call only), beside
  ``torch.save`` to a local file (page cache), ``dcp.save`` with ``FileSystemWriter``,
  ``dcp.async_save`` (the call, thread stager) and one copy of the state into pre-faulted
  memory (the limit here). Rounds interleaved, same processes; each call starts at a barrier
  and counts from the last rank's start to the last rank's end (the next step's collective
  waits for the slowest rank). ``fc.save``'s phases per rank: ``prep`` (flatten, pickle,
  layout), ``reserve`` (the agent's answer), ``map``, ``copy`` (into the mapped buffer),
  ``commit`` (the agent's answer, of which ``ranks``: its wait for the other local ranks).
  Target: ``fc.save`` <= 1.25x the copy.
* restore after a crash: every rank saves two steps, local rank 0 SIGKILLs itself; fastrun
  (``--max-restarts 1``, ``--preload torch``) restarts every rank, and each loads step 2 (0
  steps lost) from the agent's memory, from a barrier after ``init_process_group``, counted as
  the stall. Reported: the load and its phases per rank (``reply``: the agent's answer, which
  waits for its MAC check of the shards, begun when the new workers start; ``map``; ``copy``:
  into the state's tensors), the early map (a restarted worker maps its buffer from its import
  of ``fastelastic.checkpoint`` on, while its script starts), the agent's check, the crash to
  the last rank restored (wall clock: stop, restart, the zygote's fork, the process group,
  load), and a copy of the same bytes into pre-faulted memory on every rank at once (median of
  3, from a barrier). Target: load <= 1.5x the copy.

* disk behind training: steps that sleep 1 s (``FE_CKPT_STEP_S``), 10 per variant
  (``FE_CKPT_STEPS``), one rank: the seconds per step with no save, ``fc.save`` every step to
  memory, ``fc.save`` with a ``checkpoint_id`` every step and every 10th step (the agent writes
  the directory in DCP's format behind training; the stall per save and how many steps were
  written or skipped), and ``dcp.save`` with ``FileSystemWriter`` every step.

Run: ``FE_CKPT_TABLE=benchmarks/results/checkpoint.md python -m pytest
benchmarks/bench_checkpoint.py --benchmark-only -q -s -p no:randomly`` (several minutes).
``FE_CKPT_ROUNDS`` (default 5) stall rounds, ``FE_CKPT_RESTORES`` (default 3) crashes per size,
``FE_CKPT_BIG_METHODS`` the methods at 1 GB (default all). Smoke (``--benchmark-disable``):
8 MB, 2 ranks, one round, one restore.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from bench_run import report_table

pytest.importorskip("torch", reason="!!! torch 2.13 is needed: the workers save torch tensors")

REPO = Path(__file__).resolve().parent.parent
WORKER = str(REPO / "benchmarks" / "ckpt_bench_worker.py")
_RESULTS: dict[str, dict] = {}
METHODS = ("memcpy", "fc.save", "fc.async_save", "torch.save", "dcp.save", "dcp.async_save")
PHASES = ("prep", "reserve", "map", "copy", "commit", "ranks")


def _sizes(smoke: bool) -> tuple[list[int], int]:
    """(sizes in MB per rank at FE_CKPT_NPROC ranks, rounds)."""
    if smoke:
        return [8], 1
    return ([int(x) for x in os.environ.get("FE_CKPT_SIZES_MB", "64,256").split(",")],
            int(os.environ.get("FE_CKPT_ROUNDS", "5")))


def _nproc(smoke: bool) -> int:
    return 2 if smoke else int(os.environ.get("FE_CKPT_NPROC", "4"))


def _big() -> bool:
    return os.environ.get("FE_CKPT_BIG", "") == "1"


def _job(tmp: Path, mode: str, sizes: list[int], rounds: int, nproc: int = 1,
         **extra: str) -> str:
    out = tmp / mode
    out.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "FASTELASTIC_"))}
    env.update(PYTHONPATH=str(REPO / "src"), LOGLEVEL="INFO", OMP_NUM_THREADS="1",
               CKPT_BENCH_MODE=mode, CKPT_BENCH_OUT=str(out), CKPT_BENCH_DISK=str(tmp),
               CKPT_BENCH_SIZES_MB=",".join(map(str, sizes)), CKPT_BENCH_ROUNDS=str(rounds))
    env.update(extra)
    preload = ["--preload", "torch"] if mode.startswith("restore") else []
    r = subprocess.run([sys.executable, "-m", "fastelastic.run", "--standalone",
                        "--nproc-per-node", str(nproc), "--max-restarts", "1", *preload,
                        WORKER],
                       env=env, cwd=str(tmp), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-4000:]
    return r.stdout


@pytest.fixture(scope="module")
def tmp():
    with tempfile.TemporaryDirectory(prefix="fe-bench-ckpt-", dir=str(REPO)) as d:
        yield Path(d)  # on the repository's disk, not a tmpfs: torch.save and dcp write there


@pytest.mark.timeout(3600)
def test_stall_per_save(benchmark, request, tmp):
    smoke = request.config.getoption("benchmark_disable", False)
    sizes, rounds = _sizes(smoke)
    jobs = [("stall", sizes, _nproc(smoke), {})]
    if _big() and not smoke:
        jobs.append(("stall_big", [1024], 2, {"CKPT_BENCH_ONLY": os.environ.get(
            "FE_CKPT_BIG_METHODS", ",".join(METHODS))}))
    got: dict = {}

    def run() -> None:
        for mode, mbs, nproc, extra in jobs:
            _job(tmp, mode, mbs, rounds, nproc, CKPT_BENCH_MODE="stall", **extra)
            for mb, r in json.loads((tmp / mode / "stall.json").read_text()).items():
                got[(mb, nproc)] = r

    benchmark.pedantic(run, rounds=1, iterations=1)
    for (mb, nproc), r in got.items():
        by = r["stall"]
        assert {"memcpy", "fc.save"} <= set(by), by
        res = {m: statistics.median(v) for m, v in by.items()}
        res["nproc"] = nproc
        # each phase: the median over rounds of the slowest rank's
        res["phases"] = {k: statistics.median(max(x[k] for x in rnd) for rnd in r["phases"])
                         for k in r["phases"][0][0]}
        _RESULTS[f"stall:{mb}"] = res
        for m in by:
            benchmark.extra_info[f"{mb}MB:{m}:p50"] = res[m]


@pytest.mark.timeout(3600)
def test_restore_after_crash(benchmark, request, tmp):
    smoke = request.config.getoption("benchmark_disable", False)
    sizes, _ = _sizes(smoke)
    runs_of = [(mb, _nproc(smoke)) for mb in sizes] + ([(1024, 2)] if _big() and not smoke
                                                       else [])
    restores = 1 if smoke else int(os.environ.get("FE_CKPT_RESTORES", "3"))
    got: dict[int, list[dict]] = {mb: [] for mb, _n in runs_of}

    def run() -> None:
        for i in range(restores):
            for mb, nproc in runs_of:  # interleaved
                name = f"restore{mb}_{i}"
                log = _job(tmp, name, [mb], 1, nproc)
                r = json.loads((tmp / name / "restore.json").read_text())
                m = re.search(r"restores step 2 on every local rank \(([0-9.]+) s to check\)",
                              log)
                assert m, log[-3000:]
                ranks = r["ranks"]
                assert all(x["early_used"] == 1.0 for x in ranks), ranks
                one = {"nproc": nproc, "verify_s": float(m.group(1)), "memcpy_s": r["memcpy_s"],
                       "load_s": r["load_stall_s"],
                       "crash_to_restored_s": max(x["crash_to_restored_s"] for x in ranks),
                       "early_s": max(x["early_s"] for x in ranks)}
                for k in ("reply_s", "map_s", "copy_s"):  # the slowest rank's
                    one[k] = max(x[k] for x in ranks)
                got[mb].append(one)

    benchmark.pedantic(run, rounds=1, iterations=1)
    for mb, runs in got.items():
        res = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        res["ratio"] = statistics.median(r["load_s"] / r["memcpy_s"] for r in runs)
        _RESULTS[f"restore:{mb}"] = res
        for k, v in res.items():
            benchmark.extra_info[f"{mb}MB:{k}"] = v


@pytest.mark.timeout(3600)
def test_disk_behind_training(benchmark, request, tmp):
    smoke = request.config.getoption("benchmark_disable", False)
    sizes = [8] if smoke else [int(x) for x in os.environ.get("FE_CKPT_DISK_MB", "64").split(",")]
    extra = {"CKPT_BENCH_STEP_S": "0.1" if smoke else os.environ.get("FE_CKPT_STEP_S", "1"),
             "CKPT_BENCH_STEPS": "2" if smoke else os.environ.get("FE_CKPT_STEPS", "10")}

    def run() -> None:
        _job(tmp, "disk", sizes, 1, **extra)

    benchmark.pedantic(run, rounds=1, iterations=1)
    got = json.loads((tmp / "disk" / "disk.json").read_text())
    for mb, by in got.items():
        assert by["fc.save+disk"]["written"] >= 1, by  # the newest step at least lands
        _RESULTS[f"disk:{mb}"] = by
        for how, x in by.items():
            benchmark.extra_info[f"{mb}MB:{how}:step_s"] = x["step_s"]


def _table() -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    lines = ["# Checkpoints in the agent's memory (benchmarks/bench_checkpoint.py)", "",
             f"Under fastrun; load average at the end {load} (a shared 2-core machine: other "
             "sessions ran beside). Each call from a barrier of every rank, to the last rank's "
             "end; medians over the rounds, milliseconds.", "",
             "| per rank | ranks | " + " | ".join(METHODS) + " | fc.save / memcpy |",
             "|---" * (len(METHODS) + 3) + "|"]
    stalls = sorted((k for k in _RESULTS if k.startswith("stall:")),
                    key=lambda k: int(k.split(":")[1]))
    for key in stalls:
        r = _RESULTS[key]
        cells = " | ".join(f"{r[m] * 1e3:.1f}" if m in r else "" for m in METHODS)
        lines.append(f"| {key[6:]} MB | {r['nproc']} | {cells} | "
                     f"{r['fc.save'] / r['memcpy']:.2f} |")
    lines += ["", "fc.save's phases, the slowest rank's (median over the rounds), ms:", "",
              "| per rank | " + " | ".join(PHASES) + " |", "|---" * (len(PHASES) + 1) + "|"]
    for key in stalls:
        ph = _RESULTS[key]["phases"]
        lines.append(f"| {key[6:]} MB | " + " | ".join(
            f"{ph[k + '_s'] * 1e3:.1f}" for k in PHASES) + " |")
    lines += ["", "| per rank | ranks | load | reply, map, copy (slowest rank) | memcpy | "
              "load / memcpy | early map | agent's check | crash -> restored |",
              "|---|---|---|---|---|---|---|---|---|"]
    for key in sorted((k for k in _RESULTS if k.startswith("restore:")),
                      key=lambda k: int(k.split(":")[1])):
        r = _RESULTS[key]
        parts = ", ".join(f"{r[k] * 1e3:.1f}" for k in ("reply_s", "map_s", "copy_s"))
        lines.append(f"| {key[8:]} MB | {r['nproc']:.0f} | {r['load_s'] * 1e3:.1f} ms | {parts} ms"
                     f" | {r['memcpy_s'] * 1e3:.1f} ms | {r['ratio']:.2f} | "
                     f"{r['early_s'] * 1e3:.0f} ms | {r['verify_s'] * 1e3:.0f} ms | "
                     f"{r['crash_to_restored_s']:.2f} s |")
    disk = sorted((k for k in _RESULTS if k.startswith("disk:")), key=lambda k: int(k[5:]))
    if disk:
        lines += ["", "| per rank | saves | s per step | of the no-save rate | stall per save "
                  "(median) | written / skipped | wait after the last |",
                  "|---|---|---|---|---|---|---|"]
    for key in disk:
        r = _RESULTS[key]
        base = r["none"]["step_s"]
        for how, x in r.items():
            stall = (f"{statistics.median(x['stalls']) * 1e3:.1f} ms" if x["stalls"] else "")
            wr = f"{x['written']} / {x['skipped']}" if "disk" in how else ""
            drain = f"{x['drain_s']:.2f} s" if "disk" in how else ""
            lines.append(f"| {key[5:]} MB | {how} | {x['step_s']:.3f} | {base / x['step_s']:.1%}"
                         f" | {stall} | {wr} | {drain} |")
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    if _RESULTS:
        report_table(request.config, _table(), "FE_CKPT_TABLE")
