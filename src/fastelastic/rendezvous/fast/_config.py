"""What a node's round machine is configured with (:class:`Config`): a leaf module, so that
``_round`` (the machine) and ``_members`` (its membership operations) both import it and
neither imports the other."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Config"]


@dataclass(frozen=True)
class Config:
    """What a node's machine needs to know (timeouts in seconds)."""

    run_id: str
    min_nodes: int
    max_nodes: int
    join: float = 600.0
    last_call: float = 30.0
    ka_interval: float = 1.0
    ka_max: int = 5
    reform_last_call: bool = False
    hooks: bool = True  # the store runs disconnect actions (fastelastic's server, etcd leases)
    can_move: bool = False  # other candidates may host the rendezvous (see _majority.away)

    @property
    def window(self) -> float:
        """Keep-alive counters standing still this long mean the node is lost."""
        return self.ka_interval * self.ka_max

    @property
    def spare_window(self) -> float:
        """The shorter window used while a spare is ready to take a silent member's seat."""
        return max(2 * self.ka_interval, self.window / 2)
