"""``--rdzv-backend etcd`` with a 3-member etcd cluster: real fastrun agents, one per simulated
host (network namespace), and one etcd member per further host (etcd's default timings).

* The etcd leader is SIGKILLed while the job trains: nothing restarts; while a round forms:
  it completes.
* The node whose agent hosts the workers' store (rank 0's) is lost, or another node: the
  survivors train again in a round hosted by one of them, every worker is given that host's
  live store (no stale ``MASTER_ADDR``/``MASTER_PORT``), and the loss is known through the
  connections to the workers' store host at once: the nodes' etcd leases here last 30 s, so a
  survivor waiting for a lease to expire would take 30 s.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import cluster_or_skip, wait_for
from recovery_testlib import HERE, KA_ATTEMPTS, KA_INTERVAL, REPO, TCP_KEEPALIVE_S, Job

sys.path.insert(0, str(HERE.parent / "rendezvous"))
from etcd_cluster import ETCD, Cluster  # noqa: E402

if ETCD is None:
    pytest.skip("!!! etcd server binary not found (install etcd-server): etcd tests cannot run",
                allow_module_level=True)
pytest.importorskip("etcd3gw", reason="!!! etcd3gw not installed: etcd tests cannot run")

WORKER = HERE / "etcd_rworker.py"
NODES = 3


class EtcdJob(Job):
    """fastrun agents with ``--rdzv-backend etcd`` (nodes 0..2) against ``endpoints``."""

    def __init__(self, cluster, out: Path, nnodes: str, endpoints: str, lease_ttl: int = 3,
                 ka_attempts: int = KA_ATTEMPTS):
        super().__init__(cluster, out, nnodes)
        self.endpoints = endpoints
        self.lease_ttl = lease_ttl
        self.ka_attempts = ka_attempts

    def start(self, i: int, run_s: float = 600, exit_barrier_timeout: float = 300) -> None:
        conf = (f"keep_alive_interval={KA_INTERVAL},keep_alive_max_attempt={self.ka_attempts},"
                f"last_call_timeout={self.last_call},join_timeout=120,"
                f"lease_ttl={self.lease_ttl}")
        argv = [sys.executable, "-m", "fastelastic.run", "--nnodes", self.nnodes,
                "--nproc-per-node", "1", "--rdzv-backend", "etcd",
                "--rdzv-endpoint", self.endpoints, "--rdzv-id", self.run_id,
                "--rdzv-conf", conf, "--local-addr", self.c.addr(i),
                "--max-restarts", str(self.max_restarts), "--monitor-interval", "0.1",
                "--exit-barrier-timeout", str(exit_barrier_timeout), str(WORKER)]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
        env.update(PYTHONPATH=str(REPO / "src"), RECOVERY_OUT=str(self.out), LOGLEVEL="INFO",
                   NODE_NAME=str(i), NODE_RUN_S=str(run_s),
                   FASTELASTIC_STORE_KEEPALIVE_S=str(TCP_KEEPALIVE_S))
        self.logs[i] = self.out / f"node{i}.log"
        with open(self.logs[i], "ab") as log:
            self.agents[i] = self.c.spawn(i, argv, env=env, stdout=log, stderr=log)

    def stop_all(self) -> None:
        for p in self.agents.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for i in self.agents:
            self.wait_exit(i, 60)


def _etcd(c, tmp_path: Path) -> Cluster:
    """Members on hosts NODES .. NODES + 2, with etcd's default heartbeat and election."""
    return Cluster(tmp_path / "etcd", 3, hosts=[c.addr(NODES + k) for k in range(3)],
                   spawn=lambda k, argv, **kw: c.spawn(NODES + k, argv, **kw),
                   timing=(100, 1000)).start()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_etcd_leader_sigkilled_while_training_restarts_nothing(tmp_path):
    with cluster_or_skip(NODES + 3, "el") as c:
        etcd = _etcd(c, tmp_path)
        # A silent window of 5 s (0.5 s x 10): an election takes 1-2.5 s at etcd's defaults,
        # and main's keep-alives stood still for 6-7 s through it.
        job = EtcdJob(c, tmp_path, f"{NODES}:{NODES}", etcd.endpoints, ka_attempts=10)
        try:
            for i in range(NODES):
                job.start(i)
            job.wait_world(set(range(NODES)), NODES, timeout=90)
            leader = etcd.logged_leader()
            t = time.time()
            leader.kill()
            new = etcd.logged_leader()
            assert new is not leader
            # Observe for longer than everything that could count a node lost: the lease
            # (3 s), the silent window (5 s) and an etcd request's longest retry (2 x 5 s).
            end = time.monotonic() + 15
            while time.monotonic() < end:
                ended = {i: p.poll() for i, p in job.agents.items() if p.poll() is not None}
                assert not ended, f"agents ended: {ended}\n{job.tail()}"
                restarted = [s for s in job.starts() if s["t"] > t]
                assert not restarted, f"workers restarted: {restarted}\n{job.tail()}"
                time.sleep(0.2)
            log = "".join(job.log(i) for i in range(NODES))
            assert "ended (expired or revoked)" not in log, job.tail()
            job.stop_all()
        finally:
            etcd.stop()
    assert c.leftovers() == {}


def _tickets(c, endpoints: str, run_id: str = "t", round_: int = 0) -> int:
    """Tickets taken in ``round_``, read from etcd by a client run inside host 0."""
    host, _, port = endpoints.split(",")[0].rpartition(":")
    code = ("import etcd3gw; from fastelastic.rendezvous.etcd_impl.etcd_kv import EtcdKV; "
            f"kv = EtcdKV([etcd3gw.client(host={host!r}, port={port})], '/fastelastic/'); "
            f"print(kv.add('fe.rdzv.{run_id}/{round_}/t', 0))")
    p = c.spawn(0, [sys.executable, "-c", code], env={**os.environ,
                "PYTHONPATH": str(REPO / "src")}, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL)
    out, _ = p.communicate(timeout=30)
    return int(out or b"0")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_etcd_leader_sigkilled_while_a_round_forms(tmp_path):
    """Nodes 0 and 1 hold tickets of a round of 3 when the leader is SIGKILLed; node 2 comes
    during the election: the round completes with all three."""
    with cluster_or_skip(NODES + 3, "ef") as c:
        etcd = _etcd(c, tmp_path)
        job = EtcdJob(c, tmp_path, f"{NODES}:{NODES}", etcd.endpoints)
        try:
            job.start(0)
            job.start(1)
            wait_for(lambda: _tickets(c, etcd.endpoints) >= 2, 60, "nodes 0 and 1's tickets")
            etcd.logged_leader().kill()
            t = time.time()
            job.start(2)
            got = job.wait_world(set(range(NODES)), NODES, timeout=60)
            took = max(s["t"] for s in got.values()) - t
            assert took < 20, f"the round completed {took:.1f}s after the leader's loss"
            assert all(s["restart"] == 0 for s in got.values()), got
            job.stop_all()
        finally:
            etcd.stop()
    assert c.leftovers() == {}


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("lost", ["rank0", "other"])
def test_etcd_node_lost_round_hosted_by_a_survivor(tmp_path, lost):
    """A node is SIGKILLed (every process of its host) while training: with 30 s leases, the
    survivors train again within seconds, in a round whose workers' store is a survivor's."""
    with cluster_or_skip(NODES + 3, "e" + lost[0]) as c:
        etcd = _etcd(c, tmp_path)
        job = EtcdJob(c, tmp_path, f"2:{NODES}", etcd.endpoints, lease_ttl=30)
        try:
            for i in range(NODES):
                job.start(i)
            first = job.wait_world(set(range(NODES)), NODES, timeout=90)
            assert all(s["store_ok"] for s in first.values()), first
            host0 = next(int(n) for n, s in first.items() if s["group_rank"] == 0)
            old_master = first[host0]["master"]
            assert old_master.startswith(f"{c.addr(host0)}:"), first
            victim = host0 if lost == "rank0" else (host0 + 1) % NODES
            survivors = set(range(NODES)) - {victim}
            t = time.time()
            c.kill(victim)
            got = job.wait_world(survivors, NODES - 1, after=t, timeout=60)
            took = max(s["t"] for s in got.values()) - t
            assert took < 10, f"training again after {took:.1f}s (a lease is 30 s)\n{job.tail()}"
            masters = {s["master"] for s in got.values()}
            assert len(masters) == 1, got
            master = masters.pop()
            assert master.rpartition(":")[0] in {c.addr(i) for i in survivors}, got
            if lost == "rank0":
                assert master != old_master
            assert all(s["store_ok"] for s in got.values()), f"{got}\n{job.tail()}"
            log = "".join(job.log(i) for i in survivors)
            assert "etcd liveness" in log and "ending its etcd lease" in log, job.tail()
            # Nobody ended a survivor's lease (their links to the last round's store closed
            # on purpose when the next round formed: no death to relay).
            assert "ended (expired or revoked)" not in log, job.tail()
            job.stop_all()
        finally:
            etcd.stop()
    assert c.leftovers() == {}

