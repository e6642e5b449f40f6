"""Whole fastrun jobs whose exit status must not lie: a run that ends on a worker the agent
stopped (D-state) fails like a crash; a node that outlives the store's host ends with its own
workers' result."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from run_testlib import (
    base_env,
    finish_all,
    free_port,
    launcher_cmd,
    start,
    torch_available,
    wait_listening,
)

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


FINISH = Path(__file__).resolve().parent / "finish_worker.py"
_KEEPS = "the rendezvous store's host finished its work and its store has gone"


def _events(out: Path) -> list[dict]:
    path = out / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _host_then_peer(tmp_path: Path, extra: list[str], env_extra: dict[str, str],
                    host_s: float, peer_s: float) -> tuple[list[tuple[int, str]], float]:
    """Node 0 (started first: it hosts the c10d store) and node 1 of one job; their workers
    train together, then on alone ``host_s`` / ``peer_s`` more seconds. Returns both
    launchers' (exit status, output) and the time node 0's launcher ended."""
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"fin-{port}", *extra,
            str(FINISH)]
    procs = []
    for i, extra_s in enumerate((host_s, peer_s)):
        env = base_env(FINISH_OUT=str(tmp_path), FINISH_EXTRA_S=str(extra_s), **env_extra)
        procs.append(start([*launcher_cmd("fastrun"), *args], env))
        if i == 0:
            wait_listening(port, procs[0])  # node 0 hosts the store
    ended: list[float] = []
    waiter = threading.Thread(target=lambda: (procs[0].wait(120), ended.append(time.time())))
    waiter.start()
    results = finish_all(procs, timeout=120)
    waiter.join(10)
    return results, ended[0]


@pytest.mark.parametrize("workers", ["plain", "torch"])
def test_store_host_finishes_first_both_nodes_succeed(tmp_path: Path, workers: str) -> None:
    """``--exit-barrier-timeout 0.5``; node 0 hosts the store and its workers finish 3 s
    before node 1's: node 0's barrier times out and it ends, its store with it; node 1 keeps
    monitoring its workers (no re-forming, no restart), says so in one line, and both exit 0."""
    env_extra = {}
    peer_s = 3.0
    if workers == "torch":
        if not torch_available():
            pytest.skip("!!! torch is not installed: the gloo variant is untested")
        env_extra = {"FINISH_TORCH": "1"}
        peer_s = 6.0  # a torch worker's exit after its last event takes 1-2 s more
    results, host_ended = _host_then_peer(tmp_path, ["--exit-barrier-timeout", "0.5"],
                                          env_extra, host_s=0, peer_s=peer_s)
    (code0, out0), (code1, out1) = results
    assert (code0, code1) == (0, 0), (out0[-3000:], out1[-3000:])
    assert out1.count(_KEEPS) == 1, out1[-3000:]
    assert _KEEPS not in out0
    # (node 0 logs its barrier's timeout with the store's exception, as torch does)
    assert "Traceback" not in out1 and "WARNING" not in out1, out1[-3000:]
    assert "keep-alive" not in out0 + out1, (out0[-3000:], out1[-3000:])
    assert [line for line in out1.splitlines() if line[:1] in "WEF" and "] " in line
            and "OMP_NUM_THREADS" not in line and "****" not in line
            and line.rstrip()[-1:] != "]"] == [next(x for x in out1.splitlines()
                                                   if _KEEPS in x)], out1[-3000:]
    events = _events(tmp_path)
    assert {e["restart"] for e in events} == {0}
    assert sorted(e["rank"] for e in events if e["event"] == "start") == [0, 1, 2, 3]
    done = {e["rank"]: e["t"] for e in events if e["event"] == "done"}
    assert sorted(done) == [0, 1, 2, 3]
    late = [t for t in done.values() if t > host_ended]
    assert len(late) == 2, (done, host_ended)  # node 1's two workers outlived node 0


def test_store_host_finishes_first_at_torch_defaults(tmp_path: Path) -> None:
    """At torch's defaults (exit barrier 300 s) the host waits in its barrier for node 1:
    both exit 0, and nobody's store goes early (no line about it)."""
    results, _ = _host_then_peer(tmp_path, [], {}, host_s=0, peer_s=3)
    (code0, out0), (code1, out1) = results
    assert (code0, code1) == (0, 0), (out0[-3000:], out1[-3000:])
    assert _KEEPS not in out0 + out1
    assert len([e for e in _events(tmp_path) if e["event"] == "done"]) == 4


def test_store_host_lost_is_not_a_finished_host(tmp_path: Path) -> None:
    """The store's host SIGKILLed while both nodes train (its workers did not finish): node 1
    does not take it for a finished host; it fails as before (one endpoint: no failover)."""
    port = free_port()
    args = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"lost-{port}",
            "--exit-barrier-timeout", "0.5", str(FINISH)]
    env = base_env(FINISH_OUT=str(tmp_path), FINISH_EXTRA_S="30")
    host = start([*launcher_cmd("fastrun"), *args], env)
    wait_listening(port, host)
    peer = start([*launcher_cmd("fastrun"), *args], env)
    try:
        deadline = time.monotonic() + 60
        while len([e for e in _events(tmp_path) if e["event"] == "trained"]) < 2:
            assert time.monotonic() < deadline, "the job did not start training"
            time.sleep(0.05)
        host.kill()  # the launcher, with its agent and the store it hosts
        [(code, out)] = finish_all([peer], timeout=90)
    finally:
        for p in (host, peer):
            if p.poll() is None:
                p.kill()
            p.wait(30)
    assert code != 0, out[-3000:]
    assert _KEEPS not in out
