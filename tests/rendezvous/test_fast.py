"""Semantics of the fast (ticket) rendezvous on fastelastic's TCPStore."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from datetime import timedelta

import pytest

from fastelastic.errors import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousTimeoutError,
    StoreConnectionError,
)
from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler
from fastelastic.rendezvous.fast.fast_rendezvous import FastRendezvousHandler, assign_ranks
from fastelastic.rendezvous.timeouts import RendezvousTimeout
from fastelastic.store import TCPStore

RUN = "job"
_MADE: list[weakref.ref[FastRendezvousHandler]] = []  # by _handler (weakly: some tests drop
# a handler to see it collected), for _close_what_the_test_made


def _handler(port, min_nodes, max_nodes, last_call=30.0, join=20.0, rank=-1, ka=5.0, ka_max=3,
             run_id=RUN):
    store = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
    timeout = RendezvousTimeout(join=timedelta(seconds=join),
                                last_call=timedelta(seconds=last_call))
    h = FastRendezvousHandler(run_id, store, "c10d", min_nodes, max_nodes, timeout,
                              local_addr="127.0.0.1", node_rank=rank,
                              keep_alive_interval=ka, keep_alive_max_attempt=ka_max)
    _MADE.append(weakref.ref(h))
    return h


@pytest.fixture(autouse=True)
def _close_what_the_test_made():
    """Closes the connections of every handler the test made, as its process's exit would
    (the tests leave the rendezvous open or closed as they need; only sockets are released)."""
    yield
    while _MADE:
        h = _MADE.pop()()
        if h is None:
            continue
        h._stop_heartbeats()
        h._close_side()
        h._wstore.close()
        h._store.close()


def _wait_key(store, key, timeout=10.0):
    store.wait([key], timedelta(seconds=timeout))


def test_assign_ranks_keeps_preferences_then_join_order():
    assert assign_ranks([-1, -1, -1], 3) == [0, 1, 2]
    assert assign_ranks([2, -1, 0], 3) == [2, 1, 0]
    assert assign_ranks([1, 1, -1], 3) == [1, 0, 2]  # conflict: first by join order wins
    assert assign_ranks([7, 0, -1], 3) == [1, 0, 2]  # out of range is ignored
    ranks = assign_ranks([5, 3, 3, -1, 0, 9], 6)
    assert sorted(ranks) == list(range(6)) and ranks[0] == 5 and ranks[1] == 3


def test_max_nodes_completes_without_waiting_for_last_call(server, nodes):
    handlers = [_handler(server.port, 2, 3, last_call=60) for _ in range(3)]
    t0 = time.monotonic()
    for i, h in enumerate(handlers):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors
    assert time.monotonic() - t0 < 10  # far below the 60 s last call
    infos = [nodes.results[i] for i in range(3)]
    assert sorted(x.rank for x in infos) == [0, 1, 2]
    assert {x.world_size for x in infos} == {3}
    boots = {(x.bootstrap_store_info.master_addr, x.bootstrap_store_info.master_port)
             for x in infos}
    assert len(boots) == 1      # one worker store per round, hosted by rank 0
    (addr, port), = boots
    assert port != server.port
    workers = TCPStore(addr, port, timeout=5)
    assert workers.num_keys() == 0    # fresh: nothing of the rendezvous in it
    infos[0].store.set("k", b"v")  # the round's store is shared (prefixed per round)
    assert infos[2].store.get("k") == b"v"


def test_last_call_completes_with_min_nodes_and_late_node_waits(server, nodes):
    a, b = (_handler(server.port, 2, 4, last_call=1.0) for _ in range(2))
    t0 = time.monotonic()
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(20)
    elapsed = time.monotonic() - t0
    assert not nodes.errors
    assert 1.0 <= elapsed < 10
    assert {nodes.results[i].world_size for i in (0, 1)} == {2}
    assert a.num_nodes_waiting() == 0
    late = _handler(server.port, 2, 4, last_call=1.0, join=30)
    nodes.start(2, lambda i: late.next_rendezvous())
    _wait_key(server, f"fe.rdzv.{RUN}/1/n/1")  # the late node holds a ticket of the next round
    assert a.num_nodes_waiting() == 1 and b.num_nodes_waiting() == 1
    assert 2 not in nodes.results  # still waiting: members have not re-joined
    # Members re-rendezvous (as agents do when num_nodes_waiting() > 0): all three form round 1,
    # and the members keep their ranks.
    ranks_before = {id(a): nodes.results[0].rank, id(b): nodes.results[1].rank}
    nodes.start(3, lambda i: a.next_rendezvous())
    nodes.start(4, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors
    assert {nodes.results[i].world_size for i in (2, 3, 4)} == {3}
    assert nodes.results[3].rank == ranks_before[id(a)]
    assert nodes.results[4].rank == ranks_before[id(b)]
    assert nodes.results[2].rank == 2


def test_join_timeout(server):
    h = _handler(server.port, 2, 2, join=1.0)
    t0 = time.monotonic()
    with pytest.raises(RendezvousTimeoutError):
        h.next_rendezvous()
    assert 0.9 <= time.monotonic() - t0 < 5
    # The timed-out node gave up its ticket: the round is abandoned, later nodes form a new one.
    assert server.get(f"fe.rdzv.{RUN}/0/res").startswith(b"D")


def test_set_closed_wakes_waiters_and_refuses_new_joins(server, nodes):
    waiter = _handler(server.port, 3, 3)
    nodes.start(0, lambda i: waiter.next_rendezvous())
    _wait_key(server, f"fe.rdzv.{RUN}/0/n/1")
    closer = _handler(server.port, 3, 3)
    assert not closer.is_closed()
    t0 = time.monotonic()
    closer.set_closed()
    nodes.join(10)
    assert time.monotonic() - t0 < 5
    assert isinstance(nodes.errors[0], RendezvousClosedError)
    assert closer.is_closed() and waiter.is_closed()
    with pytest.raises(RendezvousClosedError):
        _handler(server.port, 3, 3).next_rendezvous()


def test_shutdown_closes_the_rendezvous(server, nodes):
    a, b = _handler(server.port, 2, 2), _handler(server.port, 2, 2)
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors
    assert a.shutdown() is True
    assert b.is_closed()
    with pytest.raises(RendezvousClosedError):
        b.next_rendezvous()


def test_requested_node_ranks_are_kept(server, nodes):
    hs = [_handler(server.port, 4, 4, rank=r) for r in (3, -1, 1, -1)]
    for i, h in enumerate(hs):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors
    assert nodes.results[0].rank == 3 and nodes.results[2].rank == 1
    assert sorted(nodes.results[i].rank for i in range(4)) == [0, 1, 2, 3]


_CHILD = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from fastelastic.store import TCPStore
    from fastelastic.rendezvous.fast.fast_rendezvous import FastRendezvousHandler
    from fastelastic.rendezvous.timeouts import RendezvousTimeout
    store = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=timedelta(seconds=30))
    h = FastRendezvousHandler("job", store, "c10d", 2, 4,
                              RendezvousTimeout(last_call=timedelta(seconds=60)))
    h.next_rendezvous()
""")


@pytest.mark.timeout(60)
def test_sigkilled_node_mid_join_is_noticed_within_a_second(server, nodes):
    a, b = (_handler(server.port, 2, 4, last_call=60) for _ in range(2))
    nodes.start(0, lambda i: a.next_rendezvous())
    _wait_key(server, f"fe.rdzv.{RUN}/0/n/1")
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(server.port)])
    try:
        _wait_key(server, f"fe.rdzv.{RUN}/0/n/2")  # the child is ticket 2: the coordinator
        nodes.start(1, lambda i: b.next_rendezvous())
        _wait_key(server, f"fe.rdzv.{RUN}/0/n/3")
        t0 = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        # Both survivors abandon round 0 and re-join round 1 well within a second.
        server.wait([f"fe.rdzv.{RUN}/1/n/1", f"fe.rdzv.{RUN}/1/n/2"], timedelta(seconds=1))
        noticed = time.monotonic() - t0
    finally:
        child.kill()
        child.wait()
    assert noticed < 1.0
    assert server.get(f"fe.rdzv.{RUN}/0/res").startswith(b"D")
    a.set_closed()  # from this thread while a's own join is blocked in another one
    nodes.join(10)
    assert all(isinstance(e, RendezvousClosedError) for e in nodes.errors.values()), nodes.errors


@pytest.mark.timeout(60)
def test_hung_member_is_dropped_by_keepalive(server, nodes):
    a, b = (_handler(server.port, 1, 2, last_call=0.2, ka=0.2, ka_max=2) for _ in range(2))
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors and nodes.results[0].world_size == 2
    a._stop_heartbeats()  # a is hung: connected, never re-joins, no keep-alives
    t0 = time.monotonic()
    info = b.next_rendezvous()
    # Dropped after two silent windows of 0.4 s; without the keep-alive check b would wait
    # for the 20 s join timeout.
    assert info.world_size == 1 and info.rank == 0
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("local_addr,reachable_on_other_address",
                         [("127.0.0.1", False), ("localhost", True)])
def test_the_workers_store_listens_only_on_the_workers_address(server, local_addr,
                                                              reachable_on_other_address):
    """The workers' store cannot require a token (torch's clients cannot answer one), so it
    listens only on the address the workers are given when that is an address."""
    import socket

    store = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=30))
    timeout = RendezvousTimeout(join=timedelta(seconds=20), last_call=timedelta(seconds=0.01))
    h = FastRendezvousHandler(RUN, store, "c10d", 1, 1, timeout, local_addr=local_addr)
    try:
        info = h.next_rendezvous()
        boot = info.bootstrap_store_info
        assert boot.master_addr == local_addr
        assert TCPStore(boot.master_addr, boot.master_port, timeout=5).num_keys() == 0
        with socket.socket() as s:  # another address of this host
            s.settimeout(5)
            rc = s.connect_ex(("127.0.0.2", boot.master_port))
        assert (rc == 0) is reachable_on_other_address, os.strerror(rc)
    finally:
        h.shutdown()


def _beating(h_id: int) -> bool:
    from fastelastic.rendezvous.fast._liveness import BEATER

    with BEATER._cond:
        return h_id in BEATER._due


def _until(pred, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def test_keepalives_stop_once_the_store_is_gone_for_a_window(caplog):
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)
    h = _handler(host.port, 1, 1, last_call=0.01, ka=0.1, ka_max=2)
    assert h.next_rendezvous().world_size == 1
    assert _beating(id(h))
    host.shutdown_server()
    # The others count it gone after 0.2 s; the beater must not retry a dead store forever.
    with caplog.at_level("WARNING", logger="fastelastic.rendezvous.fast_rendezvous"):
        assert _until(lambda: not _beating(id(h)), 20)
    assert any("no keep-alive got through" in r.getMessage() for r in caplog.records)


def test_a_handler_dropped_without_shutdown_stops_beating(server):
    import gc
    import weakref

    h = _handler(server.port, 1, 1, last_call=0.01, ka=0.1, ka_max=50)
    assert h.next_rendezvous().world_size == 1
    h_id, ref = id(h), weakref.ref(h)
    assert _beating(h_id)
    del h
    gc.collect()
    assert ref() is None  # the beater holds it weakly
    assert _until(lambda: not _beating(h_id), 10)


def test_a_full_round_does_not_wait_for_a_frozen_member_of_the_last(server, nodes):
    """A replacement node and the survivors fill the next round (max_nodes): it completes
    without waiting for the frozen member's keep-alive window (here 300 s, far beyond the
    20 s join timeout)."""
    hs = [_handler(server.port, 3, 3, last_call=0.2, ka=10, ka_max=30) for _ in range(3)]
    for i, h in enumerate(hs):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors and {nodes.results[i].world_size for i in range(3)} == {3}
    frozen = hs[2]
    frozen._stop_heartbeats()  # frozen: connected, silent, never re-joins
    old = {i: nodes.results[i].rank for i in range(3)}
    replacement = _handler(server.port, 3, 3, last_call=0.2, ka=10, ka_max=30)
    nxt = type(nodes)()
    for i, h in enumerate([hs[0], hs[1], replacement]):
        nxt.start(i, lambda i, h=h: h.next_rendezvous())
    nxt.join(20)
    assert not nxt.errors, nxt.errors
    assert sorted(nxt.results[i].rank for i in range(3)) == [0, 1, 2]
    # the survivors left round 0 as they re-joined; the frozen member was not dropped as
    # silent: nobody waited for its window
    left = f"fe.rdzv.{RUN}/0/left/"
    assert server.check([left + str(old[0]), left + str(old[1])])
    assert not server.check([left + str(old[2])])
    frozen.shutdown()


def test_connection_loss_is_a_rendezvous_connection_error():
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    h = _handler(host.port, 2, 2, join=30)
    host.shutdown_server()
    with pytest.raises(RendezvousConnectionError):
        h.next_rendezvous()


def test_registry_c10d_hosts_store_on_endpoint_port(nodes):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = [RendezvousParameters(name, f"127.0.0.1:{port}", "reg", 2, 2, local_addr="127.0.0.1",
                                   last_call_timeout=0, join_timeout=20)
              for name in ("c10d", "fastelastic")]
    first = get_rendezvous_handler(params[0])  # the endpoint is this machine: it hosts
    second = get_rendezvous_handler(params[1])
    assert first.get_backend() == "c10d" and second.get_backend() == "fastelastic"
    assert first.use_agent_store and first.get_run_id() == "reg"
    assert first._server is not None  # multi_tenant: in one process both share that server
    nodes.start(0, lambda i: first.next_rendezvous())
    nodes.start(1, lambda i: second.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors
    assert sorted(nodes.results[i].rank for i in (0, 1)) == [0, 1]
    ports = {nodes.results[i].bootstrap_store_info.master_port for i in (0, 1)}
    assert len(ports) == 1 and ports != {port}  # the round's own worker store


def test_messages_per_node_do_not_grow_with_n(server):
    from counting import CountingStore, run_counted

    # the deciders' keep-alives looked at every 37 s, not 1.25 s: on a busy machine (pytest -n)
    # the round of 64 outlasted a quarter window and its nodes' median was one request more
    small = run_counted(server.port, "m8", 8, keep_alive_interval=30.0)
    large = run_counted(server.port, "m64", 64, keep_alive_interval=30.0)
    # Constant in N: every node (the publisher included) sends the same few requests.
    assert max(small) <= 20 and max(large) == max(small)
    assert sorted(small)[len(small) // 2] == sorted(large)[len(large) // 2]
    assert CountingStore  # the proxy is importable for the benchmark too


def test_fast_protocol_runs_on_torchs_tcpstore_server(nodes):
    """Without our server's extensions (no disconnect hooks) the protocol still forms groups."""
    dist = pytest.importorskip("torch.distributed",
                               reason="!!! torch not installed: cannot test against its store")
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         multi_tenant=True)
    handlers = [_handler(host.port, 3, 3) for _ in range(3)]
    assert not handlers[0]._m.cfg.hooks  # our client reports no extensions on torch's server
    for i, h in enumerate(handlers):
        nodes.start(i, lambda i, h=h: h.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors, nodes.errors
    assert sorted(nodes.results[i].rank for i in range(3)) == [0, 1, 2]


def test_rendezvous_events_are_recorded(server, nodes):
    import json
    import logging

    from fastelastic import events

    records: list[str] = []

    class Capture(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    previous = events.get_logging_handler("dynamic_rendezvous")
    events.register_handler("dynamic_rendezvous", Capture(), replace=True)
    try:
        hs = [_handler(server.port, 2, 2, run_id="ev") for _ in range(2)]
        for i, h in enumerate(hs):
            nodes.start(i, lambda i, h=h: h.next_rendezvous())
        nodes.join(20)
        assert not nodes.errors
    finally:
        events.register_handler("dynamic_rendezvous", previous, replace=True)
    done = [json.loads(r) for r in records if '"SUCCEEDED"' in r]
    assert len(done) == 2
    assert sorted(e["rank"] for e in done) == [0, 1]
    assert {e["run_id"] for e in done} == {"ev"}


def test_each_round_gives_workers_a_fresh_store(server, nodes):
    """A restarted group must not read the dead attempt's keys (gloo's peer addresses)."""
    handlers = [_handler(server.port, 2, 2, last_call=30) for _ in range(2)]
    boots = []
    for _ in range(2):
        for i, h in enumerate(handlers):
            nodes.start(i, lambda i, h=h: h.next_rendezvous())
        nodes.join(20)
        assert not nodes.errors
        info = nodes.results[0].bootstrap_store_info
        boots.append((info.master_addr, info.master_port))
        assert {nodes.results[i].bootstrap_store_info.master_port for i in (0, 1)} == {
            info.master_port}
        workers = TCPStore(info.master_addr, info.master_port, timeout=5)
        assert workers.num_keys() == 0                 # nothing left from the last attempt
        workers.set("default_pg/0//0", b"addr-of-attempt")
    assert boots[0][1] != boots[1][1]
    with pytest.raises(StoreConnectionError):          # the old attempt's store is gone
        TCPStore(boots[0][0], boots[0][1], timeout=0.5)
    for h in handlers:
        h.shutdown()


@pytest.mark.parametrize("backend", ["c10d", "fastelastic", "c10d-v2"])
def test_hosting_on_an_unresolvable_endpoint_is_a_connection_error(backend):
    """As torch's c10d backend (which needs read_timeout to find out): fails, and at once."""
    params = RendezvousParameters(backend=backend, endpoint="no-such-host.invalid:0",
                                  run_id="unresolvable", min_nodes=1, max_nodes=1,
                                  is_host="true", read_timeout="5")
    t0 = time.monotonic()
    with pytest.raises(RendezvousConnectionError, match="no-such-host.invalid"):
        get_rendezvous_handler(params)
    assert time.monotonic() - t0 < 3


def test_c10d_create_backend_on_an_unresolvable_endpoint_like_torch():
    from fastelastic.rendezvous.c10d_rendezvous_backend import create_backend

    conf = {"is_host": "true", "read_timeout": "1"}
    with pytest.raises(RendezvousConnectionError):
        create_backend(RendezvousParameters("c10d", "no-such-host.invalid:0", "u", 1, 1, **conf))
    try:
        from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParams
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as torch_c10d
        from torch.distributed.elastic.rendezvous.api import (
            RendezvousConnectionError as TorchConnectionError,
        )
    except ImportError:  # pragma: no cover - CI installs torch
        pytest.skip("!!! torch is not installed: not compared with torch's c10d backend")
    with pytest.raises(TorchConnectionError):
        torch_c10d.create_backend(TorchParams("c10d", "no-such-host.invalid:0", "u", 1, 1, **conf))


def test_a_spare_takes_a_frozen_members_seat_before_the_full_window(server, nodes):
    """A full round (min = max = 2) with a spare waiting behind it: the spare restarts
    nobody (num_nodes_waiting is 0), and a member that freezes is suspected after the shorter
    spare window (max(2 intervals, window / 2) = 1 s here, the window being 2 s); the
    survivor and the spare then form the next round."""
    a, b = (_handler(server.port, 2, 2, last_call=0.2, ka=0.2, ka_max=10) for _ in range(2))
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors and nodes.results[1].world_size == 2
    spare = _handler(server.port, 2, 2, last_call=0.2, ka=0.2, ka_max=10)
    later = type(nodes)()
    later.start(0, lambda i: spare.next_rendezvous())
    _wait_key(server, f"fe.rdzv.{RUN}/1/t")
    assert b.num_nodes_waiting() == 0  # a spare restarts nobody
    a._stop_heartbeats()  # a froze: connected, no keep-alives
    frozen_at = time.monotonic()
    lost: list = []
    while not lost and time.monotonic() - frozen_at < 10:
        b.num_nodes_waiting()  # the agent's membership check: spare count, then lost members
        lost = b.lost_members()
        time.sleep(0.05)
    took = time.monotonic() - frozen_at
    assert [r for r, _ in lost] == [nodes.results[0].rank], lost
    assert "a spare is ready" in lost[0][1]
    assert took < b._window, f"suspected after {took:.2f}s, the full window is {b._window}s"
    later.start(1, lambda i: b.next_rendezvous())
    later.join(20)
    assert not later.errors, later.errors
    assert sorted(later.results[i].rank for i in range(2)) == [0, 1]
    assert {later.results[i].world_size for i in range(2)} == {2}
    for h in (a, b, spare):
        h.shutdown()


class _SlowTicket:
    """A store proxy whose ticket ``add`` in round 1 is slow (a node on a loaded host)."""

    def __init__(self, inner, delay: float) -> None:
        self._inner, self._delay = inner, delay

    def add(self, key, value):
        if key.endswith("/1/t") and value == 1:
            time.sleep(self._delay)  # the slow host, not a synchronisation
        return self._inner.add(key, value)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def test_a_re_forming_round_is_sealed_only_after_every_returning_member_has_a_ticket(server,
                                                                                   nodes):
    """No last call on re-forming: the coordinator seals once every member of the last round
    is back. A member counts as back only once its ticket is taken, so one slow to take it is
    still in the round, not left waiting for the next."""
    a, b = (_handler(server.port, 2, 4, last_call=1.0) for _ in range(2))
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors
    late = _handler(server.port, 2, 4, last_call=1.0, join=30)
    nodes.start(2, lambda i: late.next_rendezvous())
    _wait_key(server, f"fe.rdzv.{RUN}/1/n/1")
    b._store = _SlowTicket(b._store, 0.5)
    nodes.start(3, lambda i: a.next_rendezvous())
    nodes.start(4, lambda i: b.next_rendezvous())
    nodes.join(20)
    assert not nodes.errors, nodes.errors
    assert {nodes.results[i].world_size for i in (2, 3, 4)} == {3}
    for h in (a, b, late):
        h.shutdown()


def test_shutdown_closes_every_connection_the_handler_made(server):
    """While a rendezvous holds the handler's connection, another thread's call goes over a
    second connection the handler makes; the handler owns both and closes them at shutdown."""
    h = _handler(server.port, 1, 1)
    base = server.server.num_connections
    with h._lock:  # as next_rendezvous holds it during a long wait
        t = threading.Thread(target=h.is_closed)
        t.start()
        t.join(10)
    assert server.server.num_connections == base + 1  # the second connection, kept for reuse
    assert h.shutdown()
    deadline = time.monotonic() + 10
    while server.server.num_connections > base - 1 and time.monotonic() < deadline:
        time.sleep(0.01)  # bounded: the server sees the close asynchronously
    assert server.server.num_connections == base - 1  # its own connection closed too


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_refused(port: int, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
        except ConnectionRefusedError:
            return
        time.sleep(0.01)  # bounded: the server closes its listener asynchronously
    raise AssertionError(f"127.0.0.1:{port} still accepts connections")


@pytest.mark.parametrize("path", ["closed", "could-not-close"])
def test_shutdown_closes_the_store_the_handler_hosts_on_every_path(path, monkeypatch):
    """An in-process launch kept the hosted store's port (and its client) until garbage
    collection when the handler had one endpoint, or when closing failed."""
    port = _free_port()
    params = RendezvousParameters(backend="c10d", endpoint=f"127.0.0.1:{port}",
                                  run_id="owned", min_nodes=1, max_nodes=1, is_host="true",
                                  read_timeout="5")
    h = get_rendezvous_handler(params)
    assert h.next_rendezvous().world_size == 1
    if path == "could-not-close":
        def fail() -> None:
            raise RendezvousConnectionError("injected: the store did not answer")

        monkeypatch.setattr(h, "set_closed", fail)
    assert h.shutdown() is (path == "closed")
    _wait_refused(port)
    with pytest.raises(StoreConnectionError):
        TCPStore("127.0.0.1", port, timeout=0.5)
    h.shutdown()  # idempotent
    assert h.is_closed()  # as torch's: closed for good, without its store
    with pytest.raises(RendezvousClosedError):
        h.next_rendezvous()


def test_a_normal_end_is_quiet_on_the_node_whose_store_host_left_first(server, caplog):
    """At a normal end the host closes the rendezvous and exits; a node that shuts down after
    it cannot reach the store. That used to be a warning in every such job's log."""
    caplog.set_level(logging.INFO, logger="fastelastic.rendezvous")
    h = _handler(server.port, 1, 1)
    assert h.next_rendezvous().world_size == 1
    server.shutdown_server()  # the host is gone
    assert h.shutdown() is False
    said = [r for r in caplog.records if "shutdown" in r.getMessage() or "gone" in r.getMessage()]
    assert said and all(r.levelno < logging.WARNING for r in said), [
        (r.levelname, r.getMessage()) for r in said]

class _Term(Exception):
    """What the agent's SIGTERM handler raises (torch's SignalException), here from SIGALRM."""


@pytest.mark.timeout(60)
def test_a_signal_during_a_rendezvous_wait_still_announces_the_leave(server, nodes):
    """A SIGTERM that lands while next_rendezvous waits breaks the handler's connection (the
    request was cut short); the leave the agent then announces must still reach the round:
    ``<rank>:quit;`` in its gone, so nobody counts this node as alive elsewhere."""
    a, b = (_handler(server.port, 2, 2) for _ in range(2))
    nodes.start(0, lambda i: a.next_rendezvous())
    nodes.start(1, lambda i: b.next_rendezvous())
    nodes.join(30)
    assert not nodes.errors
    rank = a._m.member.rank

    def term(signum, frame):
        raise _Term()

    old = signal.signal(signal.SIGALRM, term)
    try:
        # a re-joins (b does not: round 1 waits for it) and is signalled there
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(_Term):
            a.next_rendezvous()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(StoreConnectionError):
        a._store.get(f"fe.rdzv.{RUN}/0/res")  # the signal broke the handler's connection
    a.leave()
    gone = server.get(f"fe.rdzv.{RUN}/0/gone")
    assert b"%d:left;" % rank in gone and b"%d:quit;" % rank in gone, gone


@pytest.mark.timeout(60)
def test_two_threads_that_lose_the_store_at_once_move_the_rendezvous_once(caplog, nodes):
    """Moves are serialised: the membership check of one thread and another call that both
    failed on the lost store move the rendezvous once (to the next candidate, proposing epoch
    1), not once each (the second, seeing the first one's new store as its own, moved on
    again: epoch 2 on the third candidate)."""
    from fastelastic.rendezvous.fast.fast_rendezvous import create_fast_handler

    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=timedelta(seconds=30)) for _ in range(3)]
    try:
        endpoint = ",".join(f"127.0.0.1:{s.port}" for s in stores)
        params = RendezvousParameters("c10d", endpoint, RUN, 1, 1, is_host=False,
                                      read_timeout=5, last_call_timeout=1)
        h = create_fast_handler(params)
        _MADE.append(weakref.ref(h))
        assert h.next_rendezvous().world_size == 1 and h._live.index == 0
        stores[0].shutdown_server()                # the live store's host is lost
        failed = h._store
        real, arrived = h._move, threading.Barrier(2, timeout=10)

        def move_together(why, store):             # both failed before either moves
            arrived.wait()
            return real(why, store)

        h._move = move_together
        nodes.start(0, lambda i: h.lost_members())
        nodes.start(1, lambda i: h._move(StoreConnectionError("lost"), failed))
        nodes.join(30)
        assert not nodes.errors, nodes.errors
        assert (h._live.index, h._live.proposed) == (1, 1)
        # the move is proposed (a mark), not committed: no round formed there yet
        assert [s.add(f"fe.rdzv.{RUN}/epoch", 0) for s in stores[1:]] == [0, 0]
        mark = b"1|%s;" % h._node.encode()  # one move: its mark on two of the three (a quorum)
        assert [s.get(f"fe.rdzv.{RUN}/moving") for s in stores[1:]] == [mark, mark]
        assert sum("moved to" in r.getMessage() for r in caplog.records) == 1
    finally:
        for s in stores[1:]:
            s.shutdown_server()


@pytest.mark.timeout(60)
def test_a_node_that_gives_up_never_closes_a_store_it_formed_no_world_on():
    """A node that moved alone (its move not committed) and gives up (join timeout, signal)
    leaves that store open: the nodes started later are not told the job is closed. On the
    store where it was a member of a round, its shutdown closes the rendezvous as before."""
    from fastelastic.rendezvous.fast.fast_rendezvous import create_fast_handler

    stores = [TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=timedelta(seconds=30)) for _ in range(3)]
    closed = f"fe.rdzv.{RUN}/closed"
    try:
        endpoint = ",".join(f"127.0.0.1:{s.port}" for s in stores)
        params = RendezvousParameters("c10d", endpoint, RUN, 1, 1, is_host=False,
                                      read_timeout=5, last_call_timeout=1)
        moved = create_fast_handler(params)
        stays = create_fast_handler(RendezvousParameters(  # a job of its own on the stores
            "c10d", endpoint, RUN + "2", 1, 1, is_host=False, read_timeout=5,
            last_call_timeout=1))
        _MADE.extend([weakref.ref(moved), weakref.ref(stays)])
        assert moved.next_rendezvous().world_size == 1
        moved._move(StoreConnectionError("cut"), moved._store)   # alone, to candidate 1
        assert moved._live.index == 1 and not moved._live.formed
        moved.shutdown()
        assert not stores[1].check([closed])
        assert stays.next_rendezvous().world_size == 1
        stays.shutdown()
        assert stores[0].check([f"fe.rdzv.{RUN}2/closed"])
    finally:
        for s in stores:
            s.shutdown_server()


@pytest.mark.timeout(60)
def test_the_proof_that_lost_members_are_nowhere_else():
    """``gone_elsewhere``: proven once the proof's fences are read back from two of the three
    candidates (the live one and the one that answers; the refused one is no answer) with no
    mark of them before a fence; a mark of one of them before it, or too few answers (the
    refused one, and one that accepts and never replies: a frozen host), blocks it and says
    why. A mark after a proof's fence comes too late (its mover is fenced)."""
    import socket

    from fastelastic.rendezvous.fast.failover._failover import Candidates

    live, other = (TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                            timeout=timedelta(seconds=30)) for _ in range(2))
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_port = dead.getsockname()[1]
    dead.close()                                   # nothing listens: refused
    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(8)                               # accepts in the kernel, never answers
    try:
        ports = [live.port, dead_port, other.port]
        c = Candidates(RUN, [("127.0.0.1", p) for p in ports], False, timedelta(seconds=5))
        idents = ["10.0.0.1|11", "10.0.0.2|22"]
        other.append(f"fe.rdzv.{RUN}/moving", b"1|10.0.0.2|22;")
        assert c.gone_elsewhere(0, idents) == (f"['10.0.0.2|22'] moved: marked on "
                                               f"127.0.0.1:{other.port} before any fence")
        assert c.gone_elsewhere(0, idents[:1]) == ""
        other.append(f"fe.rdzv.{RUN}/moving", b"1|10.0.0.1|11;")  # after the fence: too late
        assert c.gone_elsewhere(0, idents[:1]) == ""
        c.endpoints[2] = ("127.0.0.1", frozen.getsockname()[1])
        t0 = time.monotonic()
        why = c.gone_elsewhere(0, idents)
        assert "did not answer" in why and "refused" in why and "fewer than 2 of the 3" in why
        assert time.monotonic() - t0 < 10
    finally:
        frozen.close()
        for s in (live, other):
            s.shutdown_server()


def test_the_handler_rejects_a_request_that_is_not_a_typed_op(server):
    h = _handler(server.port, 1, 1)

    def legacy():
        yield ("check", ["k"])  # the tuples of before the typed requests

    with pytest.raises(TypeError, match=r"not a rendezvous store request: \('check'"):
        h._run(legacy(), h._store)


@pytest.mark.parametrize("finished", [True, False], ids=["host-finished", "host-lost"])
def test_a_finished_store_host_is_told_from_a_lost_one(nodes, finished):
    """The store's host (one endpoint) writes 'host' with its 'done': a member that read it
    before the store went says ``store_host_finished`` and sends no keep-alive after the loss;
    a host gone without it (lost) is not taken for a finished one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    params = [RendezvousParameters("c10d", f"127.0.0.1:{port}", f"fin{finished}", 2, 2,
                                   local_addr="127.0.0.1", last_call_timeout=0, join_timeout=20,
                                   is_host=host)
              for host in (True, False)]
    host, member = (get_rendezvous_handler(p) for p in params)
    assert host._server is not None and member._server is None
    try:
        nodes.start(0, lambda i: host.next_rendezvous())
        nodes.start(1, lambda i: member.next_rendezvous())
        nodes.join(20)
        assert not nodes.errors
        assert member.lost_members() == [] and not member.store_host_finished
        if finished:
            host.mark_done()  # fire-and-forget on the host's own connection
        assert member.lost_members() == []  # a finished host is no lost member
        deadline = time.monotonic() + 10.0
        while finished and not member.store_host_finished and time.monotonic() < deadline:
            assert member.lost_members() == []  # until the host's append reached the store
        assert member.store_host_finished is finished
        assert not host.store_host_finished  # it never read its own mark
        host._server.shutdown_server()  # the store goes with its host
        with pytest.raises(RendezvousConnectionError):
            member.num_nodes_waiting()
        assert member.store_host_finished is finished
        assert _beating(id(member)) is not finished  # nobody is left to hear them
    finally:
        for h in (host, member):
            h._stop_heartbeats()
            h._close_side()
            h._wstore.close()
            h._store.close()


def test_host_entry_in_gone_changes_no_reason():
    from fastelastic.rendezvous.fast._schema import host_finished, parse_gone

    raw = b"1:closed;0:done;0:host;t3:closed;0:closed;"
    assert parse_gone(raw) == {1: "closed", 0: "done"}
    assert host_finished(raw) and not host_finished(b"0:done;1:closed;t2:closed;")
