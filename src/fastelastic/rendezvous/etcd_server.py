"""``EtcdServer``: starts a local, single-member etcd on free ports (tests, single-node jobs).

The same class as torch's ``rendezvous.etcd_server``, on etcd's v3 API: ``get_client()`` returns
an ``etcd3gw`` client (torch's returns a v2 ``python-etcd`` client), and the endpoint it reports
works with ``--rdzv-backend etcd``. The binary is ``$TORCHELASTIC_ETCD_BINARY_PATH``, else
``bin/etcd`` next to this file, else ``etcd`` on ``PATH``.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import tempfile
import time
from typing import Any, TextIO

from fastelastic.utils.api import get_socket_with_port as find_free_port

__all__ = ["EtcdServer", "find_free_port", "stop_etcd"]

logger = logging.getLogger(__name__)


def stop_etcd(subprocess: subprocess.Popen | None, data_dir: str | None = None) -> None:
    """Terminates the etcd process (if running) and removes ``data_dir``."""
    if subprocess is not None and subprocess.poll() is None:
        logger.info("stopping etcd server")
        subprocess.terminate()
        try:
            subprocess.wait(30)
        except Exception:
            subprocess.kill()
            subprocess.wait()
    if data_dir:
        logger.info("deleting etcd data dir: %s", data_dir)
        shutil.rmtree(data_dir, ignore_errors=True)


class EtcdServer:
    """A standalone etcd server on ``127.0.0.1`` and a free port, in its own data directory.

    ``start()`` returns once etcd answers requests; ``stop()`` terminates it and removes the data
    directory (an ``atexit`` hook does the same if you forget). Usage::

        server = EtcdServer()
        server.start()
        endpoint = server.get_endpoint()      # "127.0.0.1:<port>", for --rdzv-endpoint
        server.stop()

    Args:
        data_dir: where etcd keeps its data (default: a new temporary directory).
    """

    def __init__(self, data_dir: str | None = None) -> None:
        self._port = -1
        self._host = "127.0.0.1"  # torch: "localhost"; an address never needs resolving
        binary = os.environ.get(
            "TORCHELASTIC_ETCD_BINARY_PATH", os.path.join(os.path.dirname(__file__), "bin/etcd")
        )
        self._etcd_binary_path = binary if os.path.isfile(binary) else "etcd"
        self._base_data_dir = data_dir or tempfile.mkdtemp(prefix="torchelastic_etcd_data")
        self._etcd_cmd: list[str] | None = None
        self._etcd_proc: subprocess.Popen | None = None

    def _get_etcd_server_process(self) -> subprocess.Popen:
        if self._etcd_proc is None:
            raise RuntimeError("No etcd server process started. Call etcd_server.start() first")
        return self._etcd_proc

    def get_port(self) -> int:
        """The client port."""
        return self._port

    def get_host(self) -> str:
        """The host clients connect to."""
        return self._host

    def get_endpoint(self) -> str:
        """``host:port`` for clients (``--rdzv-endpoint``)."""
        return f"{self._host}:{self._port}"

    def start(
        self, timeout: int = 60, num_retries: int = 3, stderr: int | TextIO | None = None
    ) -> None:
        """Starts etcd and waits until it serves requests, retrying on new ports.

        Args:
            timeout: seconds each attempt may take to become ready.
            num_retries: attempts before giving up.
            stderr: etcd's stderr (as ``subprocess.Popen`` takes it).

        Raises:
            TimeoutError: etcd did not become ready within ``timeout``.
            RuntimeError: etcd exited while starting.
        """
        attempt = 0
        while True:
            data_dir = os.path.join(self._base_data_dir, str(attempt))
            os.makedirs(data_dir, mode=0o700, exist_ok=True)
            try:
                self._start(data_dir, timeout, stderr)
                break
            except Exception as e:
                attempt += 1
                stop_etcd(self._etcd_proc)
                logger.warning("Failed to start etcd server, got error: %s, retrying", e)
                if attempt >= num_retries:
                    shutil.rmtree(self._base_data_dir, ignore_errors=True)
                    raise
        atexit.register(stop_etcd, self._etcd_proc, self._base_data_dir)

    def _start(self, data_dir: str, timeout: float, stderr: int | TextIO | None) -> None:
        sock, peer = find_free_port(), find_free_port()
        self._port = sock.getsockname()[1]
        peer_port = peer.getsockname()[1]
        url = f"http://{self._host}:{self._port}"
        self._etcd_cmd = [
            self._etcd_binary_path,
            "--data-dir", data_dir,
            "--listen-client-urls", url,
            "--advertise-client-urls", url,
            "--listen-peer-urls", f"http://{self._host}:{peer_port}",
            "--initial-advertise-peer-urls", f"http://{self._host}:{peer_port}",
            "--initial-cluster", f"default=http://{self._host}:{peer_port}",
        ]
        logger.info("Starting etcd server: %s", self._etcd_cmd)
        sock.close()
        peer.close()
        self._etcd_proc = subprocess.Popen(self._etcd_cmd, close_fds=True, stderr=stderr)
        self._wait_for_ready(timeout)

    def get_client(self) -> Any:
        """An ``etcd3gw`` (v3 API) client of this server (needs ``fastelastic[etcd]``)."""
        import etcd3gw

        return etcd3gw.client(host=self._host, port=self._port, timeout=10)

    def _wait_for_ready(self, timeout: float = 60) -> None:
        import etcd3gw

        client = etcd3gw.client(host=self._host, port=self._port, timeout=5)
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            proc = self._get_etcd_server_process()
            if proc.poll() is not None:
                raise RuntimeError(f"Etcd server process exited with the code: {proc.returncode}")
            try:
                version = client.status()["version"]
                logger.info("etcd server ready. version: %s", version)
                return
            except Exception as e:
                if time.monotonic() >= deadline:
                    raise TimeoutError("Timed out waiting for etcd server to be ready!") from e
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 2, 0.5)

    def stop(self) -> None:
        """Stops etcd and removes the data directory."""
        logger.info("EtcdServer stop method called")
        stop_etcd(self._etcd_proc, self._base_data_dir)
