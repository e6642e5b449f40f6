"""Issue 27's partial cut and rack loss, in simulated hosts (network namespaces).

The partial cut: a node that moved alone must not make a store look live to the nodes started
after it.

4 nodes x 2 gloo workers (``gworker.py``), ``--nnodes 1:4 --preload torch``, three candidates
(nodes 0-2), ``--rdzv-conf last_call_timeout=1`` (the defaults otherwise). Once a world of 8
trains, node 3 alone loses its route to node 0 for 15 s (a blackhole route in its namespace;
nodes 1 and 2 stay reachable), then the route comes back; 5 s later its launcher gets SIGTERM,
as a restarted pod does, and a replacement starts on a new host with the same command.

Before the epoch was a commit, node 3's move raised node 1's epoch at once: the replacement
followed it there and formed a world of 2 of its own, training beside the world of 6 on node
0's store until the end of the watch. Now: never two worlds training at once (from the
workers' own steps), and the replacement trains in a world of 8 within 45 s of its start.

The rack loss (same setup): nodes 1-3 are SIGKILLed at once (their hosts stay up) and three
replacements start on new hosts. Before, node 0 and the replacements waited for the join
timeout ("may be alive elsewhere" every 5 s); now the lost members are proven gone (their
connections closed on node 0's store, the other candidates refuse the connection) and a world
of 8 with the replacements trains within 60 s of their start.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netns import cluster_or_skip, wait_for
from recovery_testlib import REPO, Job

HERE = Path(__file__).resolve().parent
PORT = 29400
CUT_S = 15.0
TERM_AFTER_HEAL_S = 5.0
WATCH_S = 45.0


class TorchJob(Job):
    """The issue's command: 2 gloo workers per node, torch preloaded, three candidates."""

    def start(self, i: int, run_s: float = 600, exit_barrier_timeout: float = 300,
              **extra_env: str) -> None:
        endpoint = ",".join(f"{self.c.addr(k)}:{PORT}" for k in range(self.candidates))
        argv = [sys.executable, "-m", "fastelastic.run", "--nnodes", self.nnodes,
                "--nproc-per-node", "2", "--preload", "torch", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", f"last_call_timeout={self.last_call}",
                "--local-addr", self.c.addr(i), "--max-restarts", "100",
                str(HERE / "gworker.py")]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(REPO / "src"), RECOVERY_OUT=str(self.out), NODE_NAME=str(i),
                   NODE_RUN_S=str(run_s), OMP_NUM_THREADS="1", LOGLEVEL="INFO",
                   GLOO_SOCKET_IFNAME="eth0", **extra_env)  # gloo on the node's address
        self.logs[i] = self.out / f"node{i}.log"
        with open(self.logs[i], "ab") as log:
            self.agents[i] = self.c.spawn(i, argv, env=env, stdout=log, stderr=log)

    def steps(self) -> list[dict[str, Any]]:
        path = self.out / "steps.jsonl"
        if not path.exists():
            return []
        return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

    def wait_steps(self, nodes: set[int], world: int, after: float,
                   timeout: float) -> dict[int, float]:
        """Each node of ``nodes``'s first step in a world of ``world`` after ``after``."""
        def ready() -> dict[int, float] | None:
            got: dict[int, float] = {}
            for s in self.steps():
                n = int(s["node"])
                if n in nodes and s["world"] == world and s["t"] > after:
                    got.setdefault(n, s["t"])
            return got if set(got) == nodes else None
        try:
            return wait_for(ready, timeout, f"nodes {sorted(nodes)} stepping in a world of "
                            f"{world}", step=0.2)
        except TimeoutError as e:
            raise AssertionError(f"{e}\n{self.worlds()}\n{self.tail(3000)}") from e

    def worlds(self) -> dict[str, tuple[float, float, int, set[str]]]:
        """Each world's (first step, last step, size, nodes), by its store address."""
        out: dict[str, tuple[float, float, int, set[str]]] = {}
        for s in self.steps():
            lo, hi, w, nodes = out.get(s["wid"], (s["t"], s["t"], s["world"], set()))
            out[s["wid"]] = (min(lo, s["t"]), max(hi, s["t"]), w, nodes | {s["node"]})
        return out


def two_worlds_at_once(worlds: dict[str, tuple[float, float, int, set[str]]]
                       ) -> list[tuple[str, str]]:
    """Pairs of worlds whose steps overlap in time."""
    items = sorted(worlds.items(), key=lambda kv: kv[1][0])
    return [(a, b) for i, (a, (_, a_hi, _, _)) in enumerate(items)
            for b, (b_lo, _, _, _) in items[i + 1:] if b_lo < a_hi]


def _route(c, i: int, verb: str, to: int) -> None:
    subprocess.run(["ip", "-n", c.ns(i), "route", verb, "blackhole", f"{c.addr(to)}/32"],
                   check=True, capture_output=True, timeout=20)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_node_cut_from_the_store_alone_never_makes_a_second_world(tmp_path):
    with cluster_or_skip(5, "pc") as c:
        job = TorchJob(c, tmp_path, "1:4", candidates=3, last_call=1)
        for i in range(4):
            job.start(i)
        job.wait_steps({0, 1, 2, 3}, 8, 0.0, timeout=180)
        t_cut = time.time()
        _route(c, 3, "add", 0)
        time.sleep(CUT_S)  # the cut's length is the scenario itself, not a synchronisation
        _route(c, 3, "del", 0)
        time.sleep(TERM_AFTER_HEAL_S)
        job.agents[3].send_signal(signal.SIGTERM)
        t_new = time.time()
        job.start(4)
        got = job.wait_steps({0, 1, 2, 4}, 8, t_new, timeout=WATCH_S)
        took = max(got.values()) - t_new
        print(f"partial cut: the replacement trains in a world of 8 {took:.1f}s after its start")
        # watch on until WATCH_S after the replacement's start: never two worlds at once
        time.sleep(max(0.0, t_new + WATCH_S - time.time()))
        worlds = job.worlds()
        assert not two_worlds_at_once(worlds), f"{worlds}\n{job.tail(3000)}"
        job.wait_exit(3, 60)  # the SIGTERMed launcher ended (raises if it did not)
        # node 3 moved alone (a proposal, never committed), then went back once its route was
        assert "epoch 1 proposed" in job.log(3) and "went back to it" in job.log(3), job.tail()
        print(f"partial cut: worlds since the cut: "
              f"{[(w, sorted(n)) for lo, hi, w, n in worlds.values() if hi > t_cut]}")
    assert c.leftovers() == {}


@pytest.mark.timeout(420)
def test_a_rack_lost_at_once_is_proven_gone_and_replaced(tmp_path):
    with cluster_or_skip(7, "rk") as c:
        job = TorchJob(c, tmp_path, "1:4", candidates=3, last_call=1)
        for i in range(4):
            job.start(i)
        job.wait_steps({0, 1, 2, 3}, 8, 0.0, timeout=180)
        for i in (1, 2, 3):  # at once: nobody acts between the first death and the last
            c.freeze(i)
        for i in (1, 2, 3):
            c.kill(i)
        t_new = time.time()
        for i in (4, 5, 6):
            job.start(i)
        got = job.wait_steps({0, 4, 5, 6}, 8, t_new, timeout=60)
        took = max(got.values()) - t_new
        print(f"rack loss: a world of 8 with the replacements {took:.1f}s after their start")
        assert not two_worlds_at_once(job.worlds()), f"{job.worlds()}\n{job.tail(3000)}"
    assert c.leftovers() == {}
