"""A node that dies, freezes or is cut off, in every phase, at small scale in namespaces.

Each test runs real fastrun agents in simulated hosts (own network namespace and address),
applies the failure and checks the survivors train again (or leave the exit barrier) within
the detection window plus a margin, far below the join timeout (120 s here) and torch's
process-group timeouts; and that the survivors' logs name the lost node and why.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from netns import cluster_or_skip, wait_for
from recovery_testlib import MARGIN, PORT, REPO, WINDOW, Job, fault

MODES = ["kill", "freeze", "cut"]
WHY = {"kill": "dead: its connection closed", "freeze": "silent:", "cut": "cut: no keep-alive"}


def _within(took: float, mode: str) -> float:
    return (MARGIN if mode == "kill" else WINDOW + MARGIN)


def _train_then_fault(c, job: Job, mode: str) -> float:
    """Nodes 0, 1 and 2 train together, then node 2 gets ``mode``; returns when it did."""
    for i in range(3):
        job.start(i)
    job.wait_world({0, 1, 2}, 3)
    return fault(c, mode, 2)


def _took(got: dict, t: float) -> float:
    """Seconds from ``t`` until the last worker of ``got`` (from ``Job.wait_world``) started."""
    return max(s["t"] for s in got.values()) - t


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_node_lost_while_training(tmp_path, mode):
    with cluster_or_skip(3, "r" + mode[0]) as c:
        job = Job(c, tmp_path, "2:3")
        t = _train_then_fault(c, job, mode)
        got = job.wait_world({0, 1}, 2, after=t, timeout=WINDOW + MARGIN + 20)
        took = _took(got, t)
        assert took < _within(took, mode), f"{mode}: training again after {took:.1f}s\n{job.tail()}"
        log = job.log(0) + job.log(1)
        assert f"node {c.addr(2)} " in log and WHY[mode] in log, job.tail()
        if mode == "cut":  # the cut node notices too and stops its own workers
            assert job.wait_exit(2, 20) != 0
    assert c.leftovers() == {}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_node_lost_while_waiting_for_a_round(tmp_path, mode):
    """Node 1 holds a ticket of a forming round (3 nodes needed) when it is lost; nodes 2 and
    3 arrive; the round forms with 0, 2 and 3 within the window, not the join timeout."""
    with cluster_or_skip(4, "w" + mode[0]) as c:
        job = Job(c, tmp_path, "3:3")
        job.start(0)
        job.start(1)
        wait_for(lambda: job.tickets(0) >= 2, 30, "nodes 0 and 1 to take their tickets")
        fault(c, mode, 1)
        t = time.time()
        job.start(2)
        job.start(3)
        got = job.wait_world({0, 2, 3}, 3, timeout=WINDOW + MARGIN + 30)
        took = _took(got, t)
        assert took < WINDOW + MARGIN + 4, f"{mode}: round formed after {took:.1f}s\n{job.tail()}"
        assert not [s for s in job.starts() if s["node"] == "1"]


@pytest.mark.timeout(120)
def test_stray_ticket_is_dropped(tmp_path):
    """A client takes a ticket and never writes its record: the round completes without it."""
    with cluster_or_skip(2, "s") as c:
        job = Job(c, tmp_path, "2:2")
        job.start(0)
        wait_for(lambda: job.tickets(0) >= 1, 30, "node 0 to take its ticket")
        code = ("import sys; from datetime import timedelta; "
                "from fastelastic.store import TCPStore; "
                f"c=TCPStore('127.0.0.1', {PORT}, timeout=timedelta(seconds=60));"
                "c.add('fe.rdzv.t/0/t', 1); print('taken', flush=True); sys.stdin.read()")
        stray = c.spawn(0, [sys.executable, "-c", code], env={**os.environ,
                        "PYTHONPATH": str(REPO / "src")}, stdout=subprocess.PIPE,
                        stdin=subprocess.PIPE)
        assert stray.stdout is not None and stray.stdout.readline().strip() == b"taken"
        t = time.time()
        job.start(1)
        got = job.wait_world({0, 1}, 2, timeout=WINDOW + MARGIN + 30)
        took = _took(got, t)
        assert took < WINDOW + MARGIN + 4, f"round formed after {took:.1f}s\n{job.tail()}"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
def test_node_lost_during_exit_barrier(tmp_path, mode):
    """Nodes 0 and 1 finished and wait in the exit barrier (300 s) for node 2, which is
    lost: they leave the barrier within the window and exit 0."""
    with cluster_or_skip(3, "b" + mode[0]) as c:
        job = Job(c, tmp_path, "3:3")
        job.start(0, run_s=1.5)
        job.start(1, run_s=1.5)
        job.start(2)
        got = job.wait_world({0, 1, 2}, 3)
        for n in (0, 1):
            pid = got[n]["pid"]
            wait_for(lambda pid=pid: not os.path.exists(f"/proc/{pid}"), 30, f"worker {pid} done")
        t = fault(c, mode, 2)
        for n in (0, 1):
            assert job.wait_exit(n, WINDOW + MARGIN + 10) == 0, job.tail()
        took = time.time() - t
        assert took < _within(took, mode), f"{mode}: barrier left after {took:.1f}s\n{job.tail()}"
        assert "exit barrier early" in job.log(0), job.tail()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["freeze", "cut"])
def test_node_lost_while_training_replacement_joins(tmp_path, mode):
    """As above with --nnodes 3:3 and a replacement node started at the failure: the new node
    makes the survivors re-join at once; the lost one is dropped within the window counted
    from its last keep-alive (not from the re-join)."""
    with cluster_or_skip(4, "p" + mode[0]) as c:
        job = Job(c, tmp_path, "3:3")
        t = _train_then_fault(c, job, mode)
        job.start(3)
        got = job.wait_world({0, 1, 3}, 3, after=t, timeout=WINDOW + MARGIN + 20)
        took = _took(got, t)
        assert took < WINDOW + MARGIN, f"{mode}: training again after {took:.1f}s\n{job.tail()}"
    assert c.leftovers() == {}
