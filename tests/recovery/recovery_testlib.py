"""Runs fastrun agents in simulated hosts (see ``netns``) and reads what their workers did."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from netns import Cluster, wait_for

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
WORKER = HERE / "rworker.py"
PORT = 29400
# Detection settings of these tests: keep-alives every 0.5 s, silent after 6 missed (3 s);
# TCP keep-alive ends a cut connection sooner (~2 s), so a cut is told from a freeze.
KA_INTERVAL = 0.5
KA_ATTEMPTS = 6
WINDOW = KA_INTERVAL * KA_ATTEMPTS
TCP_KEEPALIVE_S = 1
# Detection must land within the window plus this margin. A fixed margin, not a same-run
# baseline, on purpose: what these tests check is a protocol bound (a lost node is called lost
# once its keep-alives stood still for WINDOW, never later), not a speed to compare with
# another launcher (the benchmarks do that, torchrun in the same run). The margin is what a
# shared 2-core CI machine adds to the window (scheduling of ~10 processes, the workers'
# next step, the agent's check slice); a regression that waits for anything longer (a last
# call, a join or TCP timeout: 30 s and more) fails it.
MARGIN = 3.0


class Job:
    """fastrun agents, one per simulated node, writing into ``out``."""

    def __init__(self, cluster: Cluster, out: Path, nnodes: str, run_id: str = "t",
                 last_call: int = 1, max_restarts: int = 3, candidates: int = 1) -> None:
        self.c = cluster
        self.candidates = candidates  # > 1: nodes 0.. each host a candidate rendezvous store
        self.out = out
        self.nnodes = nnodes
        self.run_id = run_id
        self.last_call = last_call
        self.max_restarts = max_restarts
        self.agents: dict[int, subprocess.Popen[Any]] = {}
        self.logs: dict[int, Path] = {}
        (out / "starts.jsonl").touch()

    def start(self, i: int, run_s: float = 600, exit_barrier_timeout: float = 300,
              **extra_env: str) -> None:
        conf = (f"keep_alive_interval={KA_INTERVAL},"
                f"keep_alive_max_attempt={KA_ATTEMPTS},last_call_timeout={self.last_call},"
                "join_timeout=120")
        endpoint = ",".join(f"{self.c.addr(k)}:{PORT}" for k in range(self.candidates))
        if self.candidates == 1:
            conf += f",is_host={1 if i == 0 else 0}"
        argv = [sys.executable, "-m", "fastelastic.run", "--nnodes", self.nnodes,
                "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", conf, "--local-addr", self.c.addr(i),
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
                "--exit-barrier-timeout", str(exit_barrier_timeout), str(WORKER)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(REPO / "src"), RECOVERY_OUT=str(self.out),
                   NODE_NAME=str(i), NODE_RUN_S=str(run_s),
                   FASTELASTIC_STORE_KEEPALIVE_S=str(TCP_KEEPALIVE_S), **extra_env)
        self.logs[i] = self.out / f"node{i}.log"
        with open(self.logs[i], "ab") as log:
            self.agents[i] = self.c.spawn(i, argv, env=env, stdout=log, stderr=log)

    def starts(self) -> list[dict[str, Any]]:
        text = (self.out / "starts.jsonl").read_text()
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    def wait_world(self, nodes: set[int], world: int, after: float = 0.0,
                   timeout: float = 60) -> dict[int, dict[str, Any]]:
        """Waits until every node of ``nodes`` started a worker in a world of ``world`` after
        ``after`` (wall clock); returns each node's first such start."""

        def ready() -> dict[int, dict[str, Any]] | None:
            ended = {n: self.agents[n].poll() for n in nodes if n in self.agents}
            if any(rc is not None for rc in ended.values()):
                raise AssertionError(f"agents ended: {ended}\n{self.tail()}")
            got: dict[int, dict[str, Any]] = {}
            for s in self.starts():
                n = int(s["node"])
                if n in nodes and s["world"] == world and s["t"] > after and n not in got:
                    got[n] = s
            return got if set(got) == nodes else None

        try:
            return wait_for(ready, timeout, f"nodes {sorted(nodes)} training in a world of {world}")
        except TimeoutError as e:
            raise AssertionError(f"{e}\nstarts: {self.starts()}\n{self.tail()}") from e

    def assert_never_trains(self, nodes: set[int], after: float, seconds: float) -> None:
        """Watches for ``seconds`` (bounded) that no node of ``nodes`` starts a worker after
        ``after`` (wall clock): long enough for a round to form, were it allowed to."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            late = [s for s in self.starts() if int(s["node"]) in nodes and s["t"] > after]
            assert not late, f"nodes {sorted(nodes)} trained: {late}\n{self.tail()}"
            time.sleep(0.2)

    def tickets(self, round_: int = 0) -> int:
        """Tickets taken in ``round_`` (read through a client run inside node 0)."""
        code = ("import sys; from datetime import timedelta; "
                "from fastelastic.store import TCPStore; "
                f"c=TCPStore('127.0.0.1', {PORT}, timeout=timedelta(seconds=10));"
                f"print(c.add('fe.rdzv.{self.run_id}/{round_}/t', 0))")
        p = self.c.spawn(0, [sys.executable, "-c", code], env={**os.environ,
                         "PYTHONPATH": str(REPO / "src")}, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL)
        out, _ = p.communicate(timeout=20)
        return int(out or b"0")

    def log(self, i: int) -> str:
        return self.logs[i].read_text(errors="replace") if i in self.logs else ""

    def tail(self, n: int = 1500) -> str:
        return "\n".join(f"--- node {i}\n{self.log(i)[-n:]}" for i in sorted(self.logs))

    def wait_exit(self, i: int, timeout: float) -> int:
        try:
            return self.agents[i].wait(timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"node {i}'s agent still running after {timeout}s\n"
                                 f"{self.tail()}") from e


def fault(c: Cluster, mode: str, i: int) -> float:
    """Applies ``mode`` (kill, freeze, cut) to node ``i``; returns the wall-clock time."""
    t = time.time()
    {"kill": c.kill, "freeze": c.freeze, "cut": c.cut}[mode](i)
    return t
