"""The health endpoint answers real HTTP requests: 200 JSON while alive, 503 when not."""

from __future__ import annotations

import http.client
import json
import os
import socket
import threading
import time

import pytest

from fastelastic.agent.server.health_check_server import (
    HealthCheckServer,
    create_healthcheck_server,
)


def get(port: int, path: str = "/health") -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        body = resp.read()
        return resp.status, (json.loads(body) if resp.status in (200, 503) else {})
    finally:
        conn.close()


def fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_alive_then_dead_then_stopped():
    progress = {"t": int(time.time())}
    state = {"state": "HEALTHY", "restart_count": 2, "workers": [{"pid": 1, "local_rank": 0}]}
    before = fds()
    srv = HealthCheckServer(
        lambda: progress["t"], 0, 30, status_callback=lambda: dict(state), host="127.0.0.1"
    )
    srv.start()
    try:
        code, body = get(srv.port)
        assert code == 200 and body["healthy"] is True
        assert body["state"] == "HEALTHY" and body["restart_count"] == 2
        assert body["workers"] == [{"pid": 1, "local_rank": 0}]
        progress["t"] -= 120  # no progress for two minutes
        code, body = get(srv.port)
        assert code == 503 and body["healthy"] is False and body["seconds_since_progress"] >= 120
        progress["t"] += 120
        state["state"] = "FAILED"
        assert get(srv.port)[0] == 503
        assert get(srv.port, "/nope")[0] == 404
    finally:
        srv.stop()
    with pytest.raises(OSError):
        get(srv.port)
    srv.stop()  # idempotent
    assert fds() == before


def test_broken_callback_reports_unhealthy():
    srv = HealthCheckServer(lambda: 1 // 0, 0, 30, host="127.0.0.1")
    srv.start()
    try:
        code, body = get(srv.port)
        assert code == 503 and "ZeroDivisionError" in body["error"]
    finally:
        srv.stop()


def test_factory_matches_torch_signature():
    srv = create_healthcheck_server(alive_callback=lambda: 0, port=0, timeout=60)
    assert isinstance(srv, HealthCheckServer) and srv.alive_callback() == 0
    with pytest.raises(ValueError):
        HealthCheckServer(lambda: 0, 70000, 1)


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _read_all(s: socket.socket, limit: float = 10.0) -> bytes:
    """Reads until the server closes (or resets) the connection; fails after ``limit`` s."""
    s.settimeout(limit)
    chunks = []
    while True:
        try:
            data = s.recv(4096)
        except ConnectionResetError:
            break
        if not data:
            break
        chunks.append(data)
    return b"".join(chunks)


def _trickle(s: socket.socket, data: bytes, gap: float, stop: threading.Event) -> None:
    """Sends ``data`` one byte every ``gap`` seconds until done, cut off, or ``stop``."""
    for b in data:
        if stop.wait(gap):
            return
        try:
            s.send(bytes([b]))
        except OSError:
            return


def test_trickling_and_silent_clients_are_cut_at_the_absolute_deadline():
    srv = HealthCheckServer(lambda: int(time.time()), 0, 30, host="127.0.0.1",
                            request_timeout=2.0)
    srv.start()
    stop = threading.Event()
    try:
        slow = _connect(srv.port)
        silent = _connect(srv.port)
        # A byte every 0.2 s: every single recv completes well within any per-read timeout,
        # and the whole request would need 5 s.
        t = threading.Thread(
            target=_trickle, args=(slow, b"GET /health HTTP/1.0\r\n\r\n", 0.2, stop), daemon=True
        )
        start = time.monotonic()
        t.start()
        # Meanwhile the server answers others at once.
        assert get(srv.port)[0] == 200
        assert time.monotonic() - start < 1.5
        got = _read_all(slow)
        cut_after = time.monotonic() - start
        assert got == b"", got  # cut off before its request was complete: no answer at all
        assert 1.8 <= cut_after <= 3.5, f"trickling client cut after {cut_after:.2f}s"
        assert _read_all(silent) == b""
        assert time.monotonic() - start <= 3.5
        assert get(srv.port)[0] == 200
    finally:
        stop.set()
        srv.stop()
        slow.close()
        silent.close()


def test_connections_beyond_the_cap_get_503_and_the_server_recovers():
    srv = HealthCheckServer(lambda: int(time.time()), 0, 30, host="127.0.0.1",
                            max_connections=2, request_timeout=30.0)
    srv.start()
    idle = [_connect(srv.port), _connect(srv.port)]
    try:
        # Accepted in order: the two idle ones hold both slots when this one arrives.
        third = _connect(srv.port)
        third.sendall(b"GET /health HTTP/1.0\r\n\r\n")
        answer = _read_all(third)
        third.close()
        assert answer.startswith(b"HTTP/1.0 503") and b"too many" in answer, answer
        for s in idle:
            s.close()  # the server sees EOF and frees the slots

        def ok() -> bool:
            try:
                return get(srv.port)[0] == 200
            except (OSError, ValueError):  # refused, or still the plain-text 503 of a full server
                return False

        deadline = time.monotonic() + 10
        while not ok():
            assert time.monotonic() < deadline, "slots were not freed after the clients left"
            time.sleep(0.02)
    finally:
        srv.stop()


def test_stop_returns_promptly_with_slow_clients_connected():
    before = fds()
    srv = HealthCheckServer(lambda: int(time.time()), 0, 30, host="127.0.0.1",
                            max_connections=4, request_timeout=60.0)
    srv.start()
    stop = threading.Event()
    clients = [_connect(srv.port) for _ in range(6)]  # 4 held + 2 refused
    threads = [
        threading.Thread(target=_trickle, args=(c, b"GET /health HTTP/1.0\r\n", 0.3, stop),
                         daemon=True)
        for c in clients[:2]
    ]
    try:
        for t in threads:
            t.start()
        # Wait until the server holds its 4 connections (the 2 extra are answered 503).
        for c in clients[4:]:
            assert _read_all(c).startswith(b"HTTP/1.0 503")
        start = time.monotonic()
        srv.stop()
        took = time.monotonic() - start
        assert took < 3.0, f"stop() took {took:.2f}s with slow clients connected"
        for c in clients[:4]:
            assert _read_all(c, 5.0) == b""  # cut, not left hanging
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for c in clients:
            c.close()
    assert fds() == before


def test_bad_limits_are_refused():
    with pytest.raises(ValueError, match="max_connections"):
        HealthCheckServer(lambda: 0, 0, 1, max_connections=0)
    with pytest.raises(ValueError, match="request_timeout"):
        HealthCheckServer(lambda: 0, 0, 1, request_timeout=0)
