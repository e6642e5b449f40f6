"""Simulated hosts in network namespaces: each node has its own namespace and address.

A :class:`Cluster` makes one hub namespace holding a bridge, and one namespace per node joined
to the bridge by a veth pair (``eth0`` in the node, ``fe10<pid>v<i>`` in the hub). Nothing is
created in the caller's own namespace. A node's processes run under ``ip netns exec``, so they
see only their address (and a resolver pointing at 127.0.0.1, where nothing answers: torch's
reverse lookups fail at once instead of leaving the machine).

Failures, as production has them:

* :meth:`Cluster.kill` — SIGKILL of every process in the node (power loss: the kernel closes
  the sockets, peers see FIN/RST).
* :meth:`Cluster.freeze` — SIGSTOP of every process in the node; the kernel still ACKs, so
  only application heartbeats can tell.
* :meth:`Cluster.cut` — the node's veth link is set down in the hub: packets vanish, no FIN,
  no RST.

Every name carries ``fe10<pid>`` so parallel runs never collide, every loop is bounded, and
:meth:`Cluster.close` removes everything (processes first) whatever happened.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

SUBNET = "10.213.0"  # only inside namespaces this module creates; the hub's bridge has no address


class NetnsUnavailable(RuntimeError):
    """Network namespaces (or the ``ip`` tool) cannot be used here; the reason is the message."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def wait_for(cond: Callable[[], Any], timeout: float, what: str, step: float = 0.02) -> Any:
    """Polls ``cond`` until it returns something truthy or ``timeout`` passes (then raises)."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(step)


class Cluster:
    """``n`` simulated hosts; use as a context manager (``close`` always runs).

    Raises:
        NetnsUnavailable: when namespaces, veths or bridges cannot be made (not root, no ``ip``).
    """

    def __init__(self, n: int, tag: str = "") -> None:
        if n < 1 or n > 200:
            raise ValueError(f"1..200 nodes, got {n}")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` tool (iproute2) is not installed")
        self.n = n
        self.prefix = f"fe10{os.getpid()}{tag}"
        if len(self.prefix) + 4 > 15:  # interface names are at most 15 bytes
            self.prefix = self.prefix[:11]
        self.hub = f"{self.prefix}h"
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen[Any]] = []
        self._etc: list[Path] = []
        try:
            self._build()
        except BaseException as e:
            self.close()
            if isinstance(e, subprocess.CalledProcessError):
                raise NetnsUnavailable(
                    f"`{' '.join(e.cmd)}` failed: {(e.stderr or '').strip()}"
                ) from e
            raise

    # ------------------------------------------------------------------ topology

    def ns(self, i: int) -> str:
        return f"{self.prefix}n{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 2}"

    def veth(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.namespaces.append(name)
        etc = Path("/etc/netns") / name
        etc.mkdir(parents=True, exist_ok=True)
        self._etc.append(etc)
        (etc / "resolv.conf").write_text("nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._add_ns(self.hub)
        _ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.hub, "link", "set", "br0", "up")
        for i in range(self.n):
            self.add_node_ns(i)

    def add_node_ns(self, i: int) -> None:
        """Creates node ``i``'s namespace and its link (done for 0..n-1 at construction)."""
        ns = self.ns(i)
        self._add_ns(ns)
        _ip("-n", self.hub, "link", "add", self.veth(i), "type", "veth", "peer", "name", "eth0",
            "netns", ns)
        _ip("-n", self.hub, "link", "set", self.veth(i), "master", "br0", "up")
        _ip("-n", ns, "addr", "add", f"{self.addr(i)}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")

    # ------------------------------------------------------------------ processes

    def spawn(self, i: int, argv: Sequence[str], env: dict[str, str] | None = None,
              stdout: IO[Any] | int | None = None, stderr: IO[Any] | int | None = None,
              cwd: str | None = None, stdin: IO[Any] | int | None = subprocess.DEVNULL,
              ) -> subprocess.Popen[Any]:
        """Starts ``argv`` inside node ``i`` (in its own session)."""
        p = subprocess.Popen(
            ["ip", "netns", "exec", self.ns(i), *argv], env=env, stdout=stdout, stderr=stderr,
            stdin=stdin, cwd=cwd, start_new_session=True,
        )
        self.procs.append(p)
        return p

    def pids(self, i: int) -> list[int]:
        """Every process whose network namespace is node ``i``'s."""
        out = _ip("netns", "pids", self.ns(i), check=False).stdout
        return [int(x) for x in out.split()]

    def _signal_all(self, i: int, sig: int) -> list[int]:
        pids = self.pids(i)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        return pids

    def kill(self, i: int) -> None:
        """Power loss: SIGKILL every process of node ``i`` (repeated until none is left)."""
        for _ in range(50):
            if not self._signal_all(i, signal.SIGKILL):
                return
            time.sleep(0.01)
        raise RuntimeError(f"node {i}: processes survive SIGKILL: {self.pids(i)}")

    def freeze(self, i: int) -> None:
        """SIGSTOPs every process of node ``i``; repeated until no new process appears."""
        stopped: set[int] = set()
        for _ in range(50):
            pids = set(self._signal_all(i, signal.SIGSTOP))
            if pids <= stopped:
                return
            stopped |= pids
            time.sleep(0.005)
        raise RuntimeError(f"node {i}: processes keep appearing while freezing it")

    def thaw(self, i: int) -> None:
        self._signal_all(i, signal.SIGCONT)

    def cut(self, i: int) -> None:
        """Node ``i``'s link goes down in the hub: its packets vanish (no FIN, no RST)."""
        _ip("-n", self.hub, "link", "set", self.veth(i), "down")

    def heal(self, i: int) -> None:
        _ip("-n", self.hub, "link", "set", self.veth(i), "up")

    def partition(self, side: Iterable[int]) -> None:
        """Splits the network in two: the nodes of ``side`` move onto a bridge of their own,
        so they reach each other and nobody else (packets between the sides vanish: no FIN,
        no RST, as when a switch between two racks fails)."""
        if _ip("-n", self.hub, "link", "show", "br1", check=False).returncode != 0:
            _ip("-n", self.hub, "link", "add", "br1", "type", "bridge")
            _ip("-n", self.hub, "link", "set", "br1", "up")
        for i in side:
            _ip("-n", self.hub, "link", "set", self.veth(i), "master", "br1")

    def leftovers(self) -> dict[str, list[int]]:
        """Processes still alive in any node namespace (should be empty after a run)."""
        out = {}
        for ns in self.namespaces:
            if ns == self.hub:
                continue
            pids = [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]
            if pids:
                out[ns] = pids
        return out

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Kills every process of every node, then removes the namespaces and their files."""
        for ns in self.namespaces:
            if ns == self.hub:
                continue
            for _ in range(50):
                pids = [int(x) for x in _ip("netns", "pids", ns, check=False).stdout.split()]
                if not pids:
                    break
                for pid in pids:
                    for sig in (signal.SIGKILL, signal.SIGCONT):
                        try:
                            os.kill(pid, sig)
                        except ProcessLookupError:
                            pass
                time.sleep(0.01)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        for ns in reversed(self.namespaces):
            _ip("netns", "del", ns, check=False)
        self.namespaces.clear()
        for etc in self._etc:
            shutil.rmtree(etc, ignore_errors=True)
        self._etc.clear()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def cluster_or_skip(n: int, tag: str = "") -> Cluster:
    """A :class:`Cluster`, or a loud ``pytest.skip`` saying why namespaces are unavailable."""
    import pytest

    try:
        return Cluster(n, tag)
    except NetnsUnavailable as e:
        pytest.skip(f"!!! network namespaces unavailable ({e}); the recovery tests need root "
                    "and iproute2")
