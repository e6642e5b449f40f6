"""Helpers for the checkpoint tests: the worker script and its records."""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
WORKER = HERE / "ckpt_worker.py"
REPO = HERE.parent.parent


def records(out: Path) -> list[dict]:
    path = out / "steps.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def saved(recs: list[dict], restart: int, rank: int = 0) -> dict[int, str]:
    """{step: digest} of the steps ``rank`` saved in its life ``restart``."""
    return {r["step"]: r["digest"] for r in recs
            if r["event"] == "saved" and r["restart"] == restart and r["rank"] == rank}


def restored(recs: list[dict], restart: int, rank: int = 0) -> dict:
    """The record of what ``rank`` restored at the start of its life ``restart``."""
    (r,) = [r for r in recs
            if r["event"] == "restored" and r["restart"] == restart and r["rank"] == rank]
    return r
