"""Launching elastic jobs: :mod:`fastelastic.launcher.api` (torch's ``torch.distributed.launcher``).

``LaunchConfig``, ``elastic_launch`` and ``launch_agent`` are loaded on first use, so that the
command-line parser (:mod:`fastelastic.launcher.args`) starts without loading the agent.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from fastelastic.launcher import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
