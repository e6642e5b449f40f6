"""Buggy or hostile clients against a store server in its own process: the server stays up, its
memory stays bounded, a well-behaved client keeps its latency, and no key is lost or forged.

Targets (issue 11): server RSS growth <= 512 MiB under each attack, the well-behaved client's
p99 <= 50 ms and never a timeout, a pre-handshake connection closed within 1 s, an ungated
extension refused.
"""

from __future__ import annotations

import json
import os
import resource
import selectors
import socket
import struct
import subprocess
import sys
import textwrap
import time

import pytest

from fastelastic.errors import StoreConnectionError
from fastelastic.store import TCPStore

from ._wire import (
    EXT_ON_DISCONNECT_APPEND,
    EXT_WAIT_GET,
    GET,
    HANDSHAKE,
    MAGIC,
    MULTI_GET,
    MULTI_SET,
    SET,
    VALIDATE,
    WAIT,
    FakeServer,
    Raw,
    answer_handshake,
    blob,
    read_exact,
    req,
    reset,
    u64,
)

RSS_GROWTH_MIB = 512
P99_MS = 50.0
MIB = 1 << 20


def _favour() -> None:
    """The server and the well-behaved client run ahead of the attackers (and of whatever else
    shares this machine's 2 cores): the latency measured is the server's, not the scheduler's."""
    try:
        os.nice(-10)
    except OSError:
        pass   # not permitted: measured at normal priority


class Server:
    """``python -m fastelastic.store`` in a child process; its log goes to a file."""

    def __init__(self, tmp_path, *args: str, nofile: int | None = None) -> None:
        self.log_path = tmp_path / "server.log"
        self._log = open(self.log_path, "w")

        def limit() -> None:
            _favour()
            if nofile is not None:
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0",
             *args],
            stdout=subprocess.PIPE, stderr=self._log, text=True, preexec_fn=limit)
        line = self.proc.stdout.readline()
        assert "listening on" in line, (line, self.log())
        self.port = int(line.rsplit(":", 1)[1])

    def status_kib(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise AssertionError(f"no {field}")

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        self.proc.terminate()
        assert self.proc.wait(10) == 0, self.log()
        self._log.close()


@pytest.fixture
def server(tmp_path):
    started = []

    def make(*args: str, nofile: int | None = None) -> Server:
        s = Server(tmp_path, *args, nofile=nofile)
        started.append(s)
        return s

    yield make
    for s in started:
        if s.proc.poll() is None:
            s.stop()


_GOOD_CLIENT = textwrap.dedent("""
    import json, select, sys, time
    from fastelastic.store import TCPStore
    s = TCPStore("127.0.0.1", int(sys.argv[1]), timeout=5, wait_for_workers=False)
    print("ready", flush=True)
    lat, errors, n = [], [], 0
    while not select.select([sys.stdin], [], [], 0)[0]:
        t = time.perf_counter()
        try:
            n += 1
            assert s.add("good/count", 1) == n
            s.set(f"good/{n % 64}", str(n))
            assert s.get(f"good/{n % 64}") == str(n).encode()
        except Exception as e:
            errors.append(repr(e))
            break
        lat.append((time.perf_counter() - t) * 1000)
        time.sleep(0.0005)
    lat.sort()
    p99 = lat[int(len(lat) * 0.99)] if lat else None
    print(json.dumps({"n": len(lat), "p99": p99, "max": lat[-1] if lat else None,
                      "errors": errors}), flush=True)
""")


class GoodClient:
    """A well-behaved client in its own process (no GIL shared with the attackers): add, set,
    get in a loop, 3 round trips per sample, until told to stop."""

    def __init__(self, port: int) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen([sys.executable, "-c", _GOOD_CLIENT, str(port)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, preexec_fn=_favour)
        assert self.proc.stdout.readline().strip() == "ready"

    def result(self) -> dict:
        out, _ = self.proc.communicate("stop\n", timeout=30)
        res = json.loads(out.strip().splitlines()[-1])
        assert not res["errors"], f"the well-behaved client failed: {res['errors']}"
        assert res["n"] >= 20, res
        return res


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def _closed(s: socket.socket, within: float) -> bool:
    """True if the peer closes s within `within` seconds (reading and dropping any data)."""
    deadline = time.monotonic() + within
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            s.settimeout(left)
            if not s.recv(1 << 16):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _check_bounds(srv: Server, rss_before_kib: int, good: GoodClient, what: str) -> None:
    res = good.result()
    grown = (srv.status_kib("VmHWM") - rss_before_kib) / 1024
    assert srv.proc.poll() is None, f"{what}: the server died\n{srv.log()}"
    assert grown <= RSS_GROWTH_MIB, f"{what}: server RSS grew {grown:.0f} MiB"
    assert res["p99"] <= P99_MS, f"{what}: well-behaved p99 {res['p99']:.1f} ms ({res})"
    print(f"{what}: RSS +{grown:.0f} MiB, good client p99 {res['p99']:.2f} ms "
          f"max {res['max']:.1f} ms over {res['n']} samples")


@pytest.mark.timeout(120)
def test_amplification_is_bounded(server):
    """1 MiB value, MULTI_GETs naming it 60x (a 60 MiB reply each) on 24 connections that never
    read, and one naming it 96x (over max_reply): the 96x one is refused and logged; the others
    stream the one stored copy (no reply is copied) and are paused once 1 MiB is unsent."""
    srv = server()
    big = os.urandom(MIB)
    owner = TCPStore("127.0.0.1", srv.port, timeout=10, wait_for_workers=False)
    owner.set("big", big)
    assert owner.get("big") == big
    good = GoodClient(srv.port)
    before = srv.status_kib("VmRSS")
    too_big = Raw(srv.port)
    too_big.send(req(MULTI_GET, u64(96), *[blob("/big")] * 96))
    attackers = []
    for _ in range(24):
        a = Raw(srv.port)
        a.send(req(MULTI_GET, u64(60), *[blob("/big")] * 60) * 4)
        attackers.append(a)
    assert _closed(too_big.sock, 5), "a reply over max_reply was built"
    time.sleep(1.0)  # the attack runs while the good client measures (not synchronisation)
    _check_bounds(srv, before, good, "amplification")
    log = srv.log()
    assert "refused a reply of 100664064 bytes (max_reply 67108864)" in log, log
    assert owner.get("big") == big
    for a in attackers:
        a.close()
    owner.close()


@pytest.mark.timeout(120)
def test_buffer_budget_disconnects_the_largest_holder(server):
    """60 connections each send 6 MiB of an 8 MiB SET and stop (360 MiB of partial requests
    against a 256 MiB budget): the largest holders are disconnected, one log line naming each,
    and their half-sent values are not stored."""
    srv = server()
    good = GoodClient(srv.port)
    before = srv.status_kib("VmRSS")
    head = req(SET, blob("/half"), u64(8 * MIB))
    chunk = b"h" * MIB
    socks = []
    for _ in range(60):
        r = Raw(srv.port)
        try:
            r.send(head)
            for _ in range(6):
                r.send(chunk)
        except OSError:
            pass   # this one was shed already
        socks.append(r)
    deadline = time.monotonic() + 10
    while "over the budget" not in srv.log():
        assert time.monotonic() < deadline, srv.log()
        time.sleep(0.01)
    _check_bounds(srv, before, good, "buffer budget")
    log = srv.log()
    assert "connection buffers over the budget (256 MiB): closing the connection that holds " \
           "the most" in log and "client 127.0.0.1:" in log, log
    check = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
    assert not check.check(["half"])
    for r in socks:
        r.close()
    check.close()


@pytest.mark.timeout(120)
def test_never_reading_pipeliner_is_paused(server):
    """20,000 pipelined GETs of a 1 MiB value (280 KB of requests, 20 GB of replies) on each of
    4 connections that never read: the server stops reading them once 1 MiB is unsent."""
    srv = server()
    owner = TCPStore("127.0.0.1", srv.port, timeout=10, wait_for_workers=False)
    owner.set("big", b"x" * MIB)
    assert owner.get("big") == b"x" * MIB   # in before the attackers ask
    good = GoodClient(srv.port)
    before = srv.status_kib("VmRSS")
    socks = []
    for _ in range(4):
        s = _connect(srv.port)
        s.setblocking(False)
        socks.append((s, HANDSHAKE + req(GET, blob("/big")) * 20_000))
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:   # send what the kernel takes; never read
        for i, (s, rest) in enumerate(socks):
            try:
                n = s.send(rest) if rest else 0
            except BlockingIOError:
                n = 0
            socks[i] = (s, rest[n:])
        time.sleep(0.01)
    _check_bounds(srv, before, good, "pipeliner")
    assert owner.get("big") == b"x" * MIB
    # The paused connections still hold their unread requests: reading resumes them.
    s, _ = socks[0]
    s.setblocking(True)
    s.settimeout(10)
    assert s.recv(4) == HANDSHAKE[6:]
    got = 0
    while got < 3 * (8 + MIB):
        chunk = s.recv(1 << 20)
        assert chunk, "the server closed a paused connection"
        got += len(chunk)
    for s, _ in socks:
        s.close()
    owner.close()


@pytest.mark.timeout(120)
def test_before_the_handshake(server):
    """Nothing but VALIDATE is accepted first, at most 4 bytes are buffered before it, and a
    connection that does not complete it is closed within 1 s."""
    srv = server()
    good = GoodClient(srv.port)
    before = srv.status_kib("VmRSS")
    payload = req(MULTI_SET, u64(1), blob("/pre"), u64(64 * MIB)) + b"v" * (1 << 20)
    flooders = []
    for _ in range(100):   # a 64 MiB MULTI_SET with no VALIDATE: closed on its first byte
        s = _connect(srv.port)
        try:
            s.sendall(payload)
        except OSError:
            pass   # closed while sending: the point
        flooders.append(s)
    silent = [_connect(srv.port) for _ in range(100)]
    partial = []
    for _ in range(100):
        s = _connect(srv.port)
        s.sendall(struct.pack("<BI", VALIDATE, MAGIC)[:3])   # 3 of VALIDATE's 5 bytes
        partial.append(s)
    t0 = time.monotonic()
    for s in flooders:
        assert _closed(s, 1.0), "a pre-handshake MULTI_SET was buffered, not refused"
    for s in silent + partial:
        assert _closed(s, max(0.05, t0 + 1.5 - time.monotonic())), \
            "a connection that never completed VALIDATE is still open after 1.5 s"
    assert time.monotonic() - t0 < 1.6
    _check_bounds(srv, before, good, "pre-handshake")
    check = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
    assert not check.check(["pre"]), "a pre-handshake MULTI_SET wrote its key"
    # A VALIDATE split across segments is reassembled like any frame.
    r = Raw(srv.port, handshake=False)
    frame = HANDSHAKE + req(GET, blob("/good/1"))
    for b in frame:
        r.send(bytes([b]))
    assert r.recv(4) == HANDSHAKE[6:] and r.recv_blob() == check.get("good/1")
    for s in flooders + silent + partial:
        s.close()
    check.close()
    r.close()


@pytest.mark.timeout(180)
def test_waiter_churn(server):
    """5,000 connections wait on one key and vanish, twice; then one set wakes exactly the
    waiters that are left."""
    # (not a test of the 1 s handshake limit: this Python client may be starved that long)
    srv = server("--handshake-ms", "30000")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    n = 5000
    if hard < n + 200:
        pytest.skip(f"!!! RLIMIT_NOFILE hard limit {hard} < {n + 200}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    good = GoodClient(srv.port)
    before = srv.status_kib("VmRSS")
    try:
        for _ in range(2):
            socks = _open_many(srv.port, n, HANDSHAKE + req(WAIT, u64(1), blob("/churn")))
            for s in socks:
                s.close()
        stayer = Raw(srv.port)
        stayer.send(req(WAIT, u64(1), blob("/churn")))
        setter = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
        setter.set("churn", "go")
        assert stayer.recv_u8() == 0   # STOP_WAITING
        _check_bounds(srv, before, good, "waiter churn")
        stayer.close()
        setter.close()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_many(port: int, n: int, first: bytes) -> list[socket.socket]:
    """n connections that each sent `first` and got the 4-byte handshake reply."""
    sel = selectors.DefaultSelector()
    socks, pending = [], {}
    for _ in range(n):
        s = socket.socket()
        s.setblocking(False)
        socks.append(s)
        if s.connect_ex(("127.0.0.1", port)) == 0:   # like torch's client: send at once
            s.sendall(first)
            pending[s] = b""
            sel.register(s, selectors.EVENT_READ)
        else:
            sel.register(s, selectors.EVENT_WRITE)
    deadline = time.monotonic() + 60
    done = 0
    while done < n:
        assert time.monotonic() < deadline, f"only {done} of {n} connections handshaked"
        for key, ev in sel.select(timeout=1.0):
            s = key.fileobj
            if ev & selectors.EVENT_WRITE:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                s.sendall(first)
                pending[s] = b""
                sel.modify(s, selectors.EVENT_READ)
                continue
            data = s.recv(16)
            assert data, "the server closed a well-formed connection"
            pending[s] += data
            if len(pending[s]) >= 4:
                sel.unregister(s)
                done += 1
    sel.close()
    return socks


def test_extensions_need_the_capability_ping(server):
    srv = server()
    plain = Raw(srv.port)   # handshake with a torch-style PING, not our capability nonce
    plain.send(req(EXT_ON_DISCONNECT_APPEND, blob("/dead"), blob("x")))
    assert plain.is_closed_by_peer(), "an ungated extension was executed"
    plain2 = Raw(srv.port)
    plain2.send(req(EXT_WAIT_GET, blob("/dead")))
    assert plain2.is_closed_by_peer()
    check = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
    assert not check.check(["dead"]), "the refused disconnect action ran"
    assert "extension request before the capability PING" in srv.log()
    check.close()


def test_list_keys_is_bounded(server):
    srv = server("--max-value", "1024", "--max-reply", "65536", "--buffer-budget", str(1 << 20))
    c = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
    c.multi_set([f"k{i:05d}" for i in range(2000)], ["v"] * 2000)   # ~38 KB of keys: fits
    assert len(c.list_keys()) == 2000
    c.multi_set([f"more{i:05d}" for i in range(2000)], ["v"] * 2000)   # ~78 KB: does not
    with pytest.raises(StoreConnectionError):
        c.list_keys()
    assert "refused a reply" in srv.log()
    d = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
    assert d.num_keys() == 4000
    d.close()


def test_out_of_fds_is_logged_with_the_limit_not_a_protocol_error(server):
    srv = server(nofile=64)
    conns = []
    try:
        for _ in range(80):
            conns.append(_connect(srv.port))
        deadline = time.monotonic() + 10
        while "out of file descriptors" not in srv.log():
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.01)
        assert "RLIMIT_NOFILE 64" in srv.log()
        assert "closed its connection" not in srv.log()
    finally:
        for s in conns:
            s.close()
    c = TCPStore("127.0.0.1", srv.port, timeout=10, wait_for_workers=False)
    assert c.add("after", 1) == 1   # serving again once fds are free
    c.close()


def test_client_retries_a_reset_during_its_handshake():
    fake = FakeServer(reset, reset, answer_handshake)
    store = TCPStore("127.0.0.1", fake.port, timeout=5, wait_for_workers=False)
    assert store.supports_extensions
    store.close()
    fake.close()
    assert len(fake.conns) == 3


def test_client_survives_a_reply_length_near_2_to_64():
    """A server that answers GET with a length of 2**64 - 9: the client fails at once, instead
    of doubling its buffer size until it wraps and spinning."""
    def evil(c: socket.socket) -> None:
        answer_handshake(c)
        read_exact(c, 1 + 8 + 2)   # EXT_WAIT_GET of "/k"
        c.sendall(b"\x02" + struct.pack("<Q", (1 << 64) - 9) + b"abc")
        c.recv(1)   # until the client closes

    fake = FakeServer(evil)
    store = TCPStore("127.0.0.1", fake.port, timeout=5, wait_for_workers=False)
    t0 = time.monotonic()
    with pytest.raises(StoreConnectionError, match="Message too long"):
        store.get("k")
    assert time.monotonic() - t0 < 1.0
    store.close()
    fake.close()


def test_bounds_are_options_of_the_hosted_store():
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=5,
                      server_limits={"max_reply": 20 << 20, "max_value": 1 << 20})
    try:
        master.set("v", b"v" * (1 << 20))
        assert len(master.get("v")) == 1 << 20   # the SET is in before the raw client asks
        r = Raw(master.port)
        r.send(req(MULTI_GET, u64(21), *[blob("/v")] * 21))
        assert r.is_closed_by_peer()
        assert master.server.last_error == "reply over max_reply"
        r2 = Raw(master.port)
        r2.send(req(MULTI_GET, u64(19), *[blob("/v")] * 19))
        assert len(r2.recv(8)) == 8
        r.close()
        r2.close()
        with pytest.raises(ValueError, match="max_reply"):
            TCPStore("127.0.0.1", 0, is_master=True, server_limits={"max_reply": 100})
    finally:
        master.shutdown_server()


def test_sets_still_arrive_while_a_reader_is_paused(server):
    """A paused connection keeps its buffered requests in order: a SET pipelined behind the
    GETs that filled its output is applied once it drains, not lost."""
    srv = server("--max-unsent", str(256 << 10))
    owner = TCPStore("127.0.0.1", srv.port, timeout=10, wait_for_workers=False)
    owner.set("big", b"y" * (512 << 10))
    assert owner.check(["big"])   # in before the raw client asks
    r = Raw(srv.port)
    r.send(req(GET, blob("/big")) * 8 + req(SET, blob("/after"), blob("1")) + req(GET,
                                                                                 blob("/after")))
    for _ in range(8):
        assert r.recv_blob() == b"y" * (512 << 10)
    assert r.recv_blob() == b"1"
    assert owner.get("after") == b"1"
    r.close()
    owner.close()



def _dropped(store: TCPStore, within: float = 5.0) -> bool:
    """True once a request on ``store`` fails because the server closed its connection."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            store.check(["probe"])
        except StoreConnectionError:
            return True
        time.sleep(0.01)
    return False


@pytest.mark.timeout(120)
def test_disconnect_actions_are_capped_per_connection(server):
    """At the defaults: a buggy client that registers disconnect actions without end (one per
    rendezvous round it ever joined, say) is closed at the 65,537th; one that registers 6 MiB
    ones, at the third (16 MiB a connection). The server stays up and serves the others at
    their latency; the closed clients' actions ran, as for any close."""
    srv = server()
    good = GoodClient(srv.port)
    before = srv.status_kib("VmRSS")
    many = TCPStore("127.0.0.1", srv.port, timeout=10, wait_for_workers=False)
    n = 65_536
    many.append_on_disconnect_many([f"many/{i % 16}" for i in range(n)], [b"x"] * n)
    assert not many.check(["many/0"])  # every one acknowledged: at the cap, still served
    many.append_on_disconnect("many/0", b"y")   # the one over the cap
    assert _dropped(many), "a connection over max_actions was still served"
    big = TCPStore("127.0.0.1", srv.port, timeout=10, wait_for_workers=False)
    for i in range(2):
        big.append_on_disconnect(f"big/{i}", b"b" * (6 * MIB))
    assert not big.check(["big/0"])
    big.append_on_disconnect("big/2", b"b" * (6 * MIB))
    assert _dropped(big), "a connection over max_action_bytes was still served"
    time.sleep(1.0)  # the good client measures on (not synchronisation)
    _check_bounds(srv, before, good, "disconnect actions")
    log = srv.log()
    assert log.count("disconnect actions over the per-connection cap") == 2, log
    check = TCPStore("127.0.0.1", srv.port, timeout=5, wait_for_workers=False)
    assert check.get("many/0") == b"x" * (n // 16)  # its actions ran, not the refused one
    assert [len(check.get(f"big/{i}")) for i in range(2)] == [6 * MIB] * 2
    assert not check.check(["big/2"])
    check.append_on_disconnect("others/still", b"ok")   # others still register theirs
    check.close()
    assert TCPStore("127.0.0.1", srv.port, timeout=5,
                    wait_for_workers=False).get("others/still") == b"ok"
    many.close()
    big.close()


def test_disconnect_actions_count_in_the_buffer_budget():
    """A connection's actions are in its buffers: ``buffered`` holds them until it closes,
    and over ``buffer_budget`` the largest holder is closed (its actions run) like any other."""
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=5, wait_for_workers=False,
                      server_limits={"max_value": MIB, "max_reply": 2 * MIB,
                                     "buffer_budget": 8 * MIB, "max_action_bytes": 6 * MIB})
    try:
        idle = master.server.buffered
        a = TCPStore("127.0.0.1", master.port, timeout=5, wait_for_workers=False)
        for i in range(3):
            a.append_on_disconnect(f"a/{i}", b"a" * (MIB - 100))
        assert not a.check(["a/0"])
        assert master.server.buffered - idle >= 3 * (MIB - 100), master.server.buffered
        b = TCPStore("127.0.0.1", master.port, timeout=5, wait_for_workers=False)
        closed_early = False
        for i in range(5):  # 3 + 5 MiB: over the 8 MiB budget; b holds the most
            try:
                b.append_on_disconnect(f"b/{i}", b"b" * (MIB - 100))
            except StoreConnectionError:
                # the last request's own bytes, still in b's input buffer, can be what goes
                # over the budget: b is closed before that action is registered
                assert i == 4, i
                closed_early = True
        assert closed_early or _dropped(b), "the largest holder over the budget was not closed"
        assert master.server.shed == 1
        assert len(master.get("b/3")) == MIB - 100   # its actions ran
        assert not a.check(["a/0"])                   # the other one kept its connection
        a.close()
        deadline = time.monotonic() + 5
        while master.server.buffered > idle and time.monotonic() < deadline:
            time.sleep(0.01)
        assert master.server.buffered <= idle, (master.server.buffered, idle)
        with pytest.raises(ValueError, match="max_actions"):
            TCPStore("127.0.0.1", 0, is_master=True, server_limits={"max_actions": 0})
    finally:
        master.shutdown_server()
