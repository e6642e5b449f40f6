"""Store-benchmark helpers: server subprocesses, /proc readings, the light raw client, workers.

Run as a script it is one of two helper processes the benchmarks start:

* ``_storebench.py worker`` -- reads JSON commands on stdin and answers one JSON line each.
  It drives real store clients (torch's ``TCPStore`` or ours) from threads, so the clients of a
  throughput run live in several processes, and a run that may never end (torch's 100,000-key
  ``multi_get``) can be bounded by killing the worker.
* ``_storebench.py storm PORT N`` -- the light client of the connection storm: N raw
  non-blocking sockets on one epoll, each sending the pre-encoded VALIDATE+PING+ADD in one write
  and reading the 4+8 byte reply. Lines on stdin (``go``, ``close``) pace it; it answers JSON.
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

MAGIC = 0x3C85F7CE
VALUE64 = "v" * 64
HERE = os.path.dirname(os.path.abspath(__file__))


def raise_nofile() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (20,000 here); returns the new soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# ------------------------------------------------------------------------------- wire bytes

def blob(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def enc_handshake(nonce: int) -> bytes:
    """VALIDATE + PING exactly as torch's client sends them (protocol section 3)."""
    return b"\x00" + struct.pack("<I", MAGIC) + b"\x0d" + struct.pack("<I", nonce)


def enc_add(key: bytes, delta: int) -> bytes:
    return b"\x04" + blob(key) + struct.pack("<q", delta)


# ------------------------------------------------------------------------------- /proc

def cpu_seconds(pid: int) -> float:
    """utime+stime of the whole process from /proc/PID/stat (10 ms ticks)."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds_precise(pid: int) -> float:
    """The same quantity (on-CPU time, user+system, all threads) in ns resolution, summed over
    /proc/PID/task/*/schedstat; used when a phase is too short for 10 ms ticks."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that just exited
    return total / 1e9


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def listen_drops() -> int:
    """TcpExt ListenDrops (system-wide): SYNs/ACKs dropped because an accept queue was full."""
    with open("/proc/net/netstat") as f:
        lines = f.read().splitlines()
    for head, vals in zip(lines[::2], lines[1::2]):
        if head.startswith("TcpExt:"):
            return int(dict(zip(head.split()[1:], vals.split()[1:]))["ListenDrops"])
    return 0


def pct(data, q: float) -> float:
    """Nearest-rank percentile, q in [0, 100]."""
    s = sorted(data)
    if not s:
        return float("nan")
    k = min(len(s) - 1, max(0, int(round(q / 100.0 * len(s) + 0.5)) - 1))
    return s[k]


# ------------------------------------------------------------------------------- servers

_TORCH_SERVER = r"""
import resource, signal, sys, threading
from datetime import timedelta
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=600))  # default use_libuv=True
done = threading.Event()
for s in (signal.SIGINT, signal.SIGTERM):
    signal.signal(s, lambda *_: done.set())
print(f"torch store listening on 127.0.0.1:{store.port}", flush=True)
done.wait()
"""


class ServerProc:
    """One store server in its own process, so its CPU and RSS can be read from /proc.

    ``fastelastic``: ``python -m fastelastic.store --host 127.0.0.1 --port 0``.
    ``torch``: a script hosting ``torch.distributed.TCPStore(is_master=True)`` (libuv server).
    """

    def __init__(self, impl: str, start_timeout: float = 180.0) -> None:
        self.impl = impl
        if impl == "fastelastic":
            cmd = [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0"]
        elif impl == "torch":
            cmd = [sys.executable, "-c", _TORCH_SERVER]
        else:
            raise ValueError(f"unknown impl {impl!r}")
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err,
                                     stdin=subprocess.DEVNULL)
        self.pid = self.proc.pid
        line = _read_line(self.proc, start_timeout)
        m = re.search(rb"listening on .*:(\d+)\s*$", line or b"")
        if m is None:
            self.stop()
            raise RuntimeError(f"{impl} store server did not start: {line!r} {self.stderr()}")
        self.port = int(m.group(1))

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-2000:]

    def cpu(self) -> float:
        return cpu_seconds(self.pid)

    def cpu_precise(self) -> float:
        return cpu_seconds_precise(self.pid)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    def nfds(self) -> int:
        return num_fds(self.pid)

    def wait_fds_at_most(self, limit: int, timeout: float) -> int:
        """Waits (bounded) until the server has closed its side of departed connections."""
        deadline = time.monotonic() + timeout
        n = self.nfds()
        while n > limit and time.monotonic() < deadline:
            time.sleep(0.02)  # polling /proc: the server offers no event for this
            n = self.nfds()
        return n

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout:
            self.proc.stdout.close()


def _read_line(proc: subprocess.Popen, timeout: float) -> Optional[bytes]:
    """One stdout line of proc, or None if it exits or the timeout passes first."""
    fd = proc.stdout.fileno()
    buf = b""
    deadline = time.monotonic() + timeout
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        r, _, _ = select.select([fd], [], [], left)
        if not r:
            return None
        chunk = os.read(fd, 4096)
        if not chunk:
            return buf or None
        buf += chunk
    return buf.split(b"\n", 1)[0]


# ------------------------------------------------------------------------------- workers

class Worker:
    """A helper process speaking JSON lines (``worker`` mode of this file)."""

    def __init__(self) -> None:
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_storebench.py"), "worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, bufsize=0)
        self._buf = b""

    def send(self, msg: dict) -> None:
        self.proc.stdin.write((json.dumps(msg) + "\n").encode())

    def recv(self, timeout: float) -> dict:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {self.proc.pid} did not answer in {timeout:g}s")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    self._err.seek(0)
                    raise RuntimeError(f"worker {self.proc.pid} died: "
                                       f"{self._err.read().decode(errors='replace')[-2000:]}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.proc.pid}: {reply['error']}")
        return reply

    def call(self, msg: dict, timeout: float) -> dict:
        self.send(msg)
        return self.recv(timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"op": "exit"}\n')
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.kill()


def make_client(kind: str, port: int):
    """A client of the store at 127.0.0.1:port: torch's TCPStore or ours (kind)."""
    from datetime import timedelta
    if kind == "torch":
        import torch.distributed as dist
        return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=120))
    from fastelastic.store import TCPStore
    return TCPStore("127.0.0.1", port, wait_for_workers=False, timeout=timedelta(seconds=120))


class _WorkerState:
    def __init__(self) -> None:
        self.clients: list = []
        self.prefix = ""

    def tp_connect(self, m: dict) -> dict:
        self.clients = [make_client(m["client"], m["port"]) for _ in range(m["threads"])]
        self.prefix = m["prefix"]
        return {"ok": True}

    def tp_run(self, m: dict) -> dict:
        """Every client does ``pairs`` x (set k, get k) on its own key, in its own thread."""
        pairs = m["pairs"]
        out: list = [None] * len(self.clients)
        barrier = threading.Barrier(len(self.clients))

        def run(i: int, c) -> None:
            key = f"{self.prefix}/{i}"
            lat = []
            clock = time.perf_counter_ns
            barrier.wait()
            t0 = time.monotonic()
            for _ in range(pairs):
                a = clock()
                c.set(key, VALUE64)
                b = clock()
                if len(c.get(key)) != 64:
                    raise AssertionError("get returned a wrong value")
                lat.append(b - a)
                lat.append(clock() - b)
            out[i] = (t0, time.monotonic(), lat)

        threads = [threading.Thread(target=run, args=(i, c)) for i, c in enumerate(self.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if any(o is None for o in out):
            raise RuntimeError("a client thread failed")
        return {"t0": min(o[0] for o in out), "t1": max(o[1] for o in out),
                "lat_ns": [x for o in out for x in o[2]]}

    def tp_close(self, m: dict) -> dict:
        self.clients = []
        return {"ok": True}

    def multi(self, m: dict) -> dict:
        """``rounds`` x (multi_set of n keys with 64-byte values, then multi_get of them)."""
        c = make_client(m["client"], m["port"])
        n = m["n"]
        keys = [f"{m['prefix']}/{i:07d}" for i in range(n)]
        vals = [VALUE64] * n
        sets, gets = [], []
        for _ in range(m["rounds"]):
            t0 = time.perf_counter()
            c.multi_set(keys, vals)
            t1 = time.perf_counter()
            got = c.multi_get(keys)
            t2 = time.perf_counter()
            if len(got) != n or bytes(got[-1]) != VALUE64.encode():
                raise AssertionError(f"multi_get returned {len(got)} values, last {got[-1]!r}")
            sets.append(t1 - t0)
            gets.append(t2 - t1)
        return {"set_s": sets, "get_s": gets}


def _worker_main() -> None:
    raise_nofile()
    state = _WorkerState()
    for line in sys.stdin:
        m = json.loads(line)
        if m["op"] == "exit":
            return
        try:
            reply = getattr(state, m["op"])(m)
        except Exception as e:  # report it to the parent, which fails the benchmark
            reply = {"error": f"{type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


# ------------------------------------------------------------------------------- storm client

_CONNECTING, _READING = 0, 1
_REPLY = 12  # 4-byte PING echo + 8-byte ADD result
_IP_BIND_ADDRESS_NO_PORT = 24  # linux/in.h
_SOURCE_ADDRS = 16


class StormClient:
    """A separate process holding N light clients (``storm`` mode of this file).

    Protocol: the process creates N non-blocking sockets and prints ``{"ready": ...}``; on
    ``go`` it storms and prints the result; on ``close`` it closes every socket (RST, so no
    TIME_WAIT is left behind) and exits.
    """

    def __init__(self, port: int, n: int, key: str) -> None:
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "_storebench.py"), "storm", str(port), str(n),
             key], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, bufsize=0)
        self._buf = b""

    def line(self, timeout: float) -> dict:
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"storm client {self.proc.pid} silent for {timeout:g}s")
            r, _, _ = select.select([fd], [], [], left)
            if r:
                chunk = os.read(fd, 65536)
                if not chunk:
                    self._err.seek(0)
                    raise RuntimeError(f"storm client died: "
                                       f"{self._err.read().decode(errors='replace')[-2000:]}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def tell(self, word: str) -> None:
        self.proc.stdin.write(word.encode() + b"\n")

    def finish(self) -> None:
        if self.proc.poll() is None:
            try:
                self.tell("close")
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def _storm_main(port: int, n: int, key: str, limit_s: float = 120.0) -> None:
    raise_nofile()
    addr = ("127.0.0.1", port)
    payload = enc_handshake(os.getpid() & 0xFFFFFF) + enc_add(key.encode(), 1)
    nonce = payload[6:10]
    socks = []
    for i in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        # Spread the clients over 16 loopback source addresses, the port picked at connect():
        # with one source address, 16,384 connections exhaust the even half of the ephemeral
        # range that connect() prefers, and the kernel's port search (client CPU) dominates.
        s.setsockopt(socket.IPPROTO_IP, _IP_BIND_ADDRESS_NO_PORT, 1)
        s.bind((f"127.0.0.{2 + i % _SOURCE_ADDRS}", 0))
        socks.append(s)
    byfd = {s.fileno(): s for s in socks}
    state = dict.fromkeys(byfd, _CONNECTING)
    got: dict[int, bytes] = {}
    ep = select.epoll(sizehint=n)
    print(json.dumps({"ready": n}), flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    counts = {"done": 0, "refused": 0, "reset": 0, "closed": 0, "bad_reply": 0, "other": 0}
    t0 = time.monotonic()
    deadline = t0 + limit_s
    pending = 0
    last_done = t0
    idx = 0
    batch = 256

    def fail(fd: int, kind: str) -> None:
        nonlocal pending
        counts[kind] += 1
        pending -= 1
        ep.unregister(fd)
        state.pop(fd)

    while (idx < n or pending) and time.monotonic() < deadline:
        # Connect in batches, handling replies in between, so early clients are not held back.
        for s in socks[idx:idx + batch]:
            rc = s.connect_ex(addr)
            fd = s.fileno()
            if rc not in (0, errno.EINPROGRESS):
                counts["refused" if rc == errno.ECONNREFUSED else "other"] += 1
                state.pop(fd)
                continue
            pending += 1
            # On loopback the handshake has usually completed inside connect(): send at once
            # and wait for EPOLLOUT only if it has not (client work kept out of the figure).
            try:
                s.send(payload)
            except BlockingIOError:
                ep.register(fd, select.EPOLLOUT)
                continue
            except OSError as e:
                counts["refused" if e.errno == errno.ECONNREFUSED else
                       "reset" if e.errno == errno.ECONNRESET else "other"] += 1
                pending -= 1
                state.pop(fd)
                continue
            state[fd] = _READING
            ep.register(fd, select.EPOLLIN)
        idx += batch
        events = ep.poll(0 if idx < n else min(1.0, max(0.0, deadline - time.monotonic())))
        for fd, ev in events:
            st = state.get(fd)
            if st is None:
                continue
            s = byfd[fd]
            if st == _CONNECTING:
                err = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    fail(fd, "refused" if err == errno.ECONNREFUSED else
                         "reset" if err == errno.ECONNRESET else "other")
                    continue
                try:
                    s.send(payload)
                except ConnectionResetError:
                    fail(fd, "reset")
                    continue
                except OSError:
                    fail(fd, "other")
                    continue
                state[fd] = _READING
                ep.modify(fd, select.EPOLLIN)
                continue
            try:
                data = s.recv(64)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                fail(fd, "reset")
                continue
            if not data:
                fail(fd, "closed")
                continue
            buf = got.get(fd, b"") + data
            if len(buf) < _REPLY:
                got[fd] = buf
                continue
            if buf[:4] != nonce or len(buf) != _REPLY:
                fail(fd, "bad_reply")
                continue
            counts["done"] += 1
            pending -= 1
            ep.unregister(fd)
            state.pop(fd)
            last_done = time.monotonic()
    counts["unfinished"] = pending + max(0, n - idx)
    print(json.dumps({"t0": t0, "t1": last_done, **counts}), flush=True)
    sys.stdin.readline()  # "close" (or EOF)
    linger = struct.pack("ii", 1, 0)
    for s in socks:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
        except OSError:
            pass
        s.close()


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        _worker_main()
    elif sys.argv[1] == "storm":
        _storm_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        sys.exit(f"usage: {sys.argv[0]} worker | storm PORT N KEY")
