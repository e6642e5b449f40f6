"""Checkpoints in the agent's memory (issue 37, step 1): the stall per save, the restore.

One rank per size (the machine is shared and has 2 cores: 4 ranks of 256 MB each would measure
the neighbours), under fastrun, ``benchmarks/ckpt_bench_worker.py``:

* stall per save at 64 MB and 256 MB of float32 tensors (16 per state): the call's seconds of
  ``fastelastic.checkpoint.save`` (returns once the state is in the agent's memory) and
  ``async_save`` (the call only), beside ``torch.save`` to a local file (page cache),
  ``dcp.save`` with ``FileSystemWriter``, ``dcp.async_save`` (the call, thread stager) and one
  copy of the state into pre-faulted memory (the limit here). Rounds interleaved, same process.
  Target: ``fc.save`` <= 1.25x the copy.
* restore after a crash: the worker saves two steps and SIGKILLs itself; fastrun
  (``--max-restarts 1``) restarts it and ``fastelastic.checkpoint.load`` restores step 2 (0
  steps lost) from the agent's memory. Reported: the load call and its phases (``reply``: the
  agent's answer, which waits for its MAC check of the shard, begun when the new worker
  starts; ``map``: mapping the buffer; ``copy``: into the state's tensors), the agent's MAC
  check, the crash to the restored state (wall clock, ``--preload torch``: stop, restart, the
  zygote's fork, load), and one copy of the same bytes into pre-faulted memory. Target: load
  <= 1.5x the copy.

* disk behind training: steps that sleep 1 s (``FE_CKPT_STEP_S``), 10 per variant
  (``FE_CKPT_STEPS``), one rank: the seconds per step with no save, ``fc.save`` every step to
  memory, ``fc.save`` with a ``checkpoint_id`` every step and every 10th step (the agent writes
  the directory in DCP's format behind training; the stall per save and how many steps were
  written or skipped), and ``dcp.save`` with ``FileSystemWriter`` every step.

Run: ``FE_CKPT_TABLE=benchmarks/results/checkpoint.md python -m pytest
benchmarks/bench_checkpoint.py --benchmark-only -q -s -p no:randomly`` (a few minutes).
``FE_CKPT_ROUNDS`` (default 5) stall rounds, ``FE_CKPT_RESTORES`` (default 3) crashes per size.
Smoke (``--benchmark-disable``): 8 MB, one round, one restore.
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


def _sizes(smoke: bool) -> tuple[list[int], int]:
    return ([8], 1) if smoke else ([64, 256], int(os.environ.get("FE_CKPT_ROUNDS", "5")))


def _job(tmp: Path, mode: str, sizes: list[int], rounds: int, **extra: str) -> str:
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
                        "--nproc-per-node", "1", "--max-restarts", "1", *preload, WORKER],
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

    def run() -> None:
        _job(tmp, "stall", sizes, rounds)

    benchmark.pedantic(run, rounds=1, iterations=1)
    got = json.loads((tmp / "stall" / "stall.json").read_text())
    for mb, by in got.items():
        assert set(by) == set(METHODS)
        _RESULTS[f"stall:{mb}"] = {m: statistics.median(v) for m, v in by.items()}
        for m, v in by.items():
            benchmark.extra_info[f"{mb}MB:{m}:p50"] = statistics.median(v)


@pytest.mark.timeout(3600)
def test_restore_after_crash(benchmark, request, tmp):
    smoke = request.config.getoption("benchmark_disable", False)
    sizes, _ = _sizes(smoke)
    restores = 1 if smoke else int(os.environ.get("FE_CKPT_RESTORES", "3"))
    got: dict[int, list[dict]] = {mb: [] for mb in sizes}

    def run() -> None:
        for i in range(restores):
            for mb in sizes:  # interleaved
                name = f"restore{mb}_{i}"
                log = _job(tmp, name, [mb], 1)
                one = json.loads((tmp / name / "restore.json").read_text())
                m = re.search(r"restores step 2 on every local rank \(([0-9.]+) s to check\)",
                              log)
                assert m, log[-3000:]
                one["verify_s"] = float(m.group(1))
                got[mb].append(one)

    benchmark.pedantic(run, rounds=1, iterations=1)
    for mb, runs in got.items():
        _RESULTS[f"restore:{mb}"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for k, v in _RESULTS[f"restore:{mb}"].items():
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
             f"One rank per size, under fastrun; load average at the end {load} (a shared "
             "2-core machine: other sessions ran beside). Medians, milliseconds.", "",
             "| per rank | " + " | ".join(METHODS) + " | fc.save / memcpy |",
             "|---" * (len(METHODS) + 2) + "|"]
    for key in sorted((k for k in _RESULTS if k.startswith("stall:")),
                      key=lambda k: int(k.split(":")[1])):
        r = _RESULTS[key]
        cells = " | ".join(f"{r[m] * 1e3:.1f}" for m in METHODS)
        lines.append(f"| {key[6:]} MB | {cells} | {r['fc.save'] / r['memcpy']:.2f} |")
    lines += ["", "| per rank | load | of which: reply, map, copy | memcpy | load / memcpy | "
              "agent's MAC check | crash -> restored |", "|---|---|---|---|---|---|---|"]
    for key in sorted((k for k in _RESULTS if k.startswith("restore:")),
                      key=lambda k: int(k.split(":")[1])):
        r = _RESULTS[key]
        parts = ", ".join(f"{r[k] * 1e3:.1f}" for k in ("reply_s", "map_s", "copy_s"))
        lines.append(f"| {key[8:]} MB | {r['load_s'] * 1e3:.1f} ms | {parts} ms | "
                     f"{r['memcpy_s'] * 1e3:.1f}"
                     f" ms | {r['load_s'] / r['memcpy_s']:.2f} | {r['verify_s'] * 1e3:.0f} ms | "
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
