"""EtcdKV against real etcd: disconnect actions that need no waiter and happen once, writes
done once through a SIGKILLed leader, and waits that outlive their member."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from etcd_cluster import ETCD, Cluster

if ETCD is None:
    pytest.skip("!!! etcd server binary not found (install etcd-server): etcd tests cannot run",
                allow_module_level=True)
etcd3gw = pytest.importorskip("etcd3gw", reason="!!! etcd3gw not installed: etcd tests cannot run")

from fastelastic.rendezvous.etcd_impl.etcd_kv import EtcdKV  # noqa: E402


def _kv(members, prefix="/t/", **kw) -> EtcdKV:
    clients = [etcd3gw.client(host=m.host, port=m.client_port, timeout=60) for m in members]
    return EtcdKV(clients, prefix, **kw)


def _watchers(member) -> int:
    """The member's count of open watches (its /metrics)."""
    import urllib.request

    with urllib.request.urlopen(f"http://{member.host}:{member.client_port}/metrics",
                                timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("etcd_debugging_mvcc_watcher_total "):
                return int(float(line.split()[1]))
    raise AssertionError("no watcher count in etcd's metrics")


def _raw(member):
    return etcd3gw.client(host=member.host, port=member.client_port, timeout=10)


@pytest.fixture
def one(tmp_path):
    cluster = Cluster(tmp_path, 1).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def three(tmp_path):
    cluster = Cluster(tmp_path, 3).start()
    yield cluster
    cluster.stop()


@pytest.mark.timeout(60)
def test_revoked_lease_disconnect_action_happens_once_with_nobody_waiting(one):
    """Three clients hold leases (each watches for ended leases); b registers an action and
    its lease is revoked: the action is carried out exactly once, though nobody waits on the
    key (main: only a client waiting on that very key carried it out, and each one did)."""
    a, b, c = (_kv(one.members) for _ in range(3))
    for kv in (a, c):
        kv._lease()
    b.append_on_disconnect("gone", b"b:closed;")
    deadline = time.monotonic() + 10
    while b._reaper_stream is None:  # b's own lease watch is open
        assert time.monotonic() < deadline, "b opened no lease watch"
        time.sleep(0.01)
    b._closed.set()  # b is "dead": its keep-alive and its own watch stop
    b._lease_stop.set()
    b._reaper_stream.stop()
    raw = _raw(one.members[0])
    resp = raw.post(raw.get_url("/kv/lease/revoke"), json={"ID": b.lease_id})
    rev = int(resp["header"]["revision"])
    deadline = time.monotonic() + 10
    for kv in (a, c):  # each watch has seen the deletion (events come in revision order)
        while (kv._reaper_stream is None or kv._reaper_stream.last_rev < rev):
            assert time.monotonic() < deadline, "a lease watch never saw the deletion"
            time.sleep(0.01)
    assert a.get("gone", timedelta(seconds=1)) == b"b:closed;"
    a.close()
    c.close()


@pytest.mark.timeout(60)
def test_expired_lease_disconnect_action(one):
    a, b = _kv(one.members), _kv(one.members, lease_ttl=2)
    a._lease()
    b.append_on_disconnect("left/1", b"1")
    b._lease_stop.set()  # as if b's process died: its lease expires (TTL 2 s)
    try:
        t0 = time.monotonic()
        assert a.get("left/1", timedelta(seconds=10)) == b"1"
        assert time.monotonic() - t0 < 6
    finally:
        a.close()
        b.close()  # its lease watch would outlive the test (and the etcd server)


@pytest.mark.timeout(120)
def test_add_is_done_once_through_a_sigkilled_leader(three):
    """Clients add in a loop, each starting on a different member, while the leader is
    SIGKILLed: the counter equals the number of adds that returned, and no request waited
    much longer than the election (main: a write held by a leaderless member waited 5-7 s,
    and an unanswered add could be applied twice)."""
    members = three.members
    kvs = [_kv(members[i:] + members[:i]) for i in range(3) for _ in range(2)]
    done = [0] * len(kvs)
    worst = [0.0] * len(kvs)
    errors: list[BaseException] = []
    stop = threading.Event()

    def loop(i: int) -> None:
        try:
            while not stop.is_set():
                t = time.monotonic()
                kvs[i].add("n", 1)
                worst[i] = max(worst[i], time.monotonic() - t)
                done[i] += 1
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(len(kvs))]
    for t in threads:
        t.start()
    leader = three.leader()
    while sum(done) < 50:
        assert not errors, errors
        time.sleep(0.01)
    leader.kill()
    survivor = next(m for m in members if m is not leader)
    # until a new leader is in and every client's adds go through again
    marks = list(done)
    deadline = time.monotonic() + 30
    while min(d - m for d, m in zip(done, marks, strict=True)) < 20:
        assert not errors, errors
        assert time.monotonic() < deadline, f"adds stalled: {done} (from {marks})"
        time.sleep(0.05)
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors
    kv = _kv([survivor])
    assert kv.add("n", 0) == sum(done)
    assert max(worst) < 4.0, worst


@pytest.mark.timeout(60)
def test_wait_outlives_its_member(three):
    """A wait whose member is SIGKILLed re-watches on the next member at once."""
    members = three.members
    victim = members[0]
    waiter = _kv(members)  # talks to members[0] first
    writer = _kv(members[1:])
    before = _watchers(victim)
    got: list[float] = []
    t = threading.Thread(target=lambda: (waiter.wait(["k"], timedelta(seconds=30)),
                                         got.append(time.monotonic())), daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while _watchers(victim) <= before:  # the wait's watch is open on members[0]
        assert time.monotonic() < deadline, "the wait opened no watch on its member"
        time.sleep(0.01)
    victim.kill()
    t0 = time.monotonic()
    writer.set("k", b"v")
    t.join(30)
    assert got, "the wait did not return"
    assert got[0] - t0 < 1.5, got[0] - t0  # main re-read after 2 s of quiet


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_lease_outlives_a_long_election(three):
    """Two of three members are SIGKILLed for longer than the lease's TTL, then one comes
    back: the new leader extends every lease, and the client's keep-alives, which kept
    trying, keep it: its disconnect action does not happen (main gave a lease up after one
    TTL without an answer and stopped refreshing it, so etcd expired it after the election:
    every node counted dead, a restart of the whole job)."""
    members = three.members
    leader = three.leader()
    follower = next(m for m in members if m is not leader)
    kv = _kv(members, lease_ttl=2)
    kv.append_on_disconnect("left/0", b"1")
    lease = kv.lease_id
    leader.kill()
    follower.kill()
    time.sleep(8)  # the outage under test: four TTLs without a quorum
    three.restart(follower)
    raw = _raw(follower)

    def ttl() -> int:
        try:
            return int(raw.post(raw.get_url("/lease/timetolive"), json={"ID": lease}).get(
                "TTL", -1))
        except Exception:  # noqa: BLE001 - no leader yet
            return -2

    deadline = time.monotonic() + 30
    while ttl() == -2:  # until the two members elected a leader
        assert time.monotonic() < deadline, "no leader after the restart"
        time.sleep(0.05)
    # The new leader extended the lease by its TTL (and an election timeout): watch it for
    # three TTLs more; unrefreshed, it would expire meanwhile.
    end = time.monotonic() + 3 * 2
    while time.monotonic() < end:
        assert ttl() >= 0, "the lease expired after the election"
        time.sleep(0.1)
    assert kv.lease_id == lease
    assert not kv.check(["left/0"]), "the disconnect action happened: the lease ended"
    kv.close()
