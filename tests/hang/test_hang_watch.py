"""Two agents' hang checks against a real store, with slots written as workers write them:
a verdict needs every node, one claim writes the report, the culprit's node retries and the
other restarts, progress before the verdict withdraws a node's report, and nothing touches a
rank (signal or ptrace) before the verdict."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest

from fastelastic.agent.server import _hang
from fastelastic.agent.server._hang import HangAction, HangWatch
from fastelastic.progress import _worker as w
from fastelastic.store import PrefixStore, TCPStore


@pytest.fixture
def store():
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=10))
    yield PrefixStore("round1", server)
    server.shutdown_server()


class Node:
    """One agent's HangWatch and its two workers' slots (written as the workers would)."""

    def __init__(self, group_rank: int, timeout_s: float = 1.0) -> None:
        self.group_rank = group_rank
        self.watch = HangWatch(timeout_s)
        envs: dict[int, dict[str, str]] = {0: {}, 1: {}}
        self.watch.prepare(envs)
        self.views = {}
        self.maps = []
        for lr, env in envs.items():
            with open(env[w.PROGRESS_ENV], "r+b") as f:
                mm = mmap.mmap(f.fileno(), w.SLOT_SIZE)
            self.maps.append(mm)
            self.views[lr] = memoryview(mm).cast("q")
        ranks = {lr: group_rank * 2 + lr for lr in envs}
        self.watch.started({lr: 10_000 + r for lr, r in ranks.items()}, ranks)
        for lr, r in ranks.items():
            self.views[lr][w.F_PID] = 10_000 + r

    def step(self, lr: int, n: int = 1, ago_s: float = 0.0) -> None:
        v = self.views[lr]
        v[w.F_STEPS] += n
        v[w.F_LAST_NS] = time.monotonic_ns() - int(ago_s * 1e9)

    def check(self, store, log_dir: Path, restarts_left: int = 1):
        return self.watch.check(store, self.group_rank, 2, str(log_dir),
                                restarts_left=restarts_left)

    def close(self) -> None:
        for v in self.views.values():
            v.release()
        for mm in self.maps:
            mm.close()
        self.watch.close()


@pytest.fixture
def nodes():
    made = [Node(0), Node(1)]
    yield made
    for n in made:
        n.close()


def test_verdict_needs_every_node_and_names_the_laggard(store, nodes, tmp_path) -> None:
    a, b = nodes
    for n in nodes:
        n.step(0, 20, ago_s=2)
        n.step(1, 20, ago_s=2)
    b.step(1, 0, ago_s=2)
    b.views[1][w.F_STEPS] = 19  # rank 3 fell behind
    a.step(0, 1)  # node 0 made progress just now: not stalled
    assert a.check(store, tmp_path / "a") is None
    assert b.check(store, tmp_path / "b") is None  # stalled, reported; node 0 has not
    assert b.watch.pending and not a.watch.pending
    a.views[0][w.F_LAST_NS] -= int(2e9)  # now node 0 stalls too: the job is hung
    assert a.check(store, tmp_path / "a") is None  # its frames sent; node 1's awaited
    assert a.watch.pending
    assert b.check(store, tmp_path / "b") is HangAction.RETRY  # node 1 spends a restart
    assert a.check(store, tmp_path / "a") is HangAction.RESTART  # rank 3 is not node 0's
    assert not a.watch.pending and not b.watch.pending
    reports = list(tmp_path.glob("*/hang_1/report.txt"))
    assert len(reports) == 1  # one claim
    text = reports[0].read_text()
    assert text.startswith("rank 3 (host ") and "fell behind: 19 steps" in text
    assert (tmp_path / "a" / "hang_1" / "rank0.stacks.txt").exists()


def test_progress_before_the_verdict_withdraws(store, nodes, tmp_path) -> None:
    a, b = nodes
    for n in nodes:
        n.step(0, 5, ago_s=2)
        n.step(1, 5, ago_s=2)
    b.step(0, 0, ago_s=0)  # node 1 still moving
    assert a.check(store, tmp_path) is None and a.watch.pending
    assert store.check(["fastelastic/hang/node/0"])
    a.step(1)  # node 0 moves again before node 1 stalled
    assert a.check(store, tmp_path) is None and not a.watch.pending
    assert not store.check(["fastelastic/hang/node/0"])  # its report withdrawn
    b.views[0][w.F_LAST_NS] -= int(2e9)
    assert b.check(store, tmp_path) is None  # node 0's report is gone: no verdict


def test_a_peer_that_never_sends_its_frames_delays_the_verdict_by_a_bound(
        store, nodes, tmp_path, monkeypatch) -> None:
    """Every node reported, then node 1's agent went silent before sending its frames: node 0
    judges from the frames it has once ``FRAMES_WAIT_S`` passed, and reads no missing key."""
    from fastelastic.agent.server import _hang

    monkeypatch.setattr(_hang, "FRAMES_WAIT_S", 0.3)
    a, b = nodes
    for n in nodes:
        n.step(0, 5, ago_s=2)
        n.step(1, 5, ago_s=2)
    a.views[1][w.F_STEPS] = 4  # rank 1 fell behind
    assert b.check(store, tmp_path / "b") is None  # reported; then silent
    t0 = time.monotonic()
    assert a.check(store, tmp_path / "a") is None  # the verdict; node 1's frames awaited
    got = None
    while got is None and time.monotonic() - t0 < 5:
        got = a.check(store, tmp_path / "a")
        time.sleep(0.05)
    assert got is HangAction.RETRY and 0.3 <= time.monotonic() - t0 < 5
    text = (tmp_path / "a" / "hang_1" / "report.txt").read_text()
    assert text.startswith("rank 1 (host ") and "fell behind: 4 steps" in text


def test_a_save_in_progress_suspends(store, nodes, tmp_path) -> None:
    a, _ = nodes
    a.step(0, 5, ago_s=3)
    a.step(1, 5, ago_s=3)
    v = a.views[1]
    v[w.F_SUSPEND], v[w.F_SUSPEND_KIND] = 1, w.K_SAVE
    v[w.F_SUSPEND_NS] = time.monotonic_ns()
    assert a.check(store, tmp_path) is None and not a.watch.pending


def test_progress_for_health(nodes) -> None:
    a, _ = nodes
    assert a.watch.progress()[0] == {"steps": 0, "since_progress_s": None, "suspended": []}
    a.step(0, 7, ago_s=2)
    v = a.views[1]
    v[w.F_SUSPEND], v[w.F_SUSPEND_KIND] = 1, w.K_SAVE | w.K_CHECKPOINT
    got = a.watch.progress()
    assert got[0]["steps"] == 7 and 2.0 <= got[0]["since_progress_s"] < 10.0
    assert got[1]["suspended"] == ["torch.save", "torch.distributed.checkpoint"]


def test_watch_shows_steps_and_progress_age(nodes) -> None:
    """``fastelastic watch``: the node's fewest steps and its newest progress's age; '-'
    without the check; a wrongly typed field is dropped and counted."""
    import json as _json

    from fastelastic.watch.publisher import _progress
    from fastelastic.watch.view import JobView

    a, _ = nodes
    a.step(0, 12, ago_s=0.5)
    a.step(1, 11, ago_s=3)

    class Agent:
        _hang = a.watch

    got = _progress(Agent())
    assert got["steps"] == 11 and 0.5 <= got["idle_s"] < 3
    assert _progress(object()) == {}
    v = JobView()
    v.update(_json.dumps({"agent": "h:1", "state": "HEALTHY", "steps": 11, "idle_s": 0.5}).encode())
    v.update(_json.dumps({"agent": "h:2", "state": "HEALTHY"}).encode())
    v.update(_json.dumps({"agent": "h:3", "state": "HEALTHY", "steps": "x"}).encode())
    table = v.render()
    assert "STEPS" in table.splitlines()[0]
    assert "11 (0.5s ago)" in table
    assert v.bad_messages == 1


def _fake_py_spy(tmp_path: Path, monkeypatch, seconds: float) -> None:
    """A py-spy stand-in on PATH: ``begun.<pid>`` when it starts, ``seconds`` later its
    output and ``done.<pid>``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "py-spy"
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path}/begun.$4\nsleep {seconds}\n"
                    f"echo \"native frames of $4\"\ntouch {tmp_path}/done.$4\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.delenv("FASTELASTIC_HANG_PYSPY", raising=False)


def _wait_for(paths: list[Path], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)
    return all(p.exists() for p in paths)


def test_py_spy_begins_at_the_verdict_and_the_culprit_gets_native_frames(
        store, nodes, tmp_path, monkeypatch) -> None:
    """py-spy (a stand-in taking 0.5 s) begins at the verdict with the stacks, for the ranks
    outside a collective, and the culprit's dump has its output; before the verdict (one
    node stalled and reported, the other not) it was not started."""
    _fake_py_spy(tmp_path, monkeypatch, 0.5)
    monkeypatch.setattr(_hang, "NATIVE_RESTART_WAIT_S", 60.0)  # the restart waits for it
    a, b = nodes
    for n in nodes:
        n.step(0, 20, ago_s=2)
        n.step(1, 20, ago_s=2)
    b.views[1][w.F_STEPS] = 19  # rank 3 fell behind: the culprit
    a.step(0, 1)  # node 0 still moving
    assert b.check(store, tmp_path / "b") is None and b.watch.pending  # reported
    time.sleep(0.2)  # what a py-spy begun now would need to leave its mark
    assert not list(tmp_path.glob("begun.*"))  # nothing touched a rank before the verdict
    a.views[0][w.F_LAST_NS] -= int(2e9)
    assert a.check(store, tmp_path / "a") is None  # the verdict: frames sent, py-spy begun
    assert b.check(store, tmp_path / "b") is HangAction.RETRY
    assert a.check(store, tmp_path / "a") is HangAction.RESTART
    text = (tmp_path / "b" / "hang_1" / "rank3.stacks.txt").read_text()
    assert "--- py-spy dump --native ---\nnative frames of 10003" in text
    assert "py-spy" not in (tmp_path / "b" / "hang_1" / "rank2.stacks.txt").read_text()
    assert not list(Path(b.watch.slots.dir).glob("native.*"))  # the dumps' files are gone


@pytest.mark.parametrize("restarts_left", [1, 0])
def test_a_restart_does_not_wait_for_a_late_py_spy(store, nodes, tmp_path, monkeypatch,
                                                   restarts_left: int) -> None:
    """A py-spy (a stand-in) that outlasts NATIVE_RESTART_WAIT_S: the culprit's node restarts
    without its frames (the stacks file says so) while the dump is still running; with no
    restart left the run ends, so the node waits for the frames and reports them."""
    _fake_py_spy(tmp_path, monkeypatch, 3.0)
    monkeypatch.setattr(_hang, "NATIVE_RESTART_WAIT_S", 0.2)
    a, b = nodes
    for n in nodes:
        n.step(0, 20, ago_s=2)
        n.step(1, 20, ago_s=2)
    b.views[1][w.F_STEPS] = 19  # rank 3 fell behind: the culprit
    assert b.check(store, tmp_path / "b", restarts_left) is None
    assert a.check(store, tmp_path / "a") is None  # the verdict: frames sent, py-spy begun
    assert b.check(store, tmp_path / "b", restarts_left) is HangAction.RETRY
    pid = b.watch._pids[1]
    done = (tmp_path / f"done.{pid}").exists()
    text = (tmp_path / "b" / "hang_1" / "rank3.stacks.txt").read_text()
    if restarts_left:
        assert not done and "not waited for" in text and "native frames of" not in text
    else:
        assert done and f"--- py-spy dump --native ---\nnative frames of {pid}" in text
    assert a.check(store, tmp_path / "a") is HangAction.RESTART
    assert not list(Path(b.watch.slots.dir).glob("native.*"))  # the dumps' files are gone


RANK_SCRIPT = textwrap.dedent("""
    import ctypes, sys, time
    from fastelastic.progress import _worker as w
    w.install(sys.argv[1])
    w.step()  # the first progress arms the stack dump's signal
    open(sys.argv[2] + ".ready", "w").close()
    ctypes.PyDLL(None).sleep(3600)  # holds the GIL; a signal ends it early
    open(sys.argv[2] + ".woke", "w").close()
    time.sleep(3600)
""")


def test_no_signal_and_no_ptrace_before_the_verdict(store, nodes, tmp_path,
                                                    monkeypatch) -> None:
    """Node 0's ranks are real processes asleep in libc ``sleep(3600)`` (the GIL held) with
    the stack dump armed. Stalled and reported, they are left alone while node 1 still
    trains and even past a timeout more: nothing ends their sleep, no py-spy starts. At the
    verdict their stacks are dumped (the signal ends the sleep then) and py-spy begins."""
    _fake_py_spy(tmp_path, monkeypatch, 0.1)
    a, b = nodes
    env = {**os.environ, "PYTHONPATH": str(Path(w.__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT,
                               a.watch.slots.paths[lr], str(tmp_path / f"rank{lr}")], env=env)
             for lr in (0, 1)]
    try:
        assert _wait_for([tmp_path / f"rank{lr}.ready" for lr in (0, 1)])
        a.watch.started({lr: p.pid for lr, p in enumerate(procs)}, {0: 0, 1: 1})
        assert all(a.watch.slots.read(lr).dump_sig for lr in (0, 1))  # armed: signalable
        for lr in (0, 1):
            a.views[lr][w.F_LAST_NS] -= int(2e9)  # node 0 stalled
            b.step(lr, 5)  # node 1 trains on
        deadline = time.monotonic() + 1.5  # past a whole timeout more, at the monitor's pace
        while time.monotonic() < deadline:
            assert a.check(store, tmp_path / "a") is None
            b.step(0)
            assert b.check(store, tmp_path / "b") is None
            time.sleep(0.1)
        assert a.watch.pending and not b.watch.pending
        assert not list(tmp_path.glob("*.woke")), "a rank's sleep ended before the verdict"
        assert not list(tmp_path.glob("begun.*")), "py-spy began before the verdict"
        for lr in (0, 1):
            assert Path(a.watch.slots.paths[lr] + ".stacks").read_bytes() == b""
        for lr in (0, 1):
            b.views[lr][w.F_LAST_NS] -= int(2e9)  # node 1 stalls too: the job is hung
        assert b.check(store, tmp_path / "b") is None
        assert a.check(store, tmp_path / "a") is HangAction.RETRY  # none stands out: claimer
        assert b.check(store, tmp_path / "b") is HangAction.RESTART
        assert _wait_for([tmp_path / f"rank{lr}.woke" for lr in (0, 1)])  # the signal, now
        assert _wait_for([tmp_path / f"begun.{p.pid}" for p in procs])
        stacks = (tmp_path / "a" / "hang_1" / "rank0.stacks.txt").read_text()
        assert "File \"<string>\", line 7 in <module>" in stacks  # in the sleep, as dumped
    finally:
        for p in procs:
            p.kill()
            p.wait()
