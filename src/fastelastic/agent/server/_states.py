"""The agent's state types, in a leaf module that imports nothing of the agent, so that
``api`` (the agent) and ``_runloop`` (its decisions) both import them without a circle.

``WorkerState`` is torch's public type: it is re-exported by ``api`` under torch's path.
"""

from __future__ import annotations

from enum import Enum

__all__ = ["WorkerState"]


class WorkerState(str, Enum):
    """State of a ``WorkerGroup``; the workers of a group change state as a unit.

    UNKNOWN: lost track (unrecoverable); INIT: created, not started; HEALTHY / UNHEALTHY:
    running; STOPPED: stopped by the agent, about to restart; SUCCEEDED: all exited 0;
    FAILED: at least one worker failed.
    """

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        """True if ``state`` means the worker processes exist (healthy or not)."""
        return state in {WorkerState.HEALTHY, WorkerState.UNHEALTHY}


WorkerState.__module__ = "fastelastic.agent.server.api"  # where torch users look for it
