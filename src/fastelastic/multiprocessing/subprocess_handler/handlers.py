"""``get_subprocess_handler``: the factory torch's subprocess context calls per binary worker."""

from __future__ import annotations

from typing import Any

from fastelastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

__all__ = ["get_subprocess_handler"]


def get_subprocess_handler(
    entrypoint: str,
    args: tuple,
    env: dict[str, str],
    stdout: str | int | None,
    stderr: str | int | None,
    local_rank_id: int,
    numa_options: Any = None,
    *,
    cpus: frozenset[int] | None = None,
) -> SubprocessHandler:
    """Starts one binary worker; see :class:`SubprocessHandler`."""
    return SubprocessHandler(
        entrypoint, args, env, stdout, stderr, local_rank_id, numa_options, cpus=cpus
    )
