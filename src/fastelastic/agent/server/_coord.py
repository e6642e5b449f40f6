"""Store-side coordination between agents: slow-path rank exchange and the exit barrier."""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fastelastic._native import ranks as _ranks
from fastelastic._waits import Slices
from fastelastic.errors import StoreTimeoutError

logger = logging.getLogger(__name__)

ROLE_INFO_PREFIX = _ranks.ROLE_INFO_PREFIX  # "torchelastic/role_info/"
ASSIGNED_RANKS_PREFIX = _ranks.ASSIGNED_RANKS_PREFIX  # "torchelastic/assigned_ranks/"
TERMINAL_STATE_SYNC_ID = "torchelastic/agent/terminal_state"
_NUM_MEMBERS = TERMINAL_STATE_SYNC_ID + "/num_members"
_LAST_MEMBER = TERMINAL_STATE_SYNC_ID + "/last_member"
# Ours: set by a node whose group failed for good, so that peers in the barrier stop waiting.
_FAILED = TERMINAL_STATE_SYNC_ID + "/failed"
# Ours: appended to by the store server when an agent's connection closes (process death).
_DISCONNECTED = TERMINAL_STATE_SYNC_ID + "/disconnected"

_IDENTICAL_ENVS = ("TORCH_ELASTIC_WORKER_IDENTICAL", "FASTELASTIC_WORKER_IDENTICAL")


def workers_identical() -> bool:
    """True when the user declared every node runs the same workers (fast path)."""
    return any(os.environ.get(name, "0") == "1" for name in _IDENTICAL_ENVS)


def exchange_ranks(
    store: Any, group_rank: int, group_world_size: int, role: str, local_world_size: int,
    wait: Callable[[list[str]], None] | None = None,
) -> tuple[int, int, int, int]:
    """Computes this agent's ``(base_global_rank, world_size, base_role_rank, role_world_size)``.

    Store traffic of the slow path (same keys as torch): each agent one ``set``; agent 0 one
    ``multi_get`` (which waits for every agent's key) and one ``multi_set``; each agent one
    ``get``. The fast path (``workers_identical()``) touches no store. ``wait(keys)``, when
    given, waits for keys other agents write (and raises if one of them is lost meanwhile).
    """
    if workers_identical():
        return _ranks.identical_ranks(group_rank, group_world_size, local_world_size)
    store.set(
        f"{ROLE_INFO_PREFIX}{group_rank}",
        _ranks.encode_role_info(role, group_rank, local_world_size),
    )
    if group_rank == 0:
        keys = [f"{ROLE_INFO_PREFIX}{i}" for i in range(group_world_size)]
        if wait is not None:
            wait(keys)
        infos = store.multi_get(keys)
        values = _ranks.assign_from_role_infos(list(infos))
        store.multi_set([f"{ASSIGNED_RANKS_PREFIX}{i}" for i in range(group_world_size)], values)
    elif wait is not None:
        wait([f"{ASSIGNED_RANKS_PREFIX}{group_rank}"])
    return _ranks.decode_assignment(store.get(f"{ASSIGNED_RANKS_PREFIX}{group_rank}"))


def publish_failure(store: Any, group_rank: int | None) -> None:
    """Marks the job failed in the store and releases every agent waiting in the exit barrier."""
    store.set(_FAILED, str(group_rank))
    store.set(_LAST_MEMBER, "<released by failure>")


def release_on_disconnect(store: Any, group_rank: int) -> bool:
    """Asks the store server to release the exit barrier if this agent's connection dies.

    Only fastelastic's store offers this (``append_on_disconnect``); with any other store this
    does nothing and returns False. The release is harmless after a normal exit: by then the
    barrier has completed for everyone.
    """
    if not getattr(store, "supports_extensions", False):
        return False
    store.append_on_disconnect(_DISCONNECTED, f"{group_rank} ")
    store.append_on_disconnect(_LAST_MEMBER, "<released by disconnect>")
    return True


def exit_barrier(
    store: Any, group_world_size: int, timeout: float,
    lost: Callable[[], list[tuple[int, str]]] | None = None, check_every: float = 1.0,
) -> str | None:
    """Waits until every agent arrived, one failed or died, or ``timeout`` seconds passed.

    With ``lost`` (the rendezvous's ``lost_members``), it is asked every ``check_every``
    seconds, so an agent that froze or was cut off before arriving releases the barrier.

    Returns:
        None when all agents arrived, else why the barrier was released early.

    Raises:
        Whatever the store raises on timeout or a lost connection.
    """
    idx = store.add(_NUM_MEMBERS, 1)
    if idx >= group_world_size:
        store.set(_LAST_MEMBER, "<val_ignored>")
    # each slice a wait; the one that reaches the deadline re-raises the store's timeout
    slices = Slices(time.monotonic() + max(timeout, 0.001),
                    math.inf if lost is None else check_every, floor=0.001, last_look=True)
    for step in slices:
        try:
            store.wait([_LAST_MEMBER], timedelta(seconds=step))
            break
        except StoreTimeoutError:
            if slices.final:
                raise
        gone = lost() if lost is not None else []
        if gone:
            return "lost " + "; ".join(f"group_rank {r} ({why})" for r, why in gone)
    else:  # unreachable with a clock that moves: the last look raises
        raise StoreTimeoutError(f"the exit barrier did not complete within {timeout:g} s")
    if int(store.add(_NUM_MEMBERS, 0)) >= group_world_size:
        return None
    if store.check([_FAILED]):
        return f"the agent of group_rank {_text(store.get(_FAILED))} failed"
    if store.check([_DISCONNECTED]):
        ranks = sorted(set(_text(store.get(_DISCONNECTED)).split()))
        return f"the agent(s) of group_rank {', '.join(ranks)} disconnected"
    return "released before every agent arrived"


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def elapsed_since(start: float) -> float:
    """Seconds on the monotonic clock since ``start``."""
    return time.monotonic() - start
