"""Event recording through standard Python logging (torch's ``elastic.events``).

Example::

    from fastelastic import events

    events.record(events.Event("test_event", events.EventSource.WORKER), "console")
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import traceback

from fastelastic.events.api import (
    Event,
    EventMetadataValue,
    EventSource,
    NodeState,
    RdzvEvent,
)
from fastelastic.events.handlers import (
    _get_or_create_logger,
    get_logging_handler,
    register_handler,
    unregister_handler,
)

__all__ = [
    "Event",
    "EventMetadataValue",
    "EventSource",
    "NodeState",
    "RdzvEvent",
    "construct_and_record_rdzv_event",
    "get_logging_handler",
    "record",
    "record_rdzv_event",
    "register_handler",
    "unregister_handler",
]

def record(event: Event, destination: str = "null") -> None:
    """Records ``event`` (as its JSON form) to the handler named ``destination``.

    Raises:
        KeyError: no handler is registered under ``destination``.
    """
    _get_or_create_logger(destination).info(event.serialize())


def record_rdzv_event(event: RdzvEvent) -> None:
    """Records a rendezvous event to the ``dynamic_rendezvous`` destination."""
    _get_or_create_logger("dynamic_rendezvous").info(event.serialize())


def construct_and_record_rdzv_event(
    run_id: str,
    message: str,
    node_state: NodeState,
    name: str = "",
    hostname: str = "",
    pid: int | None = None,
    master_endpoint: str = "",
    local_id: int | None = None,
    rank: int | None = None,
) -> None:
    """Builds a rendezvous event and records it, unless that destination is a null handler.

    Args:
        run_id: the run id of the rendezvous.
        message: what happened.
        node_state: state of the node (INIT, RUNNING, SUCCEEDED, FAILED).
        name: event name; defaults to the calling function's name.
        hostname: host name of the node; defaults to this host's FQDN.
        pid: process id of the node; defaults to this process.
        master_endpoint: the master endpoint of the rendezvous store, if known.
        local_id: the local id of the node in the dynamic rendezvous, if defined.
        rank: the rank of the node, if known.
    """
    # Nothing is computed (no stack walk, no DNS) while nobody listens.
    if isinstance(get_logging_handler("dynamic_rendezvous"), logging.NullHandler):
        return
    if not hostname:
        hostname = socket.getfqdn()
    if not pid:
        pid = os.getpid()
    caller = inspect.currentframe()
    caller = caller.f_back if caller is not None else None
    filename = "no_file"
    if caller is not None:
        filename = os.path.basename(caller.f_code.co_filename)
        if not name:
            name = caller.f_code.co_name
    del caller  # a held frame keeps its locals alive
    error_trace = traceback.format_exc() if node_state == NodeState.FAILED else ""
    record_rdzv_event(
        RdzvEvent(
            name=f"{filename}:{name}",
            run_id=run_id,
            message=message,
            hostname=hostname,
            pid=pid,
            node_state=node_state,
            master_endpoint=master_endpoint,
            rank=rank,
            local_id=local_id,
            error_trace=error_trace,
        )
    )
