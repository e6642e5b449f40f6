"""Store-based collectives between agents (torch's ``elastic.utils.store``), same key layout.

``barrier`` and ``synchronize`` use torch's keys (``{prefix}/num_members``,
``{prefix}/last_member``, ``{prefix}{rank}``), so processes using torch's helpers and ours can
meet on one store. They work on any store: ours, torch's, or an adapter of either.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from fastelastic.errors import StoreTimeoutError

__all__ = ["store_timeout", "get_all", "synchronize", "barrier"]

_NUM_MEMBERS = "/num_members"
_LAST_MEMBER_CHECKIN = "/last_member"
_TRACE = "/TRACE"
_TRACING_GATE = "/TRACING_GATE"
_MAX_TRACE_MISSING_RANKS = 16


def _timeout_errors() -> tuple[type[BaseException], ...]:
    # torch's stores time out with DistStoreError, ours with StoreTimeoutError
    dist = sys.modules.get("torch.distributed")
    theirs = getattr(dist, "DistStoreError", None) if dist is not None else None
    return (StoreTimeoutError,) if theirs is None else (StoreTimeoutError, theirs)


@contextmanager
def store_timeout(store: Any, timeout: float) -> Iterator[None]:
    """Sets ``store``'s timeout to ``timeout`` seconds inside the block, then restores it."""
    old = store.timeout
    store.set_timeout(timedelta(seconds=timeout))
    try:
        yield
    finally:
        store.set_timeout(old)


def get_all(store: Any, rank: int, prefix: str, world_size: int) -> list[bytes]:
    """Returns the values of ``{prefix}0`` ... ``{prefix}{world_size-1}`` (waiting for them).

    Rank 0 then waits until every rank has read them, so it can safely tear the store down.
    """
    values = list(store.multi_get([f"{prefix}{i}" for i in range(world_size)]))
    done = _barrier_nonblocking(store, world_size, f"{prefix}/finished")
    if rank == 0:
        store.wait([done])
    return values


def synchronize(
    store: Any,
    data: bytes,
    rank: int,
    world_size: int,
    key_prefix: str,
    timeout: float = 300,
) -> list[bytes]:
    """Publishes ``data`` for ``rank`` and returns every rank's data (index = rank).

    The keys stay in the store: use a fresh ``key_prefix`` for every call.
    """
    with store_timeout(store, timeout):
        store.set(f"{key_prefix}{rank}", data)
        return get_all(store, rank, key_prefix, world_size)


def _barrier_nonblocking(store: Any, world_size: int, key_prefix: str) -> str:
    last = key_prefix + _LAST_MEMBER_CHECKIN
    if store.add(key_prefix + _NUM_MEMBERS, 1) == world_size:
        store.set(last, "<val_ignored>")
    return last


def _missing_ranks(
    store: Any,
    world_size: int,
    key_prefix: str,
    rank: int,
    decode: Callable[[int], str],
    trace_timeout: float,
) -> Iterable[str] | None:
    errors = _timeout_errors()
    store.set(f"{key_prefix}{rank}{_TRACE}", "<val_ignored>")
    if rank != 0:
        try:
            store.wait([f"{key_prefix}{_TRACING_GATE}"])
        except errors:
            return None
        return [f"[<check rank 0 ({decode(0)}) for missing rank info>]"]
    missing: set[str] = set()
    for i in range(1, world_size):
        if len(missing) >= _MAX_TRACE_MISSING_RANKS:
            break
        # the first straggler gets the full trace timeout, later ones a token wait
        wait = timedelta(seconds=trace_timeout) if not missing else timedelta(milliseconds=1)
        try:
            store.wait([f"{key_prefix}{i}{_TRACE}"], wait)
        except errors:
            missing.add(decode(i))
    store.set(f"{key_prefix}{_TRACING_GATE}", "<val_ignored>")
    return missing


def barrier(
    store: Any,
    world_size: int,
    key_prefix: str,
    barrier_timeout: float = 300,
    rank: int | None = None,
    rank_tracing_decoder: Callable[[int], str] | None = None,
    trace_timeout: float = 10,
) -> None:
    """Blocks until ``world_size`` callers reached the barrier ``key_prefix`` (usable once).

    With ``rank`` given, a timeout names the ranks that never arrived (rank 0 finds them;
    ``rank_tracing_decoder`` turns a rank into something readable, such as a host name).

    Raises:
        AssertionError: ``rank_tracing_decoder`` without ``rank`` (torch's check).
        StoreTimeoutError: ``barrier_timeout`` passed (torch's ``DistStoreError`` from a
            torch store).
    """
    if rank is None and rank_tracing_decoder is not None:
        raise AssertionError("Tracing requires rank information")
    with store_timeout(store, barrier_timeout):
        last = _barrier_nonblocking(store, world_size, key_prefix)
        try:
            store.wait([last])
        except _timeout_errors() as e:
            if rank is None:
                raise
            missing = _missing_ranks(
                store, world_size, key_prefix, rank,
                rank_tracing_decoder or str, trace_timeout,
            )
            if missing is None:
                raise
            raise StoreTimeoutError(
                f"Timed out waiting on barrier on rank {rank}, for key prefix: {key_prefix} "
                f"(world_size={world_size}, missing_ranks=[{', '.join(missing)}], "
                f"timeout={barrier_timeout})"
            ) from e
