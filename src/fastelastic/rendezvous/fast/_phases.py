"""The phases of a node's attempt at a rendezvous round, and the one rule between them.

:func:`transition` says which phase follows which event; :mod:`._round` does each phase's
work. A pair without a rule is a bug in this package, never a peer's doing.
"""

from __future__ import annotations

import enum

from fastelastic.errors import RendezvousError

__all__ = ["E", "FINAL", "TRANSITIONS", "Event", "P", "Phase", "transition"]


class Phase(enum.Enum):
    """Where a node's attempt at one round is."""

    TICKET = "ticket"            # add(t, 1); announce leaving the last round
    RECORD = "record"            # record, seat placeholder, keep-alive counter
    PUBLISH_GATE = "full gate"   # ticket max: wait until the last complete round is over
    COORD_GATE = "gate"          # ticket min: likewise
    DRAIN = "drain"              # ticket min: wait until every member of that round left
    LAST_CALL = "last call"      # ticket min: wait for more nodes (a new job's round only)
    SEAL = "seal"                # ticket min: close the ticket counter
    PUBLISH = "publish"          # a decider: wait for the records, assign ranks, decide res
    AWAIT = "await"              # wait for res while watching the deciders
    SEAT = "seat"                # read this node's seat
    MEMBER = "member"            # final: a member of the round
    NEXT = "next"                # final: try round r + 1
    CLOSED = "closed"            # final: the rendezvous is closed


class Event(enum.Enum):
    """What a phase's work found."""

    FULL = "full"                # ticket above max / sealed at max
    TICKET = "ticket"
    PUBLISHER = "publisher"      # ticket == max
    COORDINATOR = "coordinator"  # ticket == min (< max)
    WAITER = "waiter"
    DECIDED = "decided"          # res appeared meanwhile (decided, abandoned or closed)
    FIRST = "first"              # no complete round before: a new job
    OVER = "over"                # the last complete round is over
    DRAINED = "drained"
    CALL_OVER = "call over"
    SEALED = "sealed"            # sealed below max: this node publishes
    DONE = "done"
    COMPLETE = "complete"
    ABANDONED = "abandoned"
    CLOSED = "closed"
    ADMITTED = "admitted"
    NOT_ADMITTED = "not admitted"


P, E = Phase, Event
TRANSITIONS: dict[tuple[Phase, Event], Phase] = {
    (P.TICKET, E.FULL): P.NEXT,
    (P.TICKET, E.TICKET): P.RECORD,
    (P.RECORD, E.PUBLISHER): P.PUBLISH_GATE,
    (P.RECORD, E.COORDINATOR): P.COORD_GATE,
    (P.RECORD, E.WAITER): P.AWAIT,
    (P.PUBLISH_GATE, E.OVER): P.PUBLISH,
    (P.PUBLISH_GATE, E.DECIDED): P.AWAIT,
    (P.COORD_GATE, E.FIRST): P.LAST_CALL,
    (P.COORD_GATE, E.OVER): P.DRAIN,
    (P.COORD_GATE, E.DECIDED): P.AWAIT,
    (P.DRAIN, E.DRAINED): P.LAST_CALL,
    (P.DRAIN, E.DECIDED): P.AWAIT,
    (P.LAST_CALL, E.CALL_OVER): P.SEAL,
    (P.LAST_CALL, E.DECIDED): P.AWAIT,
    (P.SEAL, E.SEALED): P.PUBLISH,
    (P.SEAL, E.FULL): P.AWAIT,  # at max, the max-ticket holder publishes
    (P.PUBLISH, E.DONE): P.AWAIT,
    (P.AWAIT, E.COMPLETE): P.SEAT,
    (P.AWAIT, E.ABANDONED): P.NEXT,
    (P.AWAIT, E.CLOSED): P.CLOSED,
    (P.SEAT, E.ADMITTED): P.MEMBER,
    (P.SEAT, E.NOT_ADMITTED): P.NEXT,
}
FINAL = frozenset({P.MEMBER, P.NEXT, P.CLOSED})


def transition(phase: Phase, event: Event) -> Phase:
    """The phase that follows ``event`` in ``phase``; raises ``RendezvousError`` for a pair
    the protocol has no rule for (a bug, never a peer's doing)."""
    try:
        return TRANSITIONS[(phase, event)]
    except KeyError:
        raise RendezvousError(f"no rendezvous transition from {phase} on {event}") from None
