"""``worker_main``: wraps a worker's main function (torch's ``elastic.control_plane``).

It records the worker's uncaught exception as ``@record`` does and, when
``TORCH_WORKER_SERVER_SOCKET`` is set, serves torch's worker control handlers (tracebacks,
collective traces) on that unix socket for the duration; that server is torch's own
``_WorkerServer``, so only then is torch needed.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import ExitStack, contextmanager

from fastelastic.multiprocessing.errors import record

__all__ = ["worker_main"]

TORCH_WORKER_SERVER_SOCKET = "TORCH_WORKER_SERVER_SOCKET"


@contextmanager
def _worker_server(socket_path: str) -> Generator[None, None, None]:
    try:
        from torch._C._distributed_c10d import _WorkerServer
    except ImportError as e:
        raise ImportError(
            f"{TORCH_WORKER_SERVER_SOCKET} is set, and the worker server it asks for is torch's: "
            "install torch==2.13.0 or unset the variable"
        ) from e
    server = _WorkerServer(socket_path)
    try:
        yield
    finally:
        server.shutdown()


@record
@contextmanager
def worker_main() -> Generator[None, None, None]:
    """Context manager (and decorator) for a worker's main function::

        @worker_main()
        def main():
            ...
    """
    with ExitStack() as stack:
        socket_path = os.environ.get(TORCH_WORKER_SERVER_SOCKET)
        if socket_path is not None:
            stack.enter_context(_worker_server(socket_path))
        yield
