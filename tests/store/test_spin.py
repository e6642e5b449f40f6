"""Spin-then-block waiting in the store's server loop and client (``FASTELASTIC_STORE_SPIN_US``).

Spinning must change nothing but latency: every semantic holds with and without it, a quiet
server goes back to sleep, and a peer whose requests come slower than the budget stops being
spun for (back-off) instead of costing a core.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from fastelastic.errors import StoreError
from fastelastic.store import TCPStore
from fastelastic.store._hosting import DEFAULT_SPIN_US, SPIN_ENV, spin_us

from .conftest import wait_until


def test_spin_budget_from_env(monkeypatch):
    monkeypatch.delenv(SPIN_ENV, raising=False)
    assert spin_us() == DEFAULT_SPIN_US
    monkeypatch.setenv(SPIN_ENV, "0")
    assert spin_us() == 0
    monkeypatch.setenv(SPIN_ENV, " 250 ")
    assert spin_us() == 250
    for bad in ("fast", "-1", "1e3", "100001"):
        monkeypatch.setenv(SPIN_ENV, bad)
        with pytest.raises(StoreError, match=SPIN_ENV):
            spin_us()


def test_bad_env_fails_hosting_with_the_variable_named(monkeypatch):
    monkeypatch.setenv(SPIN_ENV, "soon")
    with pytest.raises(StoreError, match=f"{SPIN_ENV}='soon'"):
        TCPStore("127.0.0.1", 0, is_master=True, timeout=5)


@pytest.mark.parametrize("server_spin,client_spin", [("0", "0"), ("0", "300"), ("300", "0"),
                                                     ("300", "300")])
def test_semantics_with_and_without_spinning(monkeypatch, server_spin, client_spin):
    monkeypatch.setenv(SPIN_ENV, server_spin)
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    try:
        monkeypatch.setenv(SPIN_ENV, client_spin)
        a = TCPStore("127.0.0.1", master.port, timeout=10)
        b = TCPStore("127.0.0.1", master.port, timeout=10)
        a.set("k", b"v" * 100_000)  # a reply bigger than one recv
        assert a.get("k") == b"v" * 100_000
        assert [a.add("n", 1) for _ in range(200)][-1] == 200
        assert a.compare_set("c", "", "x") == b"x"
        # a get that blocks well past the spin budget, released by another client
        late = threading.Timer(0.05, lambda: b.set("late", "here"))
        late.start()
        assert a.get("late") == b"here"
        late.join()
        with pytest.raises(StoreError):
            a.wait(["never"], 0.05)
        assert a.add("n", 0) == 200  # still usable after the cancelled wait
    finally:
        master.shutdown_server()


def _cpu_s(pid: int) -> float:
    """On-CPU time of every thread of pid, in seconds (ns resolution, from schedstat)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
            total += int(f.read().split()[0])
    return total / 1e9


@pytest.fixture
def spinning_server():
    """A standalone server with a 2 ms budget, so a spin that never stops would show at once."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0",
         "--spin-us", "2000"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "listening on" in line, line
        yield proc, int(line.rsplit(":", 1)[1])
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


@pytest.mark.timeout(60)
def test_quiet_server_goes_back_to_sleep(spinning_server, monkeypatch):
    proc, port = spinning_server
    monkeypatch.setenv(SPIN_ENV, "0")
    c = TCPStore("127.0.0.1", port, timeout=10)
    for _ in range(500):
        c.add("burst", 1)
    assert c.add("burst", 0) == 500
    cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
    wait_until(lambda: time.monotonic() - t0 >= 1.0, timeout=5, what="one idle second")
    idle_cpu = _cpu_s(proc.pid) - cpu0
    # One spin of 2 ms after the burst, then asleep; a loop that kept spinning would use ~1 s.
    assert idle_cpu < 0.1, f"idle server used {idle_cpu:.3f} s of CPU in one second"


def _paced(proc, port, monkeypatch, op) -> tuple[float, int, TCPStore]:
    """Runs op(client, i) every 4 ms for 2 s; returns the server's CPU share over that time,
    how many ops ran, and the client."""
    monkeypatch.setenv(SPIN_ENV, "0")
    c = TCPStore("127.0.0.1", port, timeout=10)
    cpu0, t0 = _cpu_s(proc.pid), time.monotonic()
    sent = 0
    while time.monotonic() - t0 < 2.0 and sent < 2000:
        op(c, sent)
        sent += 1
        time.sleep(0.004)  # pacing the load, not synchronisation
    return (_cpu_s(proc.pid) - cpu0) / (time.monotonic() - t0), sent, c


@pytest.mark.timeout(60)
def test_sparse_requests_back_off(spinning_server, monkeypatch):
    """Requests every 4 ms with a 2 ms budget: every spin would be in vain; back-off keeps the
    server's CPU far below the ~50% that spinning after each request would burn."""
    used, sent, c = _paced(*spinning_server, monkeypatch, lambda c, i: c.add("paced", 1))
    assert c.add("paced", 0) == sent
    assert used < 0.25, f"server used {used:.0%} of a core serving one ADD per 4 ms"


@pytest.mark.timeout(60)
def test_no_spin_after_fire_and_forget_writes(spinning_server, monkeypatch):
    """Nobody waits on a SET, so the server does not spin after one: a paced stream of SETs
    costs it almost nothing (spinning, even with back-off, would cost ~6% here)."""
    used, sent, c = _paced(*spinning_server, monkeypatch, lambda c, i: c.set("paced", str(i)))
    assert c.get("paced") == str(sent - 1).encode()
    assert used < 0.015, f"server used {used:.1%} of a core serving one SET per 4 ms"


def test_handshake_limit_from_the_environment(monkeypatch):
    """FASTELASTIC_STORE_HANDSHAKE_MS sets a hosted server's handshake limit; bad values are
    refused naming the variable."""
    from fastelastic.errors import StoreError
    from fastelastic.store._hosting import HANDSHAKE_ENV, handshake_ms

    monkeypatch.delenv(HANDSHAKE_ENV, raising=False)
    assert handshake_ms() == 1000
    monkeypatch.setenv(HANDSHAKE_ENV, "60000")
    assert handshake_ms() == 60000
    for bad in ("0", "-1", "1.5", "soon"):
        monkeypatch.setenv(HANDSHAKE_ENV, bad)
        with pytest.raises(StoreError, match=HANDSHAKE_ENV):
            handshake_ms()
