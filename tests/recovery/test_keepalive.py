"""Store connections end within FASTELASTIC_STORE_KEEPALIVE_S when the peer's link is cut."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from netns import cluster_or_skip, wait_for

from fastelastic.errors import StoreError
from fastelastic.store._hosting import KEEPALIVE_ENV, keepalive_s, listen_socket, set_keepalive

REPO = Path(__file__).resolve().parents[2]


def _server_side_of(client: socket.socket) -> socket.socket:
    """The hosted server's socket for ``client`` (same process), found among our fds."""
    want = client.getsockname()
    for name in os.listdir("/proc/self/fd"):
        try:
            fd = os.dup(int(name))
        except OSError:
            continue
        try:
            s = socket.socket(fileno=fd)
        except OSError:   # not a socket: the dup must not outlive the check (a leaked dup of a
            os.close(fd)  # pipe's write end keeps its reader from ever seeing EOF)
            continue
        try:
            peer = s.getpeername()  # ('::ffff:127.0.0.1', port, ...) on a dual-stack server
            if s.type == socket.SOCK_STREAM and peer[1] == want[1] and str(peer[0]).endswith(
                    want[0]):
                return s
        except OSError:
            pass
        s.close()
    raise AssertionError(f"no server-side socket for {want}")


def test_keepalive_is_armed_on_connections_with_disconnect_actions(monkeypatch) -> None:
    """The server's side of each connection that registers disconnect actions (an agent) ends
    within the window of the peer vanishing; a plain connection (a worker, a storm of them)
    gets no probes that a flood of dropped packets could turn into resets of live clients."""
    import struct

    from fastelastic.store import TCPStore

    def blob(b: bytes) -> bytes:
        return struct.pack("<Q", len(b)) + b

    monkeypatch.setenv(KEEPALIVE_ENV, "4")
    host = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    validate = b"\x00" + struct.pack("<I", 0x3C85F7CE)
    ping = b"\x0d" + struct.pack("<I", 0x7E57FA57)  # the capability PING
    on_disconnect = b"\x42" + blob(b"gone") + blob(b"1;")
    agent = socket.create_connection(("127.0.0.1", host.port))
    worker = socket.create_connection(("127.0.0.1", host.port))
    try:
        agent.sendall(validate + ping + on_disconnect)
        assert len(agent.recv(16)) >= 4  # the PING's answer: the requests ran
        worker.sendall(validate + b"\x07")  # GETNUMKEYS
        assert len(worker.recv(16)) == 8
        theirs = {n: _server_side_of(c) for n, c in (("agent", agent), ("worker", worker))}
        opt = theirs["agent"].getsockopt
        assert opt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert opt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 2
        assert opt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 1
        assert opt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 2
        assert opt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 4000
        assert theirs["worker"].getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        assert theirs["worker"].getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
        for s in theirs.values():
            s.close()
    finally:
        agent.close()
        worker.close()
        host.shutdown_server()
    lsock = listen_socket("127.0.0.1", 0)
    with lsock:
        assert lsock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 0
    s = socket.socket()
    with s:
        set_keepalive(s, 0)  # off: untouched
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        set_keepalive(s, 4)  # our clients' own side
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 4000


@pytest.mark.parametrize("raw", ["-1", "x", "99999"])
def test_bad_keepalive_setting_is_a_clear_error(monkeypatch, raw) -> None:
    monkeypatch.setenv(KEEPALIVE_ENV, raw)
    with pytest.raises(StoreError, match=KEEPALIVE_ENV):
        keepalive_s()


_CLIENT = r"""
import sys, time
from datetime import timedelta
from fastelastic.store import TCPStore
from fastelastic.errors import StoreError
c = TCPStore(sys.argv[1], int(sys.argv[2]), timeout=timedelta(seconds=60))
c.append_on_disconnect("gone", b"node1;")
print("ready", flush=True)
t0 = time.monotonic()
try:
    c.wait(["never"], timedelta(seconds=60))
    print("woke", flush=True)
except StoreError as e:
    print(f"ended {time.monotonic() - t0:.2f} {type(e).__name__}", flush=True)
"""


@pytest.mark.timeout(60)
def test_cut_link_ends_both_sides(tmp_path) -> None:
    """A node whose link goes down (no FIN, no RST): the server runs its disconnect actions and
    the node's own blocked call fails, both within the keep-alive window (2 s here)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), KEEPALIVE_ENV: "2"}
    with cluster_or_skip(2, "k") as c:
        server = c.spawn(0, [sys.executable, "-m", "fastelastic.store", "--port", "29400"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert server.stdout is not None and b"listening" in server.stdout.readline()
        node = c.spawn(1, [sys.executable, "-c", _CLIENT, c.addr(0), "29400"], env=env,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert node.stdout is not None and node.stdout.readline().strip() == b"ready"
        watcher = c.spawn(0, [sys.executable, "-c", (
            "import sys,time; from datetime import timedelta; "
            "from fastelastic.store import TCPStore; "
            "c=TCPStore('127.0.0.1', 29400, timeout=timedelta(seconds=60)); "
            "print('ready', flush=True); sys.stdin.readline(); t0=time.monotonic(); "
            "c.wait(['gone'], timedelta(seconds=30)); "
            "print(f'{time.monotonic()-t0:.2f}', c.get('gone').decode(), flush=True)")],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert watcher.stdout is not None and watcher.stdin is not None
        assert watcher.stdout.readline().strip() == b"ready"
        time.sleep(0.3)  # let the connection go idle: the cut must be found by keep-alive
        c.cut(1)
        watcher.stdin.write(b"go\n")
        watcher.stdin.flush()
        seen, who = watcher.stdout.readline().decode().split()
        assert who == "node1;"
        assert float(seen) < 4.0, f"the server noticed the cut after {seen}s (window 2 s)"
        line = wait_for(lambda: node.stdout.readline(), 10, "the node's blocked call to end")
        words = line.decode().split()
        assert words[0] == "ended", line
        assert float(words[1]) < 5.0, line
