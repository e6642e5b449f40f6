"""The agent's side of the one-step rule across nodes: publish, read every agent's, apply.

At each round every agent sets ``fe.ckpt/held/<its group rank>`` in the round's store (what its
checkpoint memory holds, ``_schema.encode_held``), waits for every other agent's, and applies
``_schema.restore_rule`` to the list in group-rank order: the same data gives every agent the
same step. Nothing is kept in the store between rounds: a failed-over store starts empty, and
the agents publish again. The launcher never imports torch; neither does this module.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

from fastelastic.rendezvous.fast._schema import (
    HELD_PREFIX,
    Held,
    RestorePick,
    encode_held,
    parse_held,
    restore_rule,
)

__all__ = ["Agreement", "publish_nothing"]

logger = logging.getLogger("fastelastic.checkpoint")

_SLICE_S = 0.5  # a wait on the store is cut into slices: the connection is shared


class Agreement:
    """``agree(held) -> (RestorePick, group rank, every agent's Held)`` for one round
    (``MemoryOwner.start_round``).

    Args:
        store: the round's store (the agents' own, prefixed per round).
        group_rank, group_world_size: this agent's place among the round's agents.
        timeout: seconds to wait for every agent's publication.
        wait_members: the rendezvous's ``wait_members(store, keys, deadline)`` when it has one
            (it raises as soon as a member of the round is lost).
    """

    def __init__(self, store: Any, group_rank: int, group_world_size: int, timeout: float,
                 wait_members: Optional[Callable[[Any, list[str], float], None]] = None) -> None:
        self.store = store
        self.group_rank = group_rank
        self.group_world_size = group_world_size
        self.timeout = timeout
        self.wait_members = wait_members

    def __call__(self, held: Held) -> tuple[RestorePick, int, list[Optional[Held]]]:
        """Publishes ``held``, reads every agent's and applies the rule.

        Raises:
            TimeoutError, RendezvousError, StoreError: not every agent published in time (one
                was lost: the round is broken, and a new one publishes again).
        """
        self.store.set(f"{HELD_PREFIX}{self.group_rank}", encode_held(held))
        keys = [f"{HELD_PREFIX}{i}" for i in range(self.group_world_size)]
        deadline = time.monotonic() + self.timeout
        if self.wait_members is not None:
            self.wait_members(self.store, keys, deadline)
        else:
            from datetime import timedelta

            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"not every agent published its checkpoint holdings "
                                       f"within {self.timeout:.0f} s")
                try:
                    self.store.wait(keys, timedelta(seconds=min(_SLICE_S, left)))
                    break
                except Exception as e:  # noqa: BLE001 - a store's timeout: its type varies
                    if "timeout" not in type(e).__name__.lower() and "imeout" not in str(e):
                        raise
        helds: list[Optional[Held]] = []
        for i, raw in enumerate(self.store.multi_get(keys)):
            try:
                helds.append(parse_held(bytes(raw)))
            except ValueError as e:
                logger.error("checkpoint memory: the holdings of agent %s are unreadable (%s): "
                             "counted as none", i, e)
                helds.append(None)
        return restore_rule(helds), self.group_rank, helds


def publish_nothing(store: Any, group_rank: int) -> None:
    """An agent with no checkpoint memory (``FASTELASTIC_CHECKPOINT=0``) still publishes, as
    holding nothing, so the other agents do not wait for it."""
    store.set(f"{HELD_PREFIX}{group_rank}", encode_held(Held(0)))
