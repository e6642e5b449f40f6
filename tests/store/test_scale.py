"""10,000 concurrent connections to a server in another process, each handshaking and adding."""

from __future__ import annotations

import errno
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import time

import pytest

from ._wire import ADD, HANDSHAKE, blob, req, u64
from .conftest import wait_until

N = 10_000


@pytest.fixture
def server_proc():
    proc = subprocess.Popen(
        # Not a test of the 1 s handshake limit: a loaded CI machine can starve this Python
        # client between its connect and its VALIDATE for longer than that.
        [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0",
         "--handshake-ms", "60000"],
        stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, line
    port = int(line.rsplit(":", 1)[1])
    yield proc, port
    proc.terminate()
    proc.wait(10)


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.timeout(240)
def test_ten_thousand_connections(server_proc):
    proc, port = server_proc
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < N + 100:
        pytest.skip(f"!!! RLIMIT_NOFILE hard limit {hard} < {N + 100}; cannot hold {N} sockets")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    sel = selectors.DefaultSelector()
    socks = []
    expected_nonce = HANDSHAKE[6:]
    add = req(ADD, blob("/storm"), u64(1))
    state = {}
    try:
        for _ in range(N):
            s = socket.socket()
            s.setblocking(False)
            err = s.connect_ex(("127.0.0.1", port))
            assert err in (0, errno.EINPROGRESS), os.strerror(err)
            socks.append(s)
            state[s.fileno()] = [0, b""]   # phase 0 connecting, 1 handshaked, 2 added
            if err == 0:   # like torch's client: the handshake right after the connect (the
                s.sendall(HANDSHAKE)   # server closes connections silent for 1 s)
                sel.register(s, selectors.EVENT_READ)
            else:
                sel.register(s, selectors.EVENT_WRITE)
        done = 0
        results = []
        deadline = time.monotonic() + 180
        while done < N:
            assert time.monotonic() < deadline, f"only {done} of {N} clients finished"
            for key, ev in sel.select(timeout=1.0):
                s = key.fileobj
                st = state[s.fileno()]
                if ev & selectors.EVENT_WRITE:
                    err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    assert err == 0, f"connect failed: {os.strerror(err)}"
                    s.sendall(HANDSHAKE)
                    sel.modify(s, selectors.EVENT_READ)
                    continue
                data = s.recv(64)
                assert data, "server closed a connection"
                st[1] += data
                if st[0] == 0 and len(st[1]) >= 4:
                    assert st[1][:4] == expected_nonce
                    st[1] = st[1][4:]
                    st[0] = 1
                    s.sendall(add)
                if st[0] == 1 and len(st[1]) >= 8:
                    results.append(struct.unpack("<q", st[1][:8])[0])
                    st[0] = 2
                    sel.unregister(s)
                    done += 1
        assert sorted(results) == list(range(1, N + 1))
        rss = _rss_mib(proc.pid)
        assert rss < 128, f"server RSS {rss:.1f} MiB with {N} idle connections"
        assert proc.poll() is None
    finally:
        for s in socks:
            s.close()
        sel.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _thread_cpu_s(tid: int) -> float:
    with open(f"/proc/self/task/{tid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def _storm_tools():
    """The benchmarks' C storm client (``benchmarks/stormclient.c``), reused here."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks")
    sys.path.insert(0, os.path.abspath(bench))
    try:
        import _storebench
    finally:
        sys.path.pop(0)
    try:
        _storebench.storm_binary()
    except RuntimeError as e:
        pytest.skip(f"!!! {e}")
    return _storebench


@pytest.mark.timeout(300)
def test_every_cost_is_o1_per_connection_up_to_19000():
    """1,900 and then 19,000 light clients (2 processes) connect at once, ADD, and WAIT on one
    key that is never set; then they all die. The server's CPU per connection, for the storm
    (accept, handshake, ADD, the waiter list) and for the disconnects (waiter removal, cleanup),
    must not grow with the count: O(n) per connection would make it 10x, O(1) keeps it flat."""
    sb = _storm_tools()
    n_big = 19_000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < n_big + 200:
        pytest.skip(f"!!! RLIMIT_NOFILE hard limit {hard} < {n_big + 200}")
    from fastelastic.store import TCPStore

    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=30,
                      server_limits={"handshake_ms": 60_000})
    server, tid = master.server, master._server._thread.native_id
    totals: dict[int, list[float]] = {}  # n -> [storm CPU s, disconnect CPU s, connections]
    try:
        # The small storm costs only tens of ms of thread CPU, counted in 10 ms ticks: three of
        # them, summed, keep that rounding from deciding the ratio.
        for k, n in enumerate((1_900, 1_900, 1_900, n_big)):
            clients = [sb.StormClient(master.port, n // 2, f"/arrive{k}",
                                      (f"/never{k}", n + 1))
                       for _ in range(2)]
            try:
                for c in clients:
                    c.line(120)
                base = server.num_connections
                cpu0 = _thread_cpu_s(tid)
                for c in clients:
                    c.tell("go")
                wait_until(lambda n=n: server.waiting == n, 120, f"{n} clients waiting")
                cpu1 = _thread_cpu_s(tid)
                for c in clients:
                    c.proc.kill()
                wait_until(lambda b=base: server.num_connections == b, 120, "clients gone")
                cpu2 = _thread_cpu_s(tid)
            finally:
                for c in clients:
                    c.proc.kill()
                    c.proc.wait(30)
            assert server.waiting == 0 and master.add(f"arrive{k}", 0) == n   # every ADD
            t = totals.setdefault(n, [0.0, 0.0, 0])
            t[0] += cpu1 - cpu0
            t[1] += cpu2 - cpu1
            t[2] += n
        costs = {n: (t[0] / t[2] * 1e6, t[1] / t[2] * 1e6) for n, t in totals.items()}
        for n, (storm, gone) in costs.items():
            print(f"{n} clients: storm {storm:.1f} us/conn, disconnect {gone:.1f} us/conn")
        # O(1) keeps the ratio near 1 (measured 0.8-1.2); the old O(waiters) removal of a
        # waiter made the disconnects' ratio 1.6 here, any O(n) step would make it ~10.
        for i, what in enumerate(("storm", "disconnect")):
            ratio = costs[n_big][i] / costs[1_900][i]
            assert ratio < 1.5, f"{what} CPU per connection grew {ratio:.2f}x from 1,900 to 19,000"
    finally:
        master.shutdown_server()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_idle_connection_costs_the_server_at_most_160_bytes_of_state():
    """A connection's fixed state (buffers are allocated only while used) bounds the server's
    RSS per held connection at 96K ranks; the optional parts (a partial request, disconnect
    actions, streamed values, the token challenge) live behind pointers. 152 bytes today."""
    from fastelastic._native import kvcore

    assert 64 <= kvcore.CONN_BYTES <= 160, kvcore.CONN_BYTES


_FD_TABLE_PROBE = """
import resource, socket, threading
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 20000), hard))
threading.Thread(target=lambda: None).start()   # a store host has threads (expand_fdtable)
from fastelastic._native.kvserver import KVServer
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(16); s.setblocking(False)
before = [l for l in open("/proc/self/status") if l.startswith("FDSize:")][0].split()[1]
srv = KVServer([s.detach()])
after = [l for l in open("/proc/self/status") if l.startswith("FDSize:")][0].split()[1]
print(before, after, min(hard, 20000))
srv.close()
"""


def test_a_fresh_server_grows_its_fd_table_before_the_first_storm():
    """The kernel grows a process's fd table by doubling, and in a threaded process each
    growth waits for an RCU grace period inside accept4. In the first connect storm on a fresh
    server that stalled accept for ~100 ms: 4,000-12,000 accept-queue overflows and 3-11 s of
    SYN retransmissions for 19,000 clients (0.5-0.7 s once grown). The server grows it once, at
    start, to what RLIMIT_NOFILE allows."""
    out = subprocess.run([sys.executable, "-c", _FD_TABLE_PROBE], capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    before, after, limit = (int(x) for x in out)
    assert before < limit <= after, (before, after, limit)
