"""Whole fastrun jobs whose exit status must not lie: a run that ends on a worker the agent
stopped (D-state) fails like a crash; a node that outlives the store's host ends with its own
workers' result."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from run_testlib import base_env, finish_all, launcher_cmd, start

_DSTATE_C = r"""
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
/* local rank 1 waits for a vfork child that never execs: D-state (killable) for good */
int main(void) {
    const char *r = getenv("LOCAL_RANK");
    if (r && strcmp(r, "1") == 0) {
        if (vfork() == 0) { pause(); _exit(0); }
        return 0;
    }
    sleep(120);
    return 0;
}
"""


def _dstate_binary(tmp_path: Path) -> Path:
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("!!! no C compiler: cannot build the D-state worker; its exit is untested")
    src = tmp_path / "dstate.c"
    src.write_text(_DSTATE_C)
    out = tmp_path / "dstate"
    subprocess.run([cc, "-o", str(out), str(src)], check=True)
    return out


def test_d_state_worker_fails_the_run_with_the_report(tmp_path: Path) -> None:
    """A worker in D-state past TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT (at fastrun's
    default --max-restarts): exit status 1, and the report names that rank and why."""
    binary = _dstate_binary(tmp_path)
    env = base_env(TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT="1")
    cmd = [*launcher_cmd("fastrun"), "--standalone", "--nproc-per-node", "2", "--no-python",
           "--log-dir", str(tmp_path / "logs"), str(binary)]
    [(code, out)] = finish_all([start(cmd, env)], timeout=120)
    assert code == 1, out[-4000:]
    assert "stuck in uninterruptible sleep (D-state)" in out
    report = out[out.index(" FAILED\n") - 100:]
    assert "root cause : rank 1 (local_rank 1)" in report, out[-4000:]
    assert "failure    : stuck in uninterruptible sleep (D-state) for " in report
    assert "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT=1); no restart" in report
    assert "stacks     : none taken" in report
    assert "also failed" not in report  # rank 0 was healthy: stopped, not blamed
