"""End to end, several nodes: two fastrun agents on this host (2 nodes x 2 ranks, loopback),
workers that save into their agent's memory every step in a gloo group, one rank killed: every
rank of both nodes restores one step, agreed across the agents in the round's store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ckpt_testlib import REPO, WORKER, records
from jobtree import end_job, start_job, wait_until

pytestmark = [pytest.mark.torch, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(out: Path, **ckpt: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "CKPT_", "FASTELASTIC_"))}
    env.update(PYTHONPATH=str(REPO / "src"), CKPT_OUT=str(out), OMP_NUM_THREADS="1",
               LOGLEVEL="INFO", CKPT_SYNC="1")
    env.update(ckpt)
    return env


def _two_nodes(out: Path, env: dict[str, str], port: int, max_restarts: int = 1,
               timeout: float = 240) -> list[tuple[int, str]]:
    procs = []
    for node in range(2):
        argv = [sys.executable, "-m", "fastelastic.run", "--nnodes", "2", "--node-rank",
                str(node), "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", f"across-{port}", "--monitor-interval", "0.1", str(WORKER)]
        procs.append(start_job(argv, env=env, cwd=str(out), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True))
    res = []
    for p in procs:
        stdout, _ = p.communicate(timeout=timeout)
        res.append((p.returncode, stdout))
    return res


def _lives(recs: list[dict], rank: int) -> list[dict]:
    """``rank``'s "restored" records, one per life, in order (a node restarted for another
    node's failure keeps its restart count: the pid tells the lives apart)."""
    return sorted((r for r in recs if r["event"] == "restored" and r["rank"] == rank),
                  key=lambda r: r["t"])


def _saved_by(recs: list[dict], pid: int) -> dict[int, str]:
    return {r["step"]: r["digest"] for r in recs if r["event"] == "saved" and r["pid"] == pid}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["after_save", "mid_save"])
def test_a_rank_killed_on_one_node_every_rank_of_both_restores_one_step(
        tmp_path: Path, need_torch, how: str) -> None:
    # after_save: rank 3 (node 1) dies right after its save of step 5; the others wait for it
    # in the step-6 barrier, so every rank holds step 5 whole, and nothing is lost.
    # mid_save: rank 3 dies writing step 6, after the barrier: node 0 holds step 6 whole on its
    # own ranks (one node's rule would restore 6 there and 5 on node 1); the agents agree on 5
    crash_at = "5" if how == "after_save" else "6"
    env = _env(tmp_path, CKPT_STEPS="9", CKPT_CRASH_AT=crash_at, CKPT_CRASH_RANK="3",
               CKPT_CRASH_HOW=how, CKPT_STEP_S="0.05")
    res = _two_nodes(tmp_path, env, _free_port())
    assert all(rc == 0 for rc, _ in res), "\n".join(out[-3000:] for _, out in res)
    recs = records(tmp_path)
    firsts = {rank: _lives(recs, rank)[0] for rank in range(4)}
    if how == "mid_save":
        assert 6 in _saved_by(recs, firsts[0]["pid"]), "node 0 never held step 6: no test"
    for rank in range(4):
        first, second = _lives(recs, rank)[:2]
        assert first["step"] is None, first
        assert second["step"] == 5, (rank, second)  # one step, the same on every rank
        assert second["digest"] == _saved_by(recs, first["pid"])[5], rank  # bit for bit
    done = {r["rank"] for r in recs if r["event"] == "done"}
    assert done == set(range(4))
    for _rc, out in res:
        assert "this round restores step 5 on every rank" in out, out[-3000:]


def _start_node(out: Path, env: dict[str, str], port: int, node: int, log: Path) -> Any:
    argv = [sys.executable, "-m", "fastelastic.run", "--nnodes", "2", "--node-rank", str(node),
            "--nproc-per-node", "2", "--max-restarts", "3", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"loss-{port}",
            "--monitor-interval", "0.1", str(WORKER)]
    return start_job(argv, env=env, cwd=str(out), stdout=log.open("w"),
                     stderr=subprocess.STDOUT)


def _listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


def _newest_by_all(recs: list[dict], pids: dict[int, int]) -> int:
    """The newest step every rank's life ``pids[rank]`` recorded as saved."""
    return min(max(r["step"] for r in recs if r["event"] == "saved" and r["pid"] == pid)
               for pid in pids.values())


@pytest.mark.timeout(900)
def test_a_node_sigkilled_and_replaced_restores_from_the_other_node_s_memory(
        tmp_path: Path, need_torch) -> None:
    """2 nodes x 2 ranks, a save every step, each node's shards copied to the other's agent;
    node 1's agent and workers SIGKILLed, a new node 1 started: every rank restores one step,
    at most one lost, node 1's ranks from node 0's memory over TCP (no disk in this job)."""
    # CKPT_LOSS_WIDTH / CKPT_LOSS_STEP_S / CKPT_LOSS_STEPS: a larger state, for the figure
    env = _env(tmp_path, CKPT_STEPS=os.environ.get("CKPT_LOSS_STEPS", "40"),
               CKPT_STEP_S=os.environ.get("CKPT_LOSS_STEP_S", "0.25"),
               CKPT_WIDTH=os.environ.get("CKPT_LOSS_WIDTH", "64"))
    port = _free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log", tmp_path / "node1b.log"]
    node0 = _start_node(tmp_path, env, port, 0, logs[0])
    # node 0 hosts the store (both nodes are on 127.0.0.1: the first to bind hosts it), so the
    # SIGKILL of node 1 below loses a node, not the rendezvous store
    assert wait_until(lambda: _listens(port) or node0.poll() is not None, 120)
    node1 = _start_node(tmp_path, env, port, 1, logs[1])

    def saved_to(step: int) -> bool:
        recs = records(tmp_path)
        return all(any(r["event"] == "saved" and r["rank"] == k and r["step"] >= step
                       for r in recs) for k in range(4))

    assert wait_until(lambda: saved_to(8), 600), logs[1].read_text()[-3000:]
    assert "checkpoint copy: port" in logs[1].read_text()
    end_job(node1)  # SIGKILL: node 1's agent, its memory and its workers
    recs = records(tmp_path)
    firsts = {k: _lives(recs, k)[0] for k in range(4)}
    newest = _newest_by_all(recs, {k: firsts[k]["pid"] for k in range(4)})
    node1 = _start_node(tmp_path, env, port, 1, logs[2])
    for p in (node0, node1):
        assert p.wait(timeout=600) == 0, "\n".join(f.read_text()[-3000:] for f in logs)
    recs = records(tmp_path)
    back = {k: _lives(recs, k)[1] for k in range(4)}
    steps = {b["step"] for b in back.values()}
    assert len(steps) == 1, back  # one step on every rank
    (step,) = steps
    assert step is not None and step >= newest - 1, (step, newest)  # at most one step lost
    for k in range(4):
        before = _saved_by(recs, firsts[k]["pid"])
        if k < 2 or step in before:  # a SIGKILLed rank may not have noted its last save
            assert back[k]["digest"] == before[step], k  # bit for bit
    fresh = logs[2].read_text()
    assert f"restores step {step} from" in fresh and "'s memory" in fresh, fresh[-3000:]
    fetched = [line.split("] ", 1)[-1] for line in fresh.splitlines() if "'s memory (" in line]
    print(f"node lost after every rank saved step {newest}; restored step {step}; "
          + "; ".join(fetched))
    assert {r["rank"] for r in recs if r["event"] == "done"} == set(range(4))
