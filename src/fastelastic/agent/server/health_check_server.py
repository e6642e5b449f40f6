"""HTTP health endpoint of the agent (``GET /health``), as Kubernetes liveness probes expect.

``GET /metrics`` on the same port answers in Prometheus's text exposition format: every metric
the process publishes with ``put_metric`` (torch's names, see ``fastelastic.metrics.prometheus``),
the agent's live status and the process's CPU and memory. It needs ``prometheus_client``
(``pip install 'fastelastic[metrics]'``); without it ``/metrics`` answers 501 and says so.

The server never holds up the agent: each connection is served by a daemon thread, at most
``max_connections`` at a time (more get a 503 at once), and a connection that has not been
answered ``request_timeout`` seconds after it was accepted is cut off, however slowly its client
trickles bytes. ``stop()`` cuts every open connection and returns within about a second.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any

from fastelastic.metrics import prometheus

__all__ = ["HealthCheckServer", "create_healthcheck_server"]

logger = logging.getLogger(__name__)

# Ours: address the health server binds (default: every interface, so a probe can reach it).
FASTELASTIC_HEALTH_CHECK_ADDR = "FASTELASTIC_HEALTH_CHECK_ADDR"
_UNHEALTHY_STATES = frozenset({"FAILED", "UNHEALTHY", "UNKNOWN"})
# Sent (without blocking) to a client beyond the connection cap, then the socket is closed.
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 29\r\n"
    b"Connection: close\r\n\r\ntoo many health check clients"
)
# How long stop() waits for the handler threads after cutting their connections.
_STOP_JOIN_S = 1.0


class _Handler(BaseHTTPRequestHandler):
    """One request per connection (HTTP/1.0); ``server`` is the HealthCheckServer."""

    server: HealthCheckServer  # type: ignore[assignment]

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, send_body: bool) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        if path in ("/health", ""):
            code, body = self.server.status()
            data, ctype = json.dumps(body).encode(), "application/json"
        else:
            route = self.server._routes.get(path)
            if route is None:
                self.send_error(404, "try GET /health or GET /metrics")
                return
            code, ctype, data = route(self.headers.get("Accept", ""))
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if send_body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("health check: " + format, *args)


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
        max_connections: connections served at once; more are answered 503 and closed.
        request_timeout: seconds from accepting a connection to the end of its answer; a client
            still sending its request (or not reading the answer) then is disconnected.
        metrics_handler: what ``GET /metrics`` exports; default: the process-wide exporter
            (``fastelastic.metrics.prometheus.exporter()``), attached when the server starts.
    """

    def __init__(
        self,
        alive_callback: Callable[[], int],
        port: int,
        timeout: int,
        status_callback: Callable[[], dict[str, Any]] | None = None,
        host: str | None = None,
        max_connections: int = 16,
        request_timeout: float = 5.0,
        metrics_handler: prometheus.PrometheusMetricHandler | None = None,
    ) -> None:
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"health check port out of range: {port}")
        if int(max_connections) < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        if not float(request_timeout) > 0:
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self._alive_callback = alive_callback
        self._port = int(port)
        self._timeout = timeout
        self._status_callback = status_callback
        self._host = host if host is not None else os.environ.get(FASTELASTIC_HEALTH_CHECK_ADDR, "")
        self._max_connections = int(max_connections)
        self._request_timeout = float(request_timeout)
        # Extra GET routes: path -> (Accept header) -> (status, content type, body).
        self._routes: dict[str, Callable[[str], tuple[int, str, bytes]]] = {
            "/metrics": self._metrics
        }
        self._metrics_handler = metrics_handler
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        # Open connections -> (absolute deadline, handler thread). A connection leaves the map
        # (under the lock) before its socket is closed, so a cut never hits a reused fd.
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, tuple[float, threading.Thread]] = {}

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

    def _metrics(self, accept: str) -> tuple[int, str, bytes]:
        """``GET /metrics``: the Prometheus text format (OpenMetrics if the client asks for it),
        or 501 without prometheus_client."""
        try:
            ctype, data = prometheus.generate_latest(
                self._metrics_handler or prometheus.exporter(),
                prometheus.AgentStatusCollector(self.status),
                prometheus.process_collector(),
                accept=accept,
            )
        except prometheus.PrometheusUnavailableError as e:
            return 501, "text/plain; charset=utf-8", f"{e}\n".encode()
        return 200, ctype, data

    def start(self) -> None:
        """Binds the port and serves in a daemon thread.

        Raises:
            OSError: the port could not be bound.
        """
        if self._listener is not None:
            return
        if self._metrics_handler is None and prometheus.available():
            self._metrics_handler = prometheus.exporter()  # records from now on
        family = socket.AF_INET6 if ":" in self._host else socket.AF_INET
        listener = socket.create_server((self._host, self._port), family=family, backlog=64)
        listener.setblocking(False)
        os.set_inheritable(listener.fileno(), False)
        self._listener = listener
        self._port = int(listener.getsockname()[1])
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._thread = threading.Thread(target=self._serve, name="fastelastic-health", daemon=True)
        self._thread.start()
        logger.info("health check server listening on %s:%s", self._host or "*", self._port)

    def _serve(self) -> None:
        listener = self._listener
        assert listener is not None
        # Blocks until a connection, the stop pipe, or the earliest request deadline: no
        # periodic wake-ups while idle.
        with selectors.DefaultSelector() as sel:
            sel.register(listener, selectors.EVENT_READ, "accept")
            sel.register(self._wake_r, selectors.EVENT_READ, "stop")
            while True:
                with self._lock:
                    first = min((d for d, _ in self._conns.values()), default=None)
                timeout = None if first is None else max(0.0, first - time.monotonic())
                events = sel.select(timeout)
                if any(key.data == "stop" for key, _ in events):
                    return
                if events:
                    self._accept(listener)
                self._cut(time.monotonic())

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):  # bounded per wake-up; the selector reports a non-empty backlog again
            try:
                conn, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and friends: refuse this one, keep serving
                logger.warning("health check server could not accept: %s", e)
                return
            with self._lock:
                full = len(self._conns) >= self._max_connections
                if not full:
                    deadline = time.monotonic() + self._request_timeout
                    conn.settimeout(self._request_timeout)  # and each recv/send within it
                    t = threading.Thread(
                        target=self._handle,
                        args=(conn, addr),
                        name="fastelastic-health-conn",
                        daemon=True,
                    )
                    self._conns[conn] = (deadline, t)
                    t.start()
            if full:
                try:
                    conn.send(_BUSY, socket.MSG_DONTWAIT)
                except OSError:
                    pass
                conn.close()
                logger.warning(
                    "health check server: %d clients already connected, refused one",
                    self._max_connections,
                )

    def _handle(self, conn: socket.socket, addr: Any) -> None:
        try:
            _Handler(conn, addr, self)  # type: ignore[arg-type]  # only the attributes it uses
        except Exception as e:  # noqa: BLE001 - a cut or broken client ends only its connection
            logger.debug("health check connection from %s ended: %r", addr, e)
        finally:
            with self._lock:
                self._conns.pop(conn, None)
                try:
                    conn.close()
                except OSError:
                    pass

    def _cut(self, now: float, everyone: bool = False) -> None:
        """Shuts down the connections past their deadline (all of them if ``everyone``)."""
        with self._lock:
            for conn, (deadline, _) in self._conns.items():
                if everyone or deadline <= now:
                    try:
                        conn.shutdown(socket.SHUT_RDWR)  # wakes the handler thread's recv/send
                    except OSError:
                        pass

    def stop(self) -> None:
        """Stops serving, cuts every open connection and closes the socket (idempotent).

        Returns within about a second whatever the clients do: the handler threads are daemons,
        and one still busy after its connection was cut is left to finish on its own.
        """
        if self._listener is None:
            return
        os.write(self._wake_w, b"x")
        if self._thread is not None:
            self._thread.join(_STOP_JOIN_S)
        self._cut(0.0, everyone=True)
        with self._lock:
            threads = [t for _, t in self._conns.values()]
        deadline = time.monotonic() + _STOP_JOIN_S
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self._listener, self._thread = None, None
        logger.info("health check server stopped")


def create_healthcheck_server(
    alive_callback: Callable[[], int],
    port: int,
    timeout: int,
) -> HealthCheckServer:
    """Creates (without starting) the health check server."""
    return HealthCheckServer(alive_callback, port, timeout)
