"""The namespace harness itself: nodes reach each other; kill, freeze and cut do what they say."""

from __future__ import annotations

import subprocess
import sys

from netns import Cluster, cluster_or_skip, wait_for

_ECHO = (
    "import socket,sys\n"
    "s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "s.bind((sys.argv[1], 7000)); s.listen(); print('up', flush=True)\n"
    "while True:\n"
    "    c,_=s.accept(); c.sendall(c.recv(64)); c.close()\n"
)
_CLIENT = (
    "import socket,sys\n"
    "try:\n"
    "    c=socket.create_connection((sys.argv[1], 7000), timeout=float(sys.argv[2]))\n"
    "    c.sendall(b'ping'); print(c.recv(64).decode())\n"
    "except OSError as e: print(type(e).__name__)\n"
)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _client(c: Cluster, i: int, target: str, timeout: float) -> str:
    p = c.spawn(i, [sys.executable, "-c", _CLIENT, target, str(timeout)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, _ = p.communicate(timeout=timeout + 10)
    return out.decode().strip()


def test_nodes_talk_and_failures_apply() -> None:
    c = cluster_or_skip(3, "t")
    names = list(c.namespaces)
    try:
        srv = c.spawn(1, [sys.executable, "-c", _ECHO, c.addr(1)], stdout=subprocess.PIPE)
        assert srv.stdout is not None and srv.stdout.readline().strip() == b"up"
        assert _client(c, 0, c.addr(1), 5) == "ping"
        # only the node itself has the address: the caller's namespace cannot reach it
        assert c.pids(1) == [srv.pid]

        c.cut(1)
        assert _client(c, 0, c.addr(1), 0.5) in ("TimeoutError", "timeout")
        c.heal(1)
        assert wait_for(lambda: _client(c, 0, c.addr(1), 1) == "ping", 10, "link back up")

        c.freeze(1)
        assert _state(srv.pid) == "T"
        c.thaw(1)
        wait_for(lambda: _state(srv.pid) != "T", 5, "SIGCONT")

        c.kill(1)
        assert srv.wait(timeout=5) == -9
        assert c.leftovers() == {}
        c.spawn(2, [sys.executable, "-c", "import time; time.sleep(60)"])
        wait_for(lambda: c.pids(2), 5, "sleeper in node 2")
    finally:
        c.close()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in names if n in listed], listed
