"""Small helpers of torch's ``elastic.utils.api``: environment lookups, ports, ``${local_rank}``."""

from __future__ import annotations

import os
import socket
from string import Template
from typing import Any

__all__ = ["get_env_variable_or_raise", "get_socket_with_port", "macros"]


def get_env_variable_or_raise(env_name: str) -> str:
    """Returns the environment variable ``env_name``.

    Raises:
        ValueError: it is not set.
    """
    value = os.environ.get(env_name)
    if value is None:
        raise ValueError(f"Environment variable {env_name} expected, but not set")
    return value


def get_socket_with_port() -> socket.socket:
    """Returns a socket listening on a free port of ``localhost``; close it before handing the
    port (``sock.getsockname()[1]``) to whoever needs it.

    Raises:
        RuntimeError: no address of ``localhost`` could be bound.
    """
    last: OSError | None = None
    for family, stype, proto, _, _ in socket.getaddrinfo(
        "localhost", None, family=socket.AF_UNSPEC, type=socket.SOCK_STREAM
    ):
        sock = socket.socket(family, stype, proto)
        try:
            sock.bind(("localhost", 0))
            sock.listen(0)
            return sock
        except OSError as e:
            sock.close()
            last = e
    raise RuntimeError(f"Failed to create a socket: {last}")


class macros:  # noqa: N801 - torch's name
    """Placeholders substituted in worker arguments (``${local_rank}``)."""

    local_rank = "${local_rank}"

    @staticmethod
    def substitute(args: list[Any], local_rank: str) -> list[Any]:
        """Returns ``args`` with ``${local_rank}`` replaced in every string (others as they are)."""
        return [
            Template(a).safe_substitute(local_rank=local_rank) if isinstance(a, str) else a
            for a in args
        ]
