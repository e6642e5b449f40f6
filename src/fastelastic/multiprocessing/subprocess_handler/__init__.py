"""One binary worker per process group (torch's ``multiprocessing.subprocess_handler``)."""

from fastelastic.multiprocessing.subprocess_handler.handlers import get_subprocess_handler
from fastelastic.multiprocessing.subprocess_handler.subprocess_handler import SubprocessHandler

__all__ = ["SubprocessHandler", "get_subprocess_handler"]
