"""The requests the rendezvous machine (:mod:`._round`) yields: a closed set of typed values.

Each is a frozen dataclass; :data:`Request` is their union, and an operation of the machine
is a :data:`RequestGen` (it yields requests and is sent their replies). Whatever runs the
machine (the handler's I/O layer in :mod:`.fast_rendezvous`, on a TCPStore or etcd; the
simulations in the tests) dispatches with ``match`` on the type and rejects anything else with
a ``TypeError`` naming it (:func:`unknown`). The reply each one gets is in its docstring. This
module imports nothing.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

__all__ = [
    "Add", "Append", "AppendOnDisconnect", "Beat", "Check", "CompareSet", "Get",
    "GoneElsewhere", "MovedElsewhere", "MultiGet", "MultiSet", "OnDisconnect",
    "Request", "RequestGen", "Set", "StopBeats", "Wait", "unknown",
]


@dataclass(frozen=True, slots=True)
class Add:
    """Adds ``amount`` to the counter at ``key``. Reply: the new value (int)."""

    name: ClassVar[str] = "add"
    key: str
    amount: int


@dataclass(frozen=True, slots=True)
class Get:
    """Reply: ``key``'s value (bytes), or None once ``timeout`` seconds passed without it
    (``timeout`` None: the store's own timeout, whose passing raises; for keys known to be
    set)."""

    name: ClassVar[str] = "get"
    key: str
    timeout: float | None


@dataclass(frozen=True, slots=True)
class Wait:
    """Reply: True once every key is set, False after ``timeout`` seconds."""

    name: ClassVar[str] = "wait"
    keys: list[str]
    timeout: float


@dataclass(frozen=True, slots=True)
class Check:
    """Reply: whether every key is set (bool), without waiting."""

    name: ClassVar[str] = "check"
    keys: list[str]


@dataclass(frozen=True, slots=True)
class MultiGet:
    """Reply: the values of ``keys`` (list of bytes; every key is set)."""

    name: ClassVar[str] = "multi_get"
    keys: list[str]


@dataclass(frozen=True, slots=True)
class MultiSet:
    """Sets each key to its value in one request. Reply: None."""

    name: ClassVar[str] = "multi_set"
    keys: list[str]
    values: list[bytes]


@dataclass(frozen=True, slots=True)
class Set:
    """Reply: None."""

    name: ClassVar[str] = "set"
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class Append:
    """Appends ``value`` to ``key`` (created empty). Reply: None."""

    name: ClassVar[str] = "append"
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class CompareSet:
    """Sets ``key`` to ``desired`` if it holds ``expected`` ("" : if it is unset). Reply: the
    value it holds afterwards (bytes)."""

    name: ClassVar[str] = "compare_set"
    key: str
    expected: str | bytes
    desired: bytes


@dataclass(frozen=True, slots=True)
class AppendOnDisconnect:
    """When this node's connection closes, the store appends ``value`` to ``key``. Reply:
    None."""

    name: ClassVar[str] = "append_on_disconnect"
    key: str
    value: bytes


@dataclass(frozen=True, slots=True)
class OnDisconnect:
    """:class:`AppendOnDisconnect` for several keys, registered together. Reply: None."""

    name: ClassVar[str] = "on_disconnect"
    keys: list[str]
    values: list[bytes]


@dataclass(frozen=True, slots=True)
class Beat:
    """This node's keep-alive counter is ``key`` from now on (bumped every interval). Reply:
    None."""

    name: ClassVar[str] = "beat"
    key: str


@dataclass(frozen=True, slots=True)
class StopBeats:
    """This node's keep-alives stop. Reply: None."""

    name: ClassVar[str] = "stop_beats"


@dataclass(frozen=True, slots=True)
class GoneElsewhere:
    """Whether the other candidates prove these nodes (their identities) gone from
    ``world`` (its id), fencing them there first (see :mod:`.failover._majority`). Reply: "" when
    proven, else why not (str)."""

    name: ClassVar[str] = "gone_elsewhere"
    idents: list[str]
    world: bytes = b""


@dataclass(frozen=True, slots=True)
class MovedElsewhere:
    """Raises (a connection error) when the rendezvous moved on to another candidate; one
    endpoint: nowhere else to be. Reply: None."""

    name: ClassVar[str] = "moved_elsewhere"


Request = (Add | Get | Wait | Check | MultiGet | MultiSet | Set | Append | CompareSet
           | AppendOnDisconnect | OnDisconnect | Beat | StopBeats | GoneElsewhere | MovedElsewhere)

T = TypeVar("T")
RequestGen = Generator[Request, Any, T]  # yields a request, is sent its reply; returns a T


def unknown(op: object) -> TypeError:
    """The error for a value that is not one of the requests (raise it from ``case _``)."""
    return TypeError(f"not a rendezvous store request: {op!r} ({type(op).__name__})")
