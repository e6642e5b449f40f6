"""The exit barrier's waits (``_coord.exit_barrier``) on a real store: released by the last
agent, by a lost member between slices, or the store's own timeout once the last slice
passes."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from fastelastic.agent.server import _coord
from fastelastic.errors import StoreTimeoutError
from fastelastic.store import TCPStore


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True,
                 timeout=timedelta(seconds=30))
    yield s
    s.shutdown_server()


def test_the_last_agent_releases_every_agent(store):
    other = TCPStore("127.0.0.1", store.port, timeout=timedelta(seconds=30))
    late = threading.Timer(0.3, lambda: _coord.exit_barrier(other, 2, 10))
    late.start()
    try:
        assert _coord.exit_barrier(store, 2, 10, lost=lambda: [], check_every=0.1) is None
    finally:
        late.join(10)
        other.close()


def test_a_barrier_alone_looks_once_even_with_no_time_left(store):
    assert _coord.exit_barrier(store, 1, 0.0) is None


@pytest.mark.parametrize("with_lost", [False, True])
def test_the_store_timeout_is_raised_once_the_last_slice_passed(store, with_lost):
    asked = []

    def lost():
        asked.append(time.monotonic())
        return []

    class FirstWait:
        """The store, noting when the barrier's first wait starts: its deadline (0.35 s on)
        was set before that, after its arrival's round trip (tens of ms on a busy machine)."""

        first: float | None = None

        def __getattr__(self, name):
            return getattr(store, name)

        def wait(self, keys, timeout):
            if FirstWait.first is None:
                FirstWait.first = time.monotonic()
            return store.wait(keys, timeout)

    t0 = time.monotonic()
    with pytest.raises(StoreTimeoutError):
        _coord.exit_barrier(FirstWait(), 2, 0.35, lost=lost if with_lost else None,
                            check_every=0.1)
    took = time.monotonic() - t0
    assert took >= 0.35 - 0.01, took  # the store's timeouts count whole milliseconds
    first = FirstWait.first
    assert first is not None
    if with_lost:  # asked between slices, never after the last one (the deadline)
        assert 1 <= len(asked) <= 3, asked
        assert all(a - first < 0.35 for a in asked), [a - first for a in asked]


def test_a_lost_member_releases_the_barrier_between_slices(store):
    calls = []

    def lost():
        calls.append(1)
        return [(1, "dead: connection closed")] if len(calls) >= 2 else []

    why = _coord.exit_barrier(store, 2, 30, lost=lost, check_every=0.05)
    assert why == "lost group_rank 1 (dead: connection closed)"
    assert len(calls) == 2
