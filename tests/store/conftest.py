"""Fixtures for the store tests: a hosted server, raw connections, torch (when installed)."""

from __future__ import annotations

import pytest

from fastelastic.store import TCPStore

from ._wire import Raw


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    yield store
    store.shutdown_server()


@pytest.fixture
def raw(master):
    conns = []

    def make(handshake: bool = True, ext: bool = False) -> Raw:
        c = Raw(master.port, handshake=handshake, ext=ext)
        conns.append(c)
        return c

    yield make
    for c in conns:
        c.close()


@pytest.fixture(scope="session")
def torch_dist():
    try:
        import torch.distributed as dist
    except ImportError as e:
        pytest.skip(f"!!! torch is not installed ({e}); interop tests need torch==2.13.0 "
                    "(CI installs it)")
    return dist


def wait_until(predicate, timeout: float = 5.0, what: str = "condition") -> None:
    """Polls a real condition (server counters) with a bounded deadline."""
    import time

    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.001)
