"""Store-benchmark helpers: server subprocesses, /proc readings, the light raw client, workers.

The benchmarks start two kinds of helper process:

* ``_storebench.py worker`` (this file run as a script) -- reads JSON commands on stdin and
  answers one JSON line each. It drives real store clients (torch's ``TCPStore`` or ours) from
  threads, so the clients of a throughput run live in several processes, and a run that may
  never end (torch's 100,000-key ``multi_get``) can be bounded by killing the worker.
* ``stormclient PORT N KEY`` (``stormclient.c``, compiled with ``cc`` on first use) -- the light
  client of the connection storm: N raw non-blocking sockets on one epoll, each sending the
  pre-encoded VALIDATE+PING+ADD in one write and reading the 4+8 byte reply. Lines on stdin
  (``go``, ``close``) pace it; it answers JSON. It is C so that the clients' own CPU stays out
  of the figure; nearly all that remains is the kernel's loopback TCP work in connect and send.
"""

from __future__ import annotations

import json
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

VALUE64 = "v" * 64
HERE = os.path.dirname(os.path.abspath(__file__))


def raise_nofile() -> int:
    """Raises the soft RLIMIT_NOFILE to the hard limit (20,000 here); returns the new soft one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


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
    for head, vals in zip(lines[::2], lines[1::2], strict=False):
        if head.startswith("TcpExt:"):
            return int(dict(zip(head.split()[1:], vals.split()[1:], strict=True))["ListenDrops"])
    return 0


def write_results_json(path: str, benchmark: str, payload: dict) -> None:
    """Writes a benchmark's figures as JSON (``benchmarks/plot.py`` reads them), atomically.

    ``payload`` is the benchmark's own layout; the file adds which benchmark, when, and where.
    """
    import platform
    from datetime import datetime, timezone

    doc = {
        "benchmark": benchmark,
        "written_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg": [round(x, 2) for x in os.getloadavg()]},
        **payload,
    }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


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


BASELINE_ENV = "FE_BENCH_BASELINE"


class ServerProc:
    """One store server in its own process, so its CPU and RSS can be read from /proc.

    ``fastelastic``: ``python -m fastelastic.store --host 127.0.0.1 --port 0``.
    ``torch``: a script hosting ``torch.distributed.TCPStore(is_master=True)`` (libuv server).
    """

    def __init__(self, impl: str, start_timeout: float = 180.0) -> None:
        self.impl = impl
        if impl == "fastelastic":
            cmd = [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0"]
        elif impl == "torch" and os.environ.get(BASELINE_ENV):
            # A/B of two fastelastic builds in one run: the "torch" column is the server of the
            # source tree named by FE_BENCH_BASELINE (e.g. a checkout of the previous commit with
            # its .so files), so every server row compares the new build against the old.
            cmd = [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0"]
        elif impl == "torch":
            cmd = [sys.executable, "-c", _TORCH_SERVER]
        else:
            raise ValueError(f"unknown impl {impl!r}")
        env = None
        if impl == "torch" and os.environ.get(BASELINE_ENV):
            env = dict(os.environ, PYTHONPATH=os.environ[BASELINE_ENV])
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err,
                                     stdin=subprocess.DEVNULL, env=env)
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

STORM_SOURCE = os.path.join(HERE, "stormclient.c")


def storm_binary() -> str:
    """Path of the compiled ``stormclient.c``, built with ``cc -O2`` on first use and rebuilt
    when the source is newer than the binary.

    It lives in ``$XDG_CACHE_HOME/fastelastic-bench`` (default ``~/.cache``); the build writes a
    temporary file and renames it, so concurrent sessions never run a half-written binary.

    Raises:
        RuntimeError: there is no ``cc`` on PATH, or the build failed.
    """
    cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                         "fastelastic-bench")
    exe = os.path.join(cache, "stormclient")
    try:
        if os.stat(exe).st_mtime >= os.stat(STORM_SOURCE).st_mtime:
            return exe
    except FileNotFoundError:
        pass
    cc = shutil.which("cc")
    if cc is None:
        raise RuntimeError("!!! the storm benchmarks need a C compiler: no `cc` on PATH to "
                           f"build {STORM_SOURCE}")
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="stormclient.", dir=cache)
    os.close(fd)
    try:
        out = subprocess.run([cc, "-O2", "-o", tmp, STORM_SOURCE], capture_output=True,
                             text=True)
        if out.returncode != 0:
            raise RuntimeError(f"cc -O2 {STORM_SOURCE} failed:\n{out.stderr}")
        os.replace(tmp, exe)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return exe


class StormClient:
    """A separate process holding N light clients: the compiled ``stormclient.c``.

    Protocol: the process creates N non-blocking sockets and prints ``{"ready": ...}``; on
    ``go`` it storms and prints the result; on ``close`` it closes every socket (RST, so no
    TIME_WAIT is left behind) and exits.
    """

    def __init__(self, port: int, n: int, key: str, barrier: tuple[str, int] | None = None
                 ) -> None:
        extra = [barrier[0], str(barrier[1])] if barrier else []
        self._err = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([storm_binary(), str(port), str(n), key, *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, bufsize=0)
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


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        _worker_main()
    else:
        sys.exit(f"usage: {sys.argv[0]} worker")
