"""A node whose whole cgroup (agent and busy workers) is throttled to 5 % of a CPU for 20 s
while training is starved, not lost: the others must not drop it (detection window 5 s)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from run_testlib import HERE, base_env, free_port, launcher_cmd

V1 = Path("/sys/fs/cgroup/cpu")
V2 = Path("/sys/fs/cgroup")
THROTTLE_S = 20.0


class CpuLimit:
    """A cgroup of our own with a CPU quota: v1 ``cpu.cfs_quota_us``, else v2 ``cpu.max``."""

    def __init__(self, name: str) -> None:
        if (V1 / "cpu.cfs_quota_us").exists():
            self.path, self.v2 = V1 / name, False
        elif "cpu" in (V2 / "cgroup.controllers").read_text().split() if (
                V2 / "cgroup.controllers").exists() else False:
            self.path, self.v2 = V2 / name, True
        else:
            pytest.skip("!!! no cgroup CPU controller here (v1 cpu or v2 cpu.max): cannot "
                        "throttle a node")
        try:
            self.path.mkdir(exist_ok=True)
        except OSError as e:
            pytest.skip(f"!!! cannot make a cgroup ({e}): the throttled-node test needs root")

    def limit(self, percent: float | None) -> None:
        period = 100_000
        if self.v2:
            quota = "max" if percent is None else str(int(period * percent / 100))
            (self.path / "cpu.max").write_text(f"{quota} {period}")
        else:
            (self.path / "cpu.cfs_period_us").write_text(str(period))
            quota = -1 if percent is None else int(period * percent / 100)
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))

    def add_tree(self, root: int) -> list[int]:
        """Moves ``root`` and all its descendants in; returns the pids moved."""
        moved, todo = [], [root]
        while todo:
            pid = todo.pop()
            try:
                (self.path / "cgroup.procs").write_text(str(pid))
            except OSError:
                continue  # gone meanwhile
            moved.append(pid)
            try:
                kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            except OSError:
                kids = []
            todo.extend(int(k) for k in kids)
        return moved

    def throttled(self) -> int:
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat.get("nr_throttled", 0))

    def remove(self) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                parent.write_text(pid)
            except OSError:
                pass
        self.path.rmdir()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_node_throttled_to_5_percent_for_20s_is_kept(tmp_path):
    limit = CpuLimit(f"fastelastic-test-{os.getpid()}")
    port = free_port()
    env = base_env(OUT=str(tmp_path), DUR=str(THROTTLE_S + 12), OMP_NUM_THREADS="1")
    args = ["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"thr-{port}",
            "--max-restarts", "3", str(HERE / "busy_worker.py")]
    logs = [open(tmp_path / f"node{i}.log", "w+") for i in range(2)]  # noqa: SIM115
    procs = [subprocess.Popen([*launcher_cmd("fastrun"), *args], env=env, stdout=logs[i],
                              stderr=subprocess.STDOUT) for i in range(2)]
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("start-*"))) < 4:
            assert time.monotonic() < deadline, "the job did not start in 60 s"
            assert all(p.poll() is None for p in procs), "a launcher ended before training"
            time.sleep(0.05)
        limit.limit(5)
        moved = limit.add_tree(procs[1].pid)
        assert len(moved) >= 3, moved  # the launcher and its two workers at least
        t0 = time.monotonic()
        while time.monotonic() - t0 < THROTTLE_S:
            assert procs[0].poll() is None, "node 0 ended while node 1 was throttled"
            time.sleep(0.2)
        assert limit.throttled() > 0, "the quota never throttled the node"
        limit.limit(None)
        codes = [p.wait(90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        limit.remove()
    text = [f.seek(0) or f.read() for f in logs]
    for f in logs:
        f.close()
    starts = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.glob("start-*"))
    assert starts == [f"start-{r}-0" for r in range(4)], (starts, text[0][-3000:])
    for t in text:
        assert "dropping it" not in t and "lost" not in t, t[-3000:]
    assert codes == [0, 0], text
