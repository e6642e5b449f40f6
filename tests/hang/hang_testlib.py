"""Runs fastrun on ``hang_worker.py`` and reads what its ranks did (``steps.jsonl``)."""

from __future__ import annotations

import datetime
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "hang_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def job_env(out: Path, **hang: Any) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "HANG_", "FASTELASTIC_"))}
    env["PYTHONPATH"] = str(REPO / "src")
    env["HANG_OUT"] = str(out)
    env["OMP_NUM_THREADS"] = "1"
    for k, v in hang.items():
        name = k.upper()
        env[name if name.startswith("HANG_") else f"HANG_{name}"] = str(v)
    return env


def fastrun_argv(nproc: int, hang_timeout: float | str | None, preload: bool | str,
                 nnodes: int = 1, port: int = 0, log_dir: Path | None = None,
                 max_restarts: int = 3, worker: Path = WORKER) -> list[str]:
    argv = [sys.executable, "-m", "fastelastic.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts)]
    if nnodes == 1:
        argv.append("--standalone")
    else:
        argv += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hang"]
    if hang_timeout is not None:
        argv += ["--hang-timeout", str(hang_timeout)]
    if preload:  # True: torch; a string: those modules
        argv += ["--preload", preload if isinstance(preload, str) else "torch"]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir)]
    return [*argv, str(worker)]


def run_job(out: Path, nproc: int = 2, nnodes: int = 1, hang_timeout: float | str | None = 2,
            preload: bool | str = False, timeout: float = 240, max_restarts: int = 3,
            worker: Path = WORKER, log_dir: bool = True, extra_env: dict[str, str] | None = None,
            **hang: Any) -> list[subprocess.CompletedProcess[str]]:
    """Runs ``nnodes`` launchers of ``nproc`` workers each until they end; their results."""
    env = job_env(out, **hang)
    env.update(extra_env or {})
    port = free_port()
    procs = []
    for i in range(nnodes):
        argv = fastrun_argv(nproc, hang_timeout, preload, nnodes, port,
                            out / f"logs{i}" if log_dir else None, max_restarts, worker)
        procs.append(subprocess.Popen(argv, env=env, cwd=str(out), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    results = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, text, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def records(out: Path) -> list[dict[str, Any]]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def restarts(recs: list[dict[str, Any]]) -> set[int]:
    return {r["restart"] for r in recs}


def recovery_s(recs: list[dict[str, Any]], world: int) -> float:
    """From the hang to the moment every rank of the restarted job made its first step."""
    hung = min(r["t"] for r in recs if r.get("event") == "hang")
    again: dict[int, float] = {}
    for r in recs:
        if r.get("step") == 1 and r["t"] > hung:  # the hung attempt was past step 1
            again[r["rank"]] = min(again.get(r["rank"], r["t"]), r["t"])
    assert len(again) == world, f"ranks training again: {sorted(again)} of {world}"
    return max(again.values()) - hung


_LOG = re.compile(r"^[IWEF]\d{4} (\d\d):(\d\d):(\d\d\.\d+) \d+ \S+\] (.*)$")
_STOPPED = re.compile(r"pid (\d+) in ([\d.]+)s \(exit (-?\d+|None)\)")


def _log_times(text: str, day: datetime.datetime) -> list[tuple[float, str]]:
    """(epoch seconds, message) of each fastelastic log line (glog format, local time)."""
    out = []
    for line in text.splitlines():
        m = _LOG.match(line)
        if m:
            h, mi, sec = int(m[1]), int(m[2]), float(m[3])
            t = day.replace(hour=h, minute=mi, second=0, microsecond=0).timestamp() + sec
            out.append((t, m[4]))
    return out


def phases(recs: list[dict[str, Any]], logs: list[str]) -> dict[str, Any]:
    """Where the time goes from the hang to every rank's next step, from the ranks' records
    and the launchers' INFO logs (``LOGLEVEL=INFO``): seconds after the hang at which the
    last node (or rank) reached each phase, and how long each stopped worker took to die."""
    hung = min(r["t"] for r in recs if r.get("event") == "hang")
    day = datetime.datetime.fromtimestamp(hung)
    lines = [(t - hung, msg) for text in logs for t, msg in _log_times(text, day) if t >= hung]

    def last(pred: Any, first: bool = False) -> float | None:
        ts = [t for t, msg in lines if pred(msg)]
        return (min(ts) if first else max(ts)) if ts else None

    after = [r for r in recs if r["t"] > hung]

    def rank_last(pred: Any) -> float | None:
        ts: dict[int, float] = {}
        for r in after:
            if pred(r):
                ts.setdefault(r["rank"], r["t"] - hung)
        return max(ts.values()) if ts else None

    died = [(float(m[2]), m[3]) for _, msg in lines if msg.startswith("Stopped by")
            for m in _STOPPED.finditer(msg)]
    pyspy = [float(msg.rsplit(" in ", 1)[1].split()[0]) for _, msg in lines
             if msg.startswith("hang: py-spy dump")]
    return {
        "stacks_dumped": last(lambda m: "their stacks dumped" in m),
        "verdict": last(lambda m: re.match(r"hang: rank \d", m) or "stands out" in m,
                        first=True),
        "pyspy_s": max(pyspy) if pyspy else None,
        "stop_began": last(lambda m: "Stopping worker group" in m),
        "stopped": last(lambda m: m.startswith("Stopped by")),
        "worker_death_s": sorted(d for d, _ in died),
        "worker_exits": sorted({e for _, e in died}),
        "rendezvous_done": last(lambda m: m.startswith("[default] Rendezvous complete")),
        "forked": rank_last(lambda r: r.get("event") == "start"),
        "init_process_group": rank_last(lambda r: r.get("event") == "init"),
        "step0": rank_last(lambda r: r.get("step") == 0),
        "step1": rank_last(lambda r: r.get("step") == 1),
    }
