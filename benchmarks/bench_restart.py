"""Restart and launch latency of a real DDP job: fastrun --preload torch vs fastrun vs torchrun.

``examples/ddp_train.py`` with 4 workers (gloo), a checkpoint every step, ``--max-restarts 1``;
on the first attempt rank 1 raises at step ``FAIL_AT``. Every rank appends a line per
completed step to a progress file (``--progress``: wall time, restart count, pid, ppid), so:

* ``crash -> next step``: from the injected failure (the failing rank's own timestamp) until
  every rank of the restarted group completed step ``FAIL_AT + 1`` (restored from the
  checkpoint of step ``FAIL_AT``): stop, rendezvous, start, Python + ``import torch``,
  ``init_process_group``, load, one step.
* ``launch -> step 1``: from starting the launcher until every rank completed step 1.

Launchers, same run, rounds interleaved: ``fastrun --preload torch,torch._dynamo`` (workers
forked by the agent's zygote; DDP's constructor imports ``torch._dynamo``, a second ``import
torch`` worth of time, so a DDP job preloads it too), ``fastrun --preload torch``, ``fastrun``
(plain starts) and torchrun with
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (its best configuration here: with torch 2.13's
default a restarted gloo group reads the dead attempt's addresses from the shared agent store
and never trains again; the full run measures that once with a 60 s bound). As in
``bench_run.py``, an idle process keeps torch mapped so that every launcher's workers import
torch from a warm page cache.

Run: ``python -m pytest benchmarks/bench_restart.py --benchmark-only -q -s`` (about 4 minutes);
``FE_RESTART_TABLE=benchmarks/results/restart.md`` also writes the markdown table there.
Smoke (``--benchmark-disable``): one round of the first and the last launcher, 2 workers.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from bench_run import report_table, torch_cache_holder  # noqa: F401 - the fixture, shared

pytest.importorskip("torch", reason="!!! torch 2.13 is needed: fastrun is compared with torchrun")

REPO = Path(__file__).resolve().parent.parent
SCRIPT = str(REPO / "examples" / "ddp_train.py")
FAIL_AT = 3
FASTRUN = [sys.executable, "-m", "fastelastic.run"]
PRELOAD = "fastrun --preload torch,torch._dynamo"
IMPLS = {
    PRELOAD: ([*FASTRUN, "--preload", "torch,torch._dynamo"], {}),
    "fastrun --preload torch": ([*FASTRUN, "--preload", "torch"], {}),
    "fastrun": (FASTRUN, {}),
    "torchrun": (
        [sys.executable, "-m", "torch.distributed.run"],
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    ),
}
TORCH_DEFAULT = "torchrun (default shared store)"
KEYS = ("crash_s", "exit_s", "restart_s", "launch_s")
STALL_S = 40.0  # nothing logged for this long: the round hung
_RESULTS: dict[str, dict] = {}


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("OMP_NUM_THREADS", None)  # both launchers set 1 for several workers
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["LOGLEVEL"] = "ERROR"
    env.update(extra)
    return env


def _events(progress: Path) -> list[dict]:
    if not progress.exists():
        return []
    return [json.loads(ln) for ln in progress.read_text().splitlines() if ln.endswith("}")]


def _at(events: list[dict], restart: int, step: int) -> dict[int, float]:
    return {e["rank"]: e["t"] for e in events
            if e["event"] == "step" and e["restart"] == restart and e["step"] == step}


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()  # the launcher stops its workers on SIGTERM
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _round(impl: str, nproc: int, tmp: Path, stall_s: float = STALL_S) -> dict:
    """One job, stopped once measured; launch->step 1 and crash->next step in seconds.

    The harness polls the progress file every 5 ms and, once rank ``--fail-rank`` wrote its
    crash line, watches that worker through a pidfd to time its exit. The job is stopped
    (SIGTERM to the launcher) as soon as every rank of the restarted group completed step
    ``FAIL_AT + 1``, or when nothing new was logged for ``stall_s`` (a hang: ``None`` values).
    """
    base, extra = IMPLS.get(impl) or (IMPLS["torchrun"][0], {})
    tag = f"{impl.split()[0]}-{time.monotonic_ns()}"
    progress = tmp / f"{tag}.jsonl"
    cmd = [*base, "--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "1", SCRIPT,
           "--steps", str(FAIL_AT + 2), "--ckpt-every", "1", "--fail-at", str(FAIL_AT),
           "--ckpt-dir", str(tmp / f"ckpt-{tag}"), "--progress", str(progress)]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=_env(extra), cwd=tmp, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pidfd, t_exit, last_change, seen = -1, None, time.monotonic(), -1
    events: list[dict] = []
    try:
        while True:
            events = _events(progress)
            if len(events) != seen:
                seen, last_change = len(events), time.monotonic()
            crash = [e for e in events if e["event"] == "crash"]
            if crash and pidfd < 0 and t_exit is None:
                try:
                    pidfd = os.pidfd_open(crash[0]["pid"])
                except ProcessLookupError:
                    t_exit = time.time()  # already gone: within the last 5 ms
            if pidfd >= 0 and select.select([pidfd], [], [], 0)[0]:
                t_exit = time.time()
                os.close(pidfd)
                pidfd = -1
            if len(_at(events, 1, FAIL_AT + 1)) == nproc or proc.poll() is not None:
                break
            if time.monotonic() - last_change > stall_s:
                break
            time.sleep(0.005)
    finally:
        if pidfd >= 0:
            os.close(pidfd)
        _stop(proc)
    crash_t = next((e["t"] for e in events if e["event"] == "crash"), None)
    first, after = _at(events, 0, 1), _at(events, 1, FAIL_AT + 1)
    out = {"launch_s": max(first.values()) - t0 if len(first) == nproc else None,
           "crash_s": max(after.values()) - crash_t if crash_t and len(after) == nproc else None,
           "exit_s": t_exit - crash_t if t_exit and crash_t else None,
           "forked": len({e["ppid"] for e in events}) == 1}
    out["restart_s"] = (out["crash_s"] - out["exit_s"]
                        if out["crash_s"] is not None and out["exit_s"] is not None else None)
    return out


def _measured(impl: str, nproc: int, tmp: Path, hung: dict[str, int]) -> dict:
    """A round that completed; a hung one (gloo teardown, any launcher) is counted and rerun."""
    for _ in range(3):
        got = _round(impl, nproc, tmp)
        if got["launch_s"] is not None and got["crash_s"] is not None:
            return got
        hung[impl] = hung.get(impl, 0) + 1
    raise AssertionError(f"{impl}: 3 rounds in a row never trained after the restart: {got}")


def _stats(xs: list[float | None]) -> dict:
    got = [x for x in xs if x is not None]  # the exit watcher can miss a very early exit
    if not got:
        return {"p50": float("nan"), "min": float("nan"), "max": float("nan"), "n": 0}
    return {"p50": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


@pytest.fixture(scope="module")
def tmp():
    with tempfile.TemporaryDirectory(prefix="fe-bench-restart-") as d:
        yield Path(d)


@pytest.mark.timeout(3600)
def test_restart_and_launch(benchmark, sizes, tmp, torch_cache_holder):  # noqa: F811
    nproc, rounds = sizes["restart_nproc"], sizes["restart_rounds"]
    smoke = rounds == 1
    impls = [PRELOAD, "torchrun"] if smoke else list(IMPLS)
    hung: dict[str, int] = {}
    samples: dict[str, dict[str, list[float]]] = {
        i: {k: [] for k in KEYS} for i in impls
    }

    def run() -> None:
        for _ in range(rounds):
            for impl in impls:  # interleaved: load changes hit every launcher alike
                got = _measured(impl, nproc, tmp, hung)
                for key in KEYS:
                    samples[impl][key].append(got[key])
                if "--preload" in impl:
                    assert got["forked"], "the preloaded workers were not forked by one zygote"

    benchmark.pedantic(run, rounds=1, iterations=1)
    for impl, by in samples.items():
        _RESULTS[impl] = {k: _stats(v) for k, v in by.items()}
    if not smoke:
        _RESULTS[TORCH_DEFAULT] = _round(TORCH_DEFAULT, nproc, tmp, stall_s=60)
    _RESULTS["_meta"] = {"nproc": nproc, "rounds": rounds, "hung": hung}
    torch_ref = _RESULTS["torchrun"]
    for impl in impls:
        for key in KEYS:
            ratio = _RESULTS[impl][key]["p50"] / torch_ref[key]["p50"]
            benchmark.extra_info[f"{impl}:{key}:p50"] = _RESULTS[impl][key]["p50"]
            benchmark.extra_info[f"{impl}:{key}:ratio"] = ratio


def _table() -> str:
    meta = _RESULTS["_meta"]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    ref = _RESULTS["torchrun"]
    targets = {"crash_s": 0.1, "launch_s": 0.5}
    labels = {"crash_s": f"crash at step {FAIL_AT} -> every rank completed step {FAIL_AT + 1}",
              "exit_s": "  of which: the failing worker's own exit (Python finalisation)",
              "restart_s": "  of which: its exit -> every rank completed the next step",
              "launch_s": "launch -> every rank completed step 1"}
    out = [
        "# Restart and launch of the DDP example (benchmarks/bench_restart.py)",
        "",
        f"`examples/ddp_train.py`, {meta['nproc']} workers (gloo, CPU), checkpoint every step, "
        f"rank 1 raises at step {FAIL_AT}; {meta['rounds']} rounds per launcher, interleaved, "
        f"same run; shared 2-core machine (load average at the end: {load}). Seconds, p50 "
        "(min-max). Ratio = launcher / torchrun (with `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`).",
        "",
        "| measure | launcher | p50 s | min-max s | ratio | target | met |",
        "|---|---|---:|---:|---:|---|---|",
    ]
    for key in KEYS:
        for impl in IMPLS:
            if impl not in _RESULTS:
                continue
            s = _RESULTS[impl][key]
            ratio = s["p50"] / ref[key]["p50"]
            target = f"<= {targets[key]}" if impl == PRELOAD and key in targets else ""
            met = ("yes" if ratio <= targets[key] else "**no**") if target else ""
            out.append(f"| {labels[key]} | {impl} | {s['p50']:.2f} | {s['min']:.2f}-{s['max']:.2f}"
                       f" | {ratio:.2f} | {target} | {met} |")
    default = _RESULTS.get(TORCH_DEFAULT)
    if default is not None:
        trained = default["crash_s"] is not None
        out += ["", "torchrun with torch's default (shared agent store), one round: "
                + (f"trained again {default['crash_s']:.2f} s after the crash." if trained else
                   "the restarted group never completed a step (stopped after 60 s without "
                   "progress).")]
    hung = meta["hung"]
    out += ["", "Rounds that hung (a worker deadlocked in gloo's teardown, `~ProcessGroupGloo` "
            "joining a thread that waits for the GIL; seen with every launcher) and were rerun: "
            + (", ".join(f"{k}: {v}" for k, v in sorted(hung.items())) or "none") + "."]
    out += ["", "Node loss with and without `--preload` (4 nodes x 2 workers): "
            "`benchmarks/bench_recovery.py` (BENCHMARKS.md, \"Recovery from a lost node\")."]
    return "\n".join(out) + "\n"


@pytest.fixture(scope="module", autouse=True)
def _report(request):
    yield
    if "_meta" not in _RESULTS:
        return
    report_table(request.config, _table(), "FE_RESTART_TABLE")
