"""Event dataclasses recorded by the agent and the rendezvous (torch-compatible JSON layout)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent"]

EventMetadataValue = str | int | float | bool | None


class EventSource(str, Enum):
    """Known identifiers of the event producers."""

    AGENT = "AGENT"
    WORKER = "WORKER"


@dataclass
class Event:
    """A meaningful action during an elastic job (worker start, restart, failure...).

    Args:
        name: event name.
        source: the event producer, e.g. agent or worker.
        timestamp: time in milliseconds when the event occurred.
        metadata: additional data associated with the event.
    """

    name: str
    source: EventSource
    timestamp: int = 0
    metadata: dict[str, EventMetadataValue] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.serialize()

    @staticmethod
    def deserialize(data: str | Event) -> Event:
        """Builds an Event from its JSON form (or returns ``data`` if already an Event).

        Raises:
            ValueError: ``data`` is not a JSON object with an Event's fields.
        """
        if isinstance(data, Event):
            return data
        fields = _load_object(data)
        try:
            fields["source"] = EventSource[fields["source"]]
            return Event(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a serialized Event: {data!r}") from e

    def serialize(self) -> str:
        """Returns the JSON form of this event."""
        return json.dumps(asdict(self))


class NodeState(str, Enum):
    """The states that a node can be in during rendezvous."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class RdzvEvent:
    """A rendezvous event.

    Args:
        name: event name (e.g. the action being performed).
        run_id: the run id of the rendezvous.
        message: what happened.
        hostname: host name of the node.
        pid: process id of the node.
        node_state: state of the node (INIT, RUNNING, SUCCEEDED, FAILED).
        master_endpoint: the master endpoint of the rendezvous store, if known.
        rank: the rank of the node, if known.
        local_id: the local id of the node in the dynamic rendezvous, if defined.
        error_trace: the stack trace, for an error event.
    """

    name: str
    run_id: str
    message: str
    hostname: str
    pid: int
    node_state: NodeState
    master_endpoint: str = ""
    rank: int | None = None
    local_id: int | None = None
    error_trace: str = ""

    def __str__(self) -> str:
        return self.serialize()

    @staticmethod
    def deserialize(data: str | RdzvEvent) -> RdzvEvent:
        """Builds an RdzvEvent from its JSON form (or returns ``data`` if already one).

        Raises:
            ValueError: ``data`` is not a JSON object with an RdzvEvent's fields.
        """
        if isinstance(data, RdzvEvent):
            return data
        fields = _load_object(data)
        try:
            fields["node_state"] = NodeState[fields["node_state"]]
            return RdzvEvent(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a serialized RdzvEvent: {data!r}") from e

    def serialize(self) -> str:
        """Returns the JSON form of this event."""
        return json.dumps(asdict(self))


def _load_object(data: object) -> dict:
    if not isinstance(data, str):
        raise TypeError(f"expected a JSON string, got {type(data).__name__}")
    fields = json.loads(data)
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {data!r}")  # noqa: TRY004
    return fields
