"""Event dataclasses recorded by the agent and the rendezvous (torch-compatible JSON layout)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, ClassVar

__all__ = ["Event", "EventMetadataValue", "EventSource", "NodeState", "RdzvEvent"]

EventMetadataValue = str | int | float | bool | None


class EventSource(str, Enum):
    """Known identifiers of the event producers."""

    AGENT = "AGENT"
    WORKER = "WORKER"


class _JsonEvent:
    """JSON form shared by both event kinds; the one enum field is named by ``_ENUM``."""

    _ENUM: ClassVar[tuple[str, type[Enum]]]

    def __str__(self) -> str:
        return self.serialize()

    def serialize(self) -> str:
        """Returns the JSON form of this event."""
        return json.dumps(asdict(self))  # type: ignore[call-overload]

    @classmethod
    def _from_json(cls, data: object) -> Any:
        if isinstance(data, cls):
            return data
        fields = _load_object(data)
        name, enum = cls._ENUM
        try:
            fields[name] = enum[fields[name]]
            return cls(**fields)
        except (KeyError, TypeError) as e:
            raise ValueError(f"not a serialized {cls.__name__}: {data!r}") from e


@dataclass
class Event(_JsonEvent):
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

    _ENUM = ("source", EventSource)

    @staticmethod
    def deserialize(data: str | Event) -> Event:
        """Builds an Event from its JSON form (or returns ``data`` if already an Event).

        Raises:
            ValueError: ``data`` is not a JSON object with an Event's fields.
        """
        return Event._from_json(data)


class NodeState(str, Enum):
    """The states that a node can be in during rendezvous."""

    INIT = "INIT"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


@dataclass
class RdzvEvent(_JsonEvent):
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

    _ENUM = ("node_state", NodeState)

    @staticmethod
    def deserialize(data: str | RdzvEvent) -> RdzvEvent:
        """Builds an RdzvEvent from its JSON form (or returns ``data`` if already one).

        Raises:
            ValueError: ``data`` is not a JSON object with an RdzvEvent's fields.
        """
        return RdzvEvent._from_json(data)


def _load_object(data: object) -> dict:
    if not isinstance(data, str):
        raise TypeError(f"expected a JSON string, got {type(data).__name__}")
    fields = json.loads(data)
    if not isinstance(fields, dict):
        raise ValueError(f"expected a JSON object, got {data!r}")  # noqa: TRY004
    return fields
