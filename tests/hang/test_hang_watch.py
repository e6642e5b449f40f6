"""Two agents' hang checks against a real store, with slots written as workers write them:
a verdict needs every node, one claim writes the report, the culprit's node retries and the
other restarts, and progress before the verdict withdraws a node's report."""

from __future__ import annotations

import mmap
import re
import time
from datetime import timedelta
from pathlib import Path

import pytest

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

    def check(self, store, log_dir: Path):
        return self.watch.check(store, self.group_rank, 2, str(log_dir))

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
    a.views[0][w.F_LAST_NS] -= int(2e9)  # now node 0 stalls too
    assert a.check(store, tmp_path / "a") is HangAction.RESTART  # rank 3 is not node 0's
    assert b.check(store, tmp_path / "b") is HangAction.RETRY  # node 1 spends a restart
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


def test_py_spy_runs_while_the_other_nodes_report_not_in_the_restart(
        store, nodes, tmp_path, monkeypatch) -> None:
    """py-spy (here a stand-in taking 1 s) begins when a node stalls: the verdict that comes
    once the last node reported does not wait for it again (it was in the restart's path)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "py-spy"
    fake.write_text("#!/bin/sh\nsleep 1\necho \"native frames of $4\"\n"
                    f"touch {tmp_path}/done.$4\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("FASTELASTIC_HANG_PYSPY", raising=False)
    a, b = nodes
    for n in nodes:
        n.step(0, 20, ago_s=2)
        n.step(1, 20, ago_s=2)
    b.views[1][w.F_STEPS] = 19  # rank 3 fell behind: the culprit
    a.step(0, 1)  # node 0 still moving
    t0 = time.monotonic()
    assert b.check(store, tmp_path / "b") is None  # stalled and reported; py-spy begun
    assert time.monotonic() - t0 < 0.9  # ... in the background
    done = [tmp_path / f"done.{10_000 + r}" for r in (2, 3)]
    deadline = time.monotonic() + 10
    while not all(p.exists() for p in done) and time.monotonic() < deadline:
        time.sleep(0.05)  # node 0 reports only after node 1's py-spy finished
    assert all(p.exists() for p in done)
    a.views[0][w.F_LAST_NS] -= int(2e9)
    assert a.check(store, tmp_path / "a") is HangAction.RESTART
    t0 = time.monotonic()
    assert b.check(store, tmp_path / "b") is HangAction.RETRY
    assert time.monotonic() - t0 < 0.5  # before: py-spy ran here, 1 s
    text = (tmp_path / "b" / "hang_1" / "rank3.stacks.txt").read_text()
    assert "--- py-spy dump --native ---\nnative frames of 10003" in text
    assert "py-spy" not in (tmp_path / "b" / "hang_1" / "rank2.stacks.txt").read_text()
    assert not list(Path(b.watch.slots.dir).glob("native.*"))  # the dumps' files are gone


def _fake_py_spy(tmp_path: Path, monkeypatch, seconds: float) -> None:
    """A py-spy stand-in on PATH that takes ``seconds`` and leaves ``done.<pid>`` behind."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "py-spy"
    fake.write_text(f"#!/bin/sh\nsleep {seconds}\necho \"native frames of $4\"\n"
                    f"touch {tmp_path}/done.$4\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.delenv("FASTELASTIC_HANG_PYSPY", raising=False)


def _wait_for(paths: list[Path], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths) and time.monotonic() < deadline:
        time.sleep(0.02)
    return all(p.exists() for p in paths)


def test_stacks_and_py_spy_begin_before_the_stall_so_a_same_tick_verdict_never_waits(
        store, nodes, tmp_path, monkeypatch) -> None:
    """Every node stalls in the same tick (the usual case: peers block in the hung rank's
    collective at once), so the verdict follows the last report at once. The stacks and
    py-spy are taken a fifth of the timeout (1 s at most) before the stall, so that verdict
    does not wait for them (before: py-spy began at the stall, and the restart waited for it,
    here 1 s)."""
    _fake_py_spy(tmp_path, monkeypatch, 1.0)
    a, b = nodes  # timeout 1 s: the dumps begin at 0.8 s without progress
    for n in nodes:
        n.step(0, 20, ago_s=0.85)
        n.step(1, 20, ago_s=0.85)
    b.views[1][w.F_STEPS] = 19  # rank 3 fell behind: the culprit
    for n in nodes:
        assert n.check(store, tmp_path / f"n{n.group_rank}") is None  # not stalled yet
    assert not store.check(["fastelastic/hang/node/0", "fastelastic/hang/node/1"])
    assert _wait_for([tmp_path / f"done.{10_000 + r}" for r in range(4)])  # py-spy ran ahead
    for n in nodes:
        for lr in (0, 1):
            n.views[lr][w.F_LAST_NS] -= int(0.3e9)  # now 1.15 s: stalled
    assert a.check(store, tmp_path / "a") is None  # reported; b has not yet
    t0 = time.monotonic()
    assert b.check(store, tmp_path / "b") is HangAction.RETRY
    assert time.monotonic() - t0 < 0.5  # before: py-spy began here and was waited for, 1 s
    assert a.check(store, tmp_path / "a") is HangAction.RESTART
    text = (tmp_path / "b" / "hang_1" / "rank3.stacks.txt").read_text()
    assert "--- py-spy dump --native ---\nnative frames of 10003" in text
    report = (tmp_path / "b" / "hang_1" / "report.txt").read_text()
    idle = float(re.search(r"rank 3 host \S+ pid 10003 steps 19 idle ([\d.]+)s", report)[1])
    assert idle >= 1.15  # the stall's, not the early dump's (0.85 s)


def test_progress_after_the_early_dump_drops_it_and_the_stall_dumps_again(
        store, nodes, tmp_path, monkeypatch) -> None:
    """The stacks taken ahead of a stall are dropped (py-spy ended, its files removed) when
    the node makes progress before the stall, and taken afresh at the next stall."""
    _fake_py_spy(tmp_path, monkeypatch, 5.0)
    a, _ = nodes
    a.step(0, 3, ago_s=0.9)
    a.step(1, 3, ago_s=0.9)
    assert a.check(store, tmp_path / "a") is None
    assert a.watch._native is not None and a.watch._native.local_ranks  # begun ahead
    native_dir = Path(a.watch.slots.dir)
    assert list(native_dir.glob("native.*"))
    a.step(0)  # progress: the early dumps are stale
    assert a.check(store, tmp_path / "a") is None
    assert a.watch._native is None and not list(native_dir.glob("native.*"))
    assert not store.check(["fastelastic/hang/node/0"])
