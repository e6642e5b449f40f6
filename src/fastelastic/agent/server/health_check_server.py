"""HTTP health endpoint of the agent (``GET /health``), as Kubernetes liveness probes expect."""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["HealthCheckServer", "create_healthcheck_server"]

logger = logging.getLogger(__name__)

# Ours: address the health server binds (default: every interface, so a probe can reach it).
FASTELASTIC_HEALTH_CHECK_ADDR = "FASTELASTIC_HEALTH_CHECK_ADDR"
_UNHEALTHY_STATES = frozenset({"FAILED", "UNHEALTHY", "UNKNOWN"})


class HealthCheckServer:
    """Serves ``GET /health``: 200 with a JSON status while alive, 503 when not.

    Alive means ``alive_callback()`` (the last progress time, integer wall-clock seconds, as
    torch's watchdog reports it) is at most ``timeout`` seconds old and the worker group is not
    in a FAILED, UNHEALTHY or UNKNOWN state.

    Args:
        alive_callback: returns the last progress time of the agent (seconds since the epoch).
        port: TCP port to listen on (0 picks a free one; read ``port`` after ``start``).
        timeout: seconds without progress after which the agent is reported dead.
        status_callback: returns extra JSON fields (state, restart count, workers...).
        host: address to bind; default ``$FASTELASTIC_HEALTH_CHECK_ADDR`` or all interfaces.
    """

    def __init__(
        self,
        alive_callback: Callable[[], int],
        port: int,
        timeout: int,
        status_callback: Callable[[], dict[str, Any]] | None = None,
        host: str | None = None,
    ) -> None:
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"health check port out of range: {port}")
        self._alive_callback = alive_callback
        self._port = int(port)
        self._timeout = timeout
        self._status_callback = status_callback
        self._host = host if host is not None else os.environ.get(FASTELASTIC_HEALTH_CHECK_ADDR, "")
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1

    @property
    def alive_callback(self) -> Callable[[], int]:
        """The callback returning the last progress time."""
        return self._alive_callback

    @property
    def port(self) -> int:
        """The port listened on (the real one once started with port 0)."""
        return self._port

    def set_status_callback(self, callback: Callable[[], dict[str, Any]] | None) -> None:
        """Sets the callback whose dict is merged into every ``/health`` answer."""
        self._status_callback = callback

    def status(self) -> tuple[int, dict[str, Any]]:
        """Returns ``(http_status, body)`` as ``GET /health`` would answer now."""
        body: dict[str, Any] = {}
        if self._status_callback is not None:
            try:
                body.update(self._status_callback())
            except Exception as e:  # noqa: BLE001 - a broken callback means "unhealthy"
                body["error"] = f"status callback failed: {e!r}"
        try:
            last = int(self._alive_callback())
        except Exception as e:  # noqa: BLE001
            body["error"] = f"alive callback failed: {e!r}"
            last = 0
        age = int(time.time()) - last  # both are wall-clock labels from the watchdog
        body["last_progress_time"] = last
        body["seconds_since_progress"] = age
        body["timeout"] = self._timeout
        healthy = "error" not in body and age <= self._timeout
        healthy = healthy and str(body.get("state", "")) not in _UNHEALTHY_STATES
        body["healthy"] = healthy
        return (200 if healthy else 503), body

    def start(self) -> None:
        """Binds the port and serves in a daemon thread.

        Raises:
            OSError: the port could not be bound.
        """
        if self._httpd is not None:
            return
        server = self

        class _Handler(BaseHTTPRequestHandler):
            timeout = 5  # a stalled client cannot hold a handler thread forever

            def do_GET(self) -> None:
                if self.path.split("?", 1)[0].rstrip("/") not in ("/health", ""):
                    self.send_error(404, "try GET /health")
                    return
                code, body = server.status()
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("health check: " + format, *args)

        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        # Non-daemon handler threads + block_on_close: stop() returns only once every
        # connection is closed, so no socket outlives the server.
        httpd_cls = type(
            "_HealthHTTPServer",
            (ThreadingHTTPServer,),
            {"address_family": family, "daemon_threads": False, "block_on_close": True},
        )
        self._httpd = httpd_cls((self._host, self._port), _Handler)
        self._port = int(self._httpd.server_address[1])
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._serve, name="fastelastic-health", daemon=True)
        self._thread.start()
        logger.info("health check server listening on %s:%s", self._host or "*", self._port)

    def _serve(self) -> None:
        httpd = self._httpd
        assert httpd is not None
        # Block until a connection or the stop pipe: no periodic wake-ups while idle.
        with selectors.DefaultSelector() as sel:
            sel.register(httpd.socket, selectors.EVENT_READ, "accept")
            sel.register(self._wake_r, selectors.EVENT_READ, "stop")
            while True:
                events = sel.select()
                if any(key.data == "stop" for key, _ in events):
                    return
                httpd._handle_request_noblock()  # type: ignore[attr-defined]  # accept + hand to a thread

    def stop(self) -> None:
        """Stops serving and closes the socket (idempotent)."""
        if self._httpd is None:
            return
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(10)
        self._httpd.server_close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._httpd, self._thread = None, None
        logger.info("health check server stopped")


def create_healthcheck_server(
    alive_callback: Callable[[], int],
    port: int,
    timeout: int,
) -> HealthCheckServer:
    """Creates (without starting) the health check server."""
    return HealthCheckServer(alive_callback, port, timeout)
