"""Helpers for the fastrun tests: launch fastrun/torchrun, free ports, read worker dumps."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
DUMP = HERE / "dump_env.py"
REPO = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("OMP_NUM_THREADS", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(extra)
    return env


def launcher_cmd(which: str) -> list[str]:
    if which == "fastrun":
        return [sys.executable, "-m", "fastelastic.run"]
    exe = shutil.which("torchrun")
    if exe is None:
        return [sys.executable, "-m", "torch.distributed.run"]
    return [sys.executable, exe]


def run_launcher(which: str, args: list[str], env: dict[str, str], cwd: str | None = None,
                 timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*launcher_cmd(which), *args], env=env, cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )


def read_dumps(d: Path) -> dict[int, dict]:
    out = {}
    for p in d.glob("*.json"):
        data = json.loads(p.read_text())
        out[int(data["env"]["RANK"])] = data
    return out


def torch_available() -> bool:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True
