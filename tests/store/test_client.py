"""fastelastic.store.TCPStore and PrefixStore through their public API, on our own server."""

from __future__ import annotations

import gc
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from fastelastic.errors import (
    QueueEmptyError,
    StoreConnectionError,
    StoreError,
    StoreTimeoutError,
)
from fastelastic.store import PrefixStore, TCPStore
from fastelastic.store.auth import TOKEN_FILE_ENV

from .conftest import wait_until
from .fdtest import isolated


def client(master, **kw):
    return TCPStore("127.0.0.1", master.port, timeout=kw.pop("timeout", 10), **kw)


def test_basic_operations(master):
    c = client(master)
    assert c.supports_extensions
    c.set("a", "1")
    c.set("b", b"\x00\xff")
    assert master.get("a") == b"1" and c.get("b") == b"\x00\xff"
    assert c.add("n", 5) == 5 and c.add("n", -7) == -2 and c.get("n") == b"-2"
    assert c.compare_set("a", "1", "2") == b"2"
    assert c.compare_set("a", "x", "3") == b"2"
    assert c.check(["a", "b"]) and not c.check(["a", "zz"])
    c.append("a", "tail")
    assert c.get("a") == b"2tail"
    assert c.delete_key("a") and not c.delete_key("a")
    c.multi_set(["m1", "m2"], ["v1", b"v2"])
    assert c.multi_get(["m2", "m1", "m2"]) == [b"v2", b"v1", b"v2"]
    assert sorted(c.list_keys()) == ["b", "m1", "m2", "n"]
    assert c.num_keys() == 4


def test_get_waits_for_a_later_set(master):
    c = client(master)
    threading.Timer(0.05, lambda: master.set("late", "v")).start()
    assert c.get("late") == b"v"
    threading.Timer(0.05, lambda: master.multi_set(["l1", "l2"], ["1", "2"])).start()
    assert c.multi_get(["l1", "l2"]) == [b"1", b"2"]


def test_get_timeout_raises_and_client_stays_usable(master):
    c = client(master, timeout=timedelta(milliseconds=200))
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError) as err:
        c.get("never")
    assert 0.19 < time.monotonic() - start < 5
    assert isinstance(err.value, RuntimeError) and isinstance(err.value, TimeoutError)
    assert "/never" in str(err.value)
    with pytest.raises(StoreTimeoutError):
        c.multi_get(["never", "x"])
    with pytest.raises(StoreTimeoutError):
        c.wait(["never"], timedelta(milliseconds=50))
    c.set("k", "v")
    assert c.get("k") == b"v"
    assert master.server.waiting == 0


def test_wait_and_timeout_override(master):
    c = client(master)
    master.set("w1", "1")
    c.wait(["w1"])
    threading.Timer(0.05, lambda: master.set("w2", "1")).start()
    c.wait(["w1", "w2"], timedelta(seconds=5))
    c.set_timeout(timedelta(seconds=3))
    assert c.timeout == timedelta(seconds=3)


def test_barrier(master):
    clients = [client(master) for _ in range(4)]
    errors = []

    def arrive(c):
        try:
            c.barrier("bar", 4, timedelta(seconds=10))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=arrive, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors and not any(t.is_alive() for t in threads)
    with pytest.raises(StoreTimeoutError):
        clients[0].barrier("bar2", 2, timedelta(milliseconds=100))
    assert clients[1].get("bar2") == b"1"


def test_queues(master):
    c = client(master, timeout=timedelta(milliseconds=300))
    with pytest.raises(QueueEmptyError):
        c.queue_pop("q", block=False)
    c.queue_push("q", "a")
    c.queue_push("q", b"b")
    assert c.queue_len("q") == 2
    assert c.queue_pop("q") == b"a" and c.queue_pop("q", block=False) == b"b"
    threading.Timer(0.05, lambda: master.queue_push("q", "late")).start()
    assert c.queue_pop("q") == b"late"
    with pytest.raises(StoreTimeoutError):
        c.queue_pop("q")


def test_prefix_store(master):
    p = PrefixStore("job", client(master))
    p.set("a", "1")
    assert master.get("job/a") == b"1"
    assert p.get("a") == b"1" and p.add("n", 2) == 2
    p.multi_set(["x", "y"], ["1", "2"])
    assert p.multi_get(["x", "y"]) == [b"1", b"2"]
    assert sorted(p.list_keys()) == ["a", "n", "x", "y"]
    nested = PrefixStore("inner", p)
    nested.set("k", "v")
    assert master.get("job/inner/k") == b"v"


def test_shared_between_threads(master):
    c = client(master)
    n_threads, n_ops = 8, 200

    def work(i):
        for j in range(n_ops):
            c.set(f"t{i}/{j}", str(j))
            assert c.get(f"t{i}/{j}") == str(j).encode()
            c.add("total", 1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert c.get("total") == str(n_threads * n_ops).encode()


def test_clone_is_a_new_connection(master):
    c = client(master)
    before = master.server.num_connections
    d = c.clone()
    d.set("cl", "1")
    assert c.get("cl") == b"1"
    assert master.server.num_connections == before + 1


def test_world_size_wait_for_workers():
    port_holder = {}
    result = {}

    def run_master():
        m = TCPStore("127.0.0.1", 0, world_size=3, is_master=True, timeout=10,
                     master_listen_fd=port_holder["fd"])
        result["master"] = m

    lsock = socket.socket()
    lsock.bind(("127.0.0.1", 0))
    lsock.listen(64)
    port = lsock.getsockname()[1]
    port_holder["fd"] = lsock.fileno()
    t = threading.Thread(target=run_master)
    t.start()
    workers = [TCPStore("127.0.0.1", port, world_size=3, timeout=10) for _ in range(2)]
    t.join(15)
    m = result["master"]
    assert m.port == port
    assert m._add_unprefixed(b"init/", 0) == 3
    assert workers[0].num_keys() == 1            # only init/
    m.shutdown_server()
    lsock.close()


def test_wait_for_workers_times_out():
    with pytest.raises(StoreTimeoutError, match="1 connected"):
        TCPStore("127.0.0.1", 0, world_size=2, is_master=True, timeout=0.3)


def test_multi_tenant_shares_one_server():
    a = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=5)
    b = TCPStore("127.0.0.1", a.port, is_master=True, multi_tenant=True, timeout=5)
    assert a.server is b.server
    a.set("shared", "1")
    assert b.get("shared") == b"1"
    a.shutdown_server()
    assert b.get("shared") == b"1"          # still served: b holds a reference
    b.shutdown_server()


def test_multi_tenant_store_shut_down_then_collected_releases_once():
    """shutdown_server() releases the store's reference; collecting it must not release again."""
    a = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=5)
    b = TCPStore("127.0.0.1", a.port, is_master=True, multi_tenant=True, timeout=5)
    a.shutdown_server()
    del a
    gc.collect()
    b.set("after", "1")                      # b's tenancy keeps the server up
    assert b.get("after") == b"1"
    b.shutdown_server()


def test_multi_tenant_store_failing_its_handshake_releases_once(monkeypatch):
    """A tenant whose constructor fails gives its reference back once, not again when collected."""
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    token = b"multi-tenant-token-0123456789"
    a = TCPStore("127.0.0.1", 0, is_master=True, multi_tenant=True, timeout=5, token=token)
    with pytest.raises(StoreConnectionError, match="requires a token"):
        TCPStore("127.0.0.1", a.port, is_master=True, multi_tenant=True, timeout=5)
    gc.collect()
    a.set("after", "1")
    assert a.get("after") == b"1"
    a.shutdown_server()


def test_port_in_use_is_a_clear_error(master):
    with pytest.raises(StoreError, match="already in use"):
        TCPStore("127.0.0.1", master.port, is_master=True, timeout=1)


def test_unreachable_store_names_host_and_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{port}"):
        TCPStore("127.0.0.1", port, timeout=0.3)


def test_lost_connection_is_a_clear_error(master):
    c = client(master)
    c.set("x", "1")
    master.shutdown_server()
    with pytest.raises(StoreConnectionError, match=f"127.0.0.1:{master.port}"):
        c.get("x")
    with pytest.raises(StoreConnectionError):
        c.set("y", "1")


def test_connect_retries_until_server_appears(tmp_path):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = None
    try:
        def start_server():
            nonlocal proc
            proc = subprocess.Popen(
                [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port",
                 str(port)], stdout=subprocess.PIPE, text=True)
        threading.Timer(0.2, start_server).start()
        c = TCPStore("127.0.0.1", port, timeout=20)
        c.set("k", "v")
        assert c.get("k") == b"v"
        assert c.supports_extensions
    finally:
        wait_until(lambda: proc is not None, what="server started")
        proc.terminate()
        assert proc.wait(10) == 0


def test_standalone_server_bad_flag():
    out = subprocess.run([sys.executable, "-m", "fastelastic.store", "--port", "70000"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 2 and "--port must be in 0..65535" in out.stderr


def test_append_on_disconnect_runs_when_a_process_dies(master):
    code = (
        "import os, sys\n"
        "from fastelastic.store import TCPStore\n"
        f"s = TCPStore('127.0.0.1', {master.port}, timeout=10)\n"
        "s.append_on_disconnect('dead', 'node7;')\n"
        "s.set('registered', '1')\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert proc.returncode == -9
    c = client(master)
    assert c.get("dead") == b"node7;"



def test_disconnect_actions_registered_in_one_round_trip_all_run(master):
    """append_on_disconnect_many pipelines its registrations: every action runs, in order of
    the keys, the connection stays in step, and a prefix applies to each key."""
    c = client(master)
    c.append_on_disconnect_many(["a", "b", "a"], [b"1;", b"x", b"2;"])
    PrefixStore("p", c).append_on_disconnect_many(["k"], [b"v"])
    c.append_on_disconnect_many([], [])
    with pytest.raises(ValueError):
        c.append_on_disconnect_many(["a"], [])
    assert c.add("n", 1) == 1  # in step: the acknowledgements were all read
    assert not c.check(["a"])
    c.close()
    other = client(master)
    assert other.get("a") == b"1;2;" and other.get("b") == b"x" and other.get("p/k") == b"v"


def test_disconnect_actions_are_acknowledged_with_the_next_reply(master):
    """A registration does not wait for its acknowledgement: the next request reads it first.
    Thousands owed (more than a socket buffer of acks), then a wait, a timed-out get and a
    multi_get: each reply is its own; and a process that dies right after registering, with
    no request after it, still has its actions run."""
    c = client(master)
    for i in range(3000):
        c.append_on_disconnect(f"d{i % 7}", b"x")
    c.append_on_disconnect_many([f"m{i}" for i in range(3000)], [b"y"] * 3000)
    with pytest.raises(StoreTimeoutError):
        c.get("absent", timedelta(milliseconds=50))
    master.set("there", b"v")
    assert c.get("there", timedelta(seconds=5)) == b"v"
    c.append_on_disconnect("d0", b"z")
    assert c.multi_get(["there", "there"]) == [b"v", b"v"]
    c.close()
    other = client(master)
    assert other.get("d0") == b"x" * 429 + b"z" and other.get("m2999") == b"y"
    code = (
        "import os\n"
        "from fastelastic.store import TCPStore\n"
        f"s = TCPStore('127.0.0.1', {master.port}, timeout=10)\n"
        "s.append_on_disconnect_many(['gone1', 'gone2'], ['a', 'b'])\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert proc.returncode == -9
    assert other.get("gone1") == b"a" and other.get("gone2") == b"b"


def _frozen_host():
    """A store hosted by a process of its own, for freezing (SIGSTOP); (process, port)."""
    code = ("import time; from datetime import timedelta; "
            "from fastelastic.store import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
            "timeout=timedelta(seconds=30)); print(s.port, flush=True); time.sleep(120)")
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    return host, int(host.stdout.readline())


def _freeze(pid: int) -> None:
    """SIGSTOPs ``pid`` and returns once every thread of it is stopped (the stop is
    asynchronous: a server thread on the other CPU may still answer a request meanwhile)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # bounded re-check of the threads' states
        states = set()
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.add(f.read().rsplit(")", 1)[1].split()[0])
        if states == {"T"}:
            return
        time.sleep(0.001)
    raise AssertionError(f"pid {pid} did not stop: thread states {states}")


def test_one_way_requests_do_not_wait_for_acknowledgements_up_to_a_bound():
    """With the host frozen (SIGSTOP), disconnect actions and the one-way requests after them
    (multi_set, set) return without waiting for the acknowledgements owed, up to 4,096 of
    them; past that bound the next one waits for them (here: the reply deadline passes and
    the connection is given up). Thawed, a client that stayed within the bound is in step:
    the next reply is its own, and every write arrived."""
    host, port = _frozen_host()
    try:
        within = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=2))
        past = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=2))
        _freeze(host.pid)
        within.append_on_disconnect("gone", b"w;")
        within.multi_set(["a", "b"], [b"1", b"2"])  # no ack to wait for while frozen
        within.set("c", b"3")
        past.append_on_disconnect_many([f"k{i}" for i in range(4096)], [b"x"] * 4096)
        past.set("d", b"4")  # 4,096 owed: still within the bound
        past.append_on_disconnect("k", b"x")
        with pytest.raises(StoreConnectionError, match="did not answer"):
            past.set("e", b"5")  # 4,097 owed: waits for them, and the host is frozen
        os.kill(host.pid, signal.SIGCONT)
        assert within.add("n", 1) == 1  # reads its owed ack first, then its own reply
        assert within.multi_get(["a", "b", "c"]) == [b"1", b"2", b"3"]
        within.close()
        other = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=10))
        assert other.get("gone") == b"w;"  # the action registered while frozen ran
        assert other.get("d") == b"4"
        other.close()
        past.close()
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait(10)


def test_get_with_a_timeout_returns_or_times_out_and_stays_usable(master):
    c = client(master, timeout=30)
    start = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        c.get("late2", timedelta(milliseconds=100))
    assert time.monotonic() - start < 10  # not the store timeout
    threading.Timer(0.05, lambda: master.set("late2", "v")).start()
    assert c.get("late2", timedelta(seconds=10)) == b"v"


def test_ipv6_loopback():
    if not socket.has_ipv6:
        pytest.skip("!!! no IPv6 on this machine")
    m = TCPStore("::1", 0, is_master=True, timeout=5)
    c = TCPStore("::1", m.port, timeout=5)
    c.set("v6", "1")
    assert m.get("v6") == b"1"
    v4 = TCPStore("127.0.0.1", m.port, timeout=5)      # dual-stack listener
    assert v4.get("v6") == b"1"
    m.shutdown_server()


def test_fd_limit_raised_when_hosting(master):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert soft == hard or hard == resource.RLIM_INFINITY


@isolated
def test_no_fd_leak():
    def fds():
        return len(os.listdir("/proc/self/fd"))

    import gc

    gc.collect()
    before = fds()
    for _ in range(5):
        m = TCPStore("127.0.0.1", 0, is_master=True, timeout=5)
        c = m.clone()
        c.set("a", "1")
        c.close()
        m.shutdown_server()
        del c, m
    gc.collect()
    assert fds() == before


@pytest.mark.timeout(60)
def test_lost_reply_times_out_even_under_a_stream_of_signals():
    """A server that never answers: the reply deadline holds although a signal interrupts the
    wait every 50 ms (each interrupted recv would restart the socket's own timeout)."""
    listener = socket.create_server(("127.0.0.1", 0))
    got_request = threading.Event()
    release = threading.Event()

    def silent_server():
        conn, _ = listener.accept()
        with conn:
            hs = b""
            while len(hs) < 10:  # VALIDATE + PING(nonce)
                hs += conn.recv(10 - len(hs))
            conn.sendall(hs[6:10])  # echo the nonce: a plain TCPStore, no extensions
            conn.recv(64)  # the ADD, never answered
            got_request.set()
            release.wait(30)

    server = threading.Thread(target=silent_server, daemon=True)
    server.start()
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    try:
        c = TCPStore("127.0.0.1", listener.getsockname()[1], timeout=timedelta(seconds=1))
        signal.setitimer(signal.ITIMER_REAL, 0.05, 0.05)
        t0 = time.monotonic()
        with pytest.raises(StoreConnectionError, match="did not answer"):
            c.add("k", 1)
        took = time.monotonic() - t0
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, old)
        release.set()
        listener.close()
    assert got_request.is_set()
    assert 0.9 < took < 3.0, f"a 1 s reply timeout took {took:.2f} s"


def test_a_write_from_another_thread_never_queues_behind_a_blocked_wait(master):
    """A keep-alive (a fire-and-forget write) from a second thread goes out while the first
    thread's WAIT is still blocked on the same connection, and the wait still ends as it must."""
    c = client(master, timeout=60)
    other = client(master)
    outcome: list = []

    def waiter():
        try:
            c.wait(["release"], timedelta(seconds=60))
            outcome.append("released")
        except BaseException as e:  # noqa: BLE001 - reported below
            outcome.append(e)

    t = threading.Thread(target=waiter)
    t.start()
    wait_until(lambda: master.server.waiting == 1, what="the wait registered")
    start = time.monotonic()
    for i in range(1, 51):  # each returns at once although the wait holds c's connection
        c.set("hb", b"%d" % i)
        c.multi_set(["hb2", "hb3"], [b"%d" % i, b"x"])
        c.append("log", b".")
    c.set("done", b"1")
    writes = time.monotonic() - start
    # c's writes are executed in order; another connection sees them once it sees the last
    other.wait(["done"], timedelta(seconds=10))
    assert other.get("hb") == b"50" and other.get("hb2") == b"50"
    assert other.get("log") == b"." * 50
    assert t.is_alive() and master.server.waiting == 1, "the wait must still be blocked"
    other.set("release", b"1")
    t.join(10)
    assert outcome == ["released"]
    assert writes < 30, "the writes waited for the wait"
    assert c.add("n", 2) == 2 and c.get("hb3") == b"x"  # the connection is still in step
