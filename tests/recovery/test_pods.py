"""Issue 36: node 0 cut from nodes 1-3 by a firewall, in pods and with distinct addresses.

4 nodes x 2 gloo workers (``gworker.py``), ``--nnodes 1:4 --preload torch``, three candidates
on nodes 0-2, ``last_call_timeout=1`` (the defaults otherwise). Once a world of 8 trains on
node 0's store, iptables in every namespace cuts node 0 from nodes 1-3 both ways for 25 s
(each side's INPUT and OUTPUT chains drop or reject the other's packets), then the rules go.

"Pods" runs each launcher as a Kubernetes pod runs it: ``unshare --pid --fork --mount-proc
--uts``, the launcher PID 1 of its PID namespace with a hostname of its own (``pod-<i>``),
every node's hostname in every namespace's hosts file (``ip netns exec`` bind-mounts
``/etc/netns/<ns>/hosts`` over ``/etc/hosts`` in a private mount namespace: the real one is
never touched), the candidates named by hostname, and no ``--local-addr``: every launcher has
the same pid (1) and address (its default). Named by ``<addr>|<pid>``, every pod was ``|1``
and the cut trained worlds of 2 and 6 at once until the end (issue 36's table).

Targets: never two worlds training at once for 2 s or more (from the workers' own steps), and
a world of 8 within 10 s of the heal. In pods, the launchers (PID 1) also leave no zombie:
each worker leaves an orphan at its start, re-parented to PID 1, which must reap it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from netns import Cluster, cluster_or_skip
from recovery_testlib import REPO
from test_partial_cut import HERE, PORT, TorchJob

CUT_S = 25.0
HEAL_TARGET_S = 10.0  # a world of 8 within this long after the heal (issue 36's target)
TWO_WORLDS_S = 2.0  # two worlds never train at once this long or longer
WATCH_AFTER_HEAL_S = 40.0  # how long the test waits for the world of 8 after the heal


def _iptables(c: Cluster, i: int, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", c.ns(i), "iptables", "-w", *args], check=True,
                   capture_output=True, text=True, timeout=20)


# each cut kind: the INPUT rules of one side against the other's address
RULES = {
    "drop": [["-j", "DROP"]],
    "reject-tcp-reset": [["-p", "tcp", "-j", "REJECT", "--reject-with", "tcp-reset"],
                         ["-j", "REJECT"]],
    "reject-icmp": [["-j", "REJECT"]],  # iptables' default: icmp-port-unreachable
}


def cut(c: Cluster, kind: str, a: int, others: list[int]) -> None:
    """Node ``a`` and each of ``others`` drop or reject each other's packets, both ways and
    on both sides: what comes in from the other (INPUT) and what goes out to it (OUTPUT),
    as a host firewall isolating a peer does."""
    for b in others:
        for x, y in ((a, b), (b, a)):
            for rule in RULES[kind]:
                _iptables(c, x, "-A", "INPUT", "-s", c.addr(y), *rule)
                _iptables(c, x, "-A", "OUTPUT", "-d", c.addr(y), *rule)


def heal(c: Cluster, nodes: list[int]) -> None:
    for i in nodes:
        _iptables(c, i, "-F", "INPUT")
        _iptables(c, i, "-F", "OUTPUT")


class PodJob(TorchJob):
    """:class:`TorchJob`, each launcher in a pod (see the module doc) when ``pods``."""

    def __init__(self, c: Cluster, out: Path, pods: bool) -> None:
        super().__init__(c, out, "1:4", candidates=3, last_call=1)
        self.pods = pods
        if pods:
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{c.addr(k)} {self.host(k)}\n" for k in range(c.n))
            for k in range(c.n):
                (Path("/etc/netns") / c.ns(k) / "hosts").write_text(hosts)

    def host(self, i: int) -> str:
        return f"pod-{i}" if self.pods else self.c.addr(i)

    def start(self, i: int, run_s: float = 600, exit_barrier_timeout: float = 300,
              **extra_env: str) -> None:
        endpoint = ",".join(f"{self.host(k)}:{PORT}" for k in range(self.candidates))
        argv = [sys.executable, "-m", "fastelastic.run", "--nnodes", self.nnodes,
                "--nproc-per-node", "2", "--preload", "torch", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", f"last_call_timeout={self.last_call}",
                "--max-restarts", "100", str(HERE / "gworker.py")]
        if self.pods:  # PID 1 of its own PID and UTS namespaces, its own hostname
            argv = ["unshare", "--pid", "--fork", "--mount-proc", "--uts", "sh", "-c",
                    'hostname "$0" && exec "$@"', self.host(i), *argv]
        else:
            at = argv.index("--max-restarts")
            argv[at:at] = ["--local-addr", self.c.addr(i)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(REPO / "src"), RECOVERY_OUT=str(self.out), NODE_NAME=str(i),
                   NODE_RUN_S=str(run_s), OMP_NUM_THREADS="1", LOGLEVEL="INFO",
                   GLOO_SOCKET_IFNAME="eth0", ORPHANS="1" if self.pods else "0", **extra_env)
        self.logs[i] = self.out / f"node{i}.log"
        with open(self.logs[i], "ab") as log:
            self.agents[i] = self.c.spawn(i, argv, env=env, stdout=log, stderr=log)

    def pid1(self, i: int) -> int:
        """The global pid of pod ``i``'s PID 1 (``unshare``'s child; ``ip netns exec`` execs)."""
        pid = self.agents[i].pid
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        assert len(kids) == 1, (i, kids)
        return int(kids[0])

    def orphan_zombies(self, i: int) -> set[tuple[int, str]]:
        """Zombies in pod ``i`` whose parent is its PID 1: orphans it did not reap."""
        init, out = self.pid1(i), set()
        for pid in self.c.pids(i):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
            except OSError:
                continue
            name, _, rest = stat.partition(" (")[2].rpartition(") ")
            state, ppid = rest.split()[:2]
            if state == "Z" and int(ppid) == init:
                out.add((pid, name))
        return out


def overlaps(worlds: dict[str, tuple[float, float, int, set[str]]], since: float
             ) -> list[tuple[float, str, str]]:
    """Each pair of worlds that trained at once after ``since``: (for how long, a, b)."""
    items = [(k, v) for k, v in worlds.items() if v[1] > since]
    out = []
    for n, (a, (a_lo, a_hi, _, _)) in enumerate(items):
        for b, (b_lo, b_hi, _, _) in items[n + 1:]:
            both = min(a_hi, b_hi) - max(a_lo, b_lo, since)
            if both > 0:
                out.append((both, a, b))
    return sorted(out, reverse=True)


def _isolate_node_0(tmp_path: Path, kind: str, pods: bool) -> dict[str, Any]:
    if shutil.which("iptables") is None:
        pytest.skip("!!! iptables is not installed (apt-get install iptables; .ci/run does)")
    with cluster_or_skip(4, "p" + kind[0] + kind[-1] + ("p" if pods else "a")) as c:
        job = PodJob(c, tmp_path, pods)
        for i in range(4):
            job.start(i)
        job.wait_steps({0, 1, 2, 3}, 8, 0.0, timeout=180)
        if pods:  # PID 1 of its namespace, each of them
            for i in range(4):
                nspid = [x for x in Path(f"/proc/{job.pid1(i)}/status").read_text().splitlines()
                         if x.startswith("NSpid:")]
                assert nspid and nspid[0].split()[-1] == "1", nspid
        t_cut = time.time()
        cut(c, kind, 0, [1, 2, 3])
        time.sleep(CUT_S)  # the cut's length is the scenario itself, not a synchronisation
        heal(c, [0, 1, 2, 3])
        healed = time.time()
        try:
            got = job.wait_steps({0, 1, 2, 3}, 8, healed, timeout=WATCH_AFTER_HEAL_S)
            took: float | None = max(got.values()) - healed
        except AssertionError:
            took = None
        worlds = job.worlds()
        both = overlaps(worlds, t_cut)
        since = sorted((round(lo - t_cut, 1), round(hi - t_cut, 1), w, sorted(n))
                       for lo, hi, w, n in worlds.values() if hi > t_cut)
        zombies: list[set[tuple[int, str]]] = []
        if pods:  # twice, 1 s apart: a zombie in both is one PID 1 did not reap
            first = [job.orphan_zombies(i) for i in range(4)]
            time.sleep(1.0)
            zombies = [a & job.orphan_zombies(i) for i, a in enumerate(first)]
        tail = job.tail(3000)
    assert c.leftovers() == {}
    figures = {"kind": kind, "pods": pods, "world of 8 after the heal (s)": took,
               "longest two worlds at once (s)": both[0][0] if both else 0.0,
               "worlds since the cut (from, to, size, nodes)": since}
    print(f"issue 36 cut: {figures}")
    return {**figures, "zombies": zombies, "tail": tail, "both": both}


@pytest.mark.timeout(480)
def test_pods_node_0_isolated_by_drop_trains_one_world_and_re_forms(tmp_path):
    r = _isolate_node_0(tmp_path, "drop", pods=True)
    assert not r["both"] or r["both"][0][0] < TWO_WORLDS_S, f"{r['both']}\n{r['tail']}"
    assert r["world of 8 after the heal (s)"] is not None, r["tail"]
    assert r["world of 8 after the heal (s)"] <= HEAL_TARGET_S, r
    assert r["zombies"] == [set(), set(), set(), set()], r["zombies"]


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["reject-tcp-reset", "reject-icmp"])
def test_node_0_isolated_by_reject_with_distinct_addresses(tmp_path, kind):
    """The same cut by REJECT (each side's INPUT and OUTPUT), distinct ``--local-addr``s.
    With a TCP reset, one world at a time and a world of 8 1.4-2.1 s after the heal (three
    runs; nodes 1-3 trained as a world of 6 from 5.6 s after the cut in one of them, and
    nothing trained during the cut in the other two)."""
    r = _isolate_node_0(tmp_path, kind, pods=False)
    assert not r["both"] or r["both"][0][0] < TWO_WORLDS_S, f"{r['both']}\n{r['tail']}"
    assert r["world of 8 after the heal (s)"] is not None, r["tail"]
    assert r["world of 8 after the heal (s)"] <= HEAL_TARGET_S, r
