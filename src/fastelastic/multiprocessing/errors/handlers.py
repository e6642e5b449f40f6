"""Owns get_error_handler: the factory ``record`` uses for its default handler."""

from __future__ import annotations

from fastelastic.multiprocessing.errors.error_handler import ErrorHandler

__all__ = ["get_error_handler"]


def get_error_handler() -> ErrorHandler:
    """Returns a new default :class:`ErrorHandler`."""
    return ErrorHandler()
