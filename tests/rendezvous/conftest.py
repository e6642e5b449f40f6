"""Fixtures for rendezvous tests: a hosted fastelastic store and node-thread helpers."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from fastelastic.store import TCPStore


@pytest.fixture
def server():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                     timeout=timedelta(seconds=30))
    yield store
    store.shutdown_server()


class NodeThreads:
    """Runs ``fn(i)`` in threads; collects results and exceptions per index."""

    def __init__(self) -> None:
        self.results: dict[int, object] = {}
        self.errors: dict[int, BaseException] = {}
        self.threads: list[threading.Thread] = []

    def start(self, i: int, fn) -> threading.Thread:
        def run() -> None:
            try:
                self.results[i] = fn(i)
            except BaseException as e:  # noqa: BLE001 - reported by the test
                self.errors[i] = e

        t = threading.Thread(target=run, name=f"node-{i}", daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def join(self, timeout: float = 30.0) -> None:
        for t in self.threads:
            t.join(timeout)
            assert not t.is_alive(), f"{t.name} did not finish within {timeout}s"


@pytest.fixture
def nodes():
    return NodeThreads()
