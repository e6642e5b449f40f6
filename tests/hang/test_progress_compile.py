"""The progress marks under ``torch.compile(backend="eager")``: 100 training steps compile no
more graphs, recompile no more and break no more graphs than without them (issue 26)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"


def _counters(marks: bool, mode: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(HERE / "compile_worker.py"), "1" if marks else "0",
                          mode], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", ["model", "step"])
def test_compile_sees_the_same_graphs_with_the_marks(need_torch, mode: str) -> None:
    without, with_marks = _counters(False, mode), _counters(True, mode)
    assert with_marks["steps"] == 100  # the marks were live: every optimizer step counted
    a, b = without["counters"], with_marks["counters"]
    print(f"\n{mode}: without {a}\nwith    {b}")
    assert a["stats"]["unique_graphs"] >= 1  # something was compiled
    # the same graphs (and ops in them), the same breaks with the same reasons, no recompile
    assert b["stats"] == a["stats"]
    assert b.get("graph_break", {}) == a.get("graph_break", {})
    assert b.get("recompiles", {}) == a.get("recompiles", {})
    assert b["frames"]["ok"] == a["frames"]["ok"]
    # What the marks change: with the optimizer in the compiled step, Dynamo tries once to
    # compile the optimizer's post-hook loop (a resume frame that holds no graph), fails on
    # the slot's memoryview and runs that frame eagerly from then on, the step mark with it
    # (every step was counted above). One more frame tried, no other difference.
    extra = b["frames"]["total"] - a["frames"]["total"]
    assert extra == (1 if mode == "step" else 0), (a["frames"], b["frames"])
    failed = [k for k in b.get("unimplemented", {}) if k not in a.get("unimplemented", {})]
    assert all("memoryview" in k for k in failed), failed
