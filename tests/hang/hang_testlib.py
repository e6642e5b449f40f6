"""Runs fastrun on ``hang_worker.py`` and reads what its ranks did (``steps.jsonl``)."""

from __future__ import annotations

import json
import os
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


def fastrun_argv(nproc: int, hang_timeout: float | str | None, preload: bool,
                 nnodes: int = 1, port: int = 0, log_dir: Path | None = None,
                 max_restarts: int = 3) -> list[str]:
    argv = [sys.executable, "-m", "fastelastic.run", "--nproc-per-node", str(nproc),
            "--max-restarts", str(max_restarts)]
    if nnodes == 1:
        argv.append("--standalone")
    else:
        argv += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "hang"]
    if hang_timeout is not None:
        argv += ["--hang-timeout", str(hang_timeout)]
    if preload:
        argv += ["--preload", "torch"]
    if log_dir is not None:
        argv += ["--log-dir", str(log_dir)]
    return [*argv, str(WORKER)]


def run_job(out: Path, nproc: int = 2, nnodes: int = 1, hang_timeout: float | str | None = 2,
            preload: bool = False, timeout: float = 240, max_restarts: int = 3,
            **hang: Any) -> list[subprocess.CompletedProcess[str]]:
    """Runs ``nnodes`` launchers of ``nproc`` workers each until they end; their results."""
    env = job_env(out, **hang)
    port = free_port()
    procs = []
    for i in range(nnodes):
        argv = fastrun_argv(nproc, hang_timeout, preload, nnodes, port, out / f"logs{i}",
                            max_restarts)
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
