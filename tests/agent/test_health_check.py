"""The health endpoint answers real HTTP requests: 200 JSON while alive, 503 when not."""

from __future__ import annotations

import http.client
import json
import os
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
