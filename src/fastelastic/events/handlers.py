"""Named logging handlers events go to (``null``, ``console``, ``dynamic_rendezvous``, yours),
and the logger built for each destination, which follows its handler when it is registered
anew (so this module imports nothing of the package's ``__init__``)."""

from __future__ import annotations

import logging
import os
import threading

__all__ = ["get_logging_handler", "register_handler", "unregister_handler"]

_lock = threading.Lock()
_log_handlers: dict[str, logging.Handler] = {
    "console": logging.StreamHandler(),
    "dynamic_rendezvous": logging.NullHandler(),
    "null": logging.NullHandler(),
}


def get_logging_handler(destination: str = "null") -> logging.Handler:
    """Returns the logging handler registered under ``destination``.

    Raises:
        KeyError: no handler is registered under that name (the message lists the known ones).
    """
    with _lock:
        try:
            return _log_handlers[destination]
        except KeyError:
            known = ", ".join(sorted(_log_handlers))
            raise KeyError(f"no event handler named {destination!r} (known: {known})") from None


_events_loggers: dict[str, logging.Logger] = {}  # destination -> its logger, once built
_loggers_lock = threading.Lock()  # taken before _lock, never while holding it


def _get_or_create_logger(destination: str = "null") -> logging.Logger:
    """Returns the non-propagating logger that feeds the handler named ``destination``."""
    with _loggers_lock:
        logger = _events_loggers.get(destination)
        if logger is None:
            handler = get_logging_handler(destination)
            logger = logging.getLogger(f"torchelastic-events-{destination}")
            logger.setLevel(os.environ.get("LOGLEVEL", "INFO"))
            logger.propagate = False  # each event is handled once, not again by the root
            logger.addHandler(handler)
            _events_loggers[destination] = logger
        return logger


def _rebind_logger(name: str, old: logging.Handler | None, new: logging.Handler | None) -> None:
    """Swaps the handler of an already-built destination logger (after register/unregister)."""
    with _loggers_lock:
        logger = _events_loggers.get(name)
        if logger is None:
            return
        if old is not None:
            logger.removeHandler(old)
        if new is None:
            del _events_loggers[name]
        else:
            logger.addHandler(new)


def register_handler(name: str, handler: logging.Handler, *, replace: bool = False) -> None:
    """Registers ``handler`` as the event destination ``name``.

    After this, ``WorkerSpec(event_log_handler=name)`` and ``events.record(e, name)`` send
    events to ``handler``. Registering ``dynamic_rendezvous`` with a real handler turns on
    the rendezvous events (they are skipped while it is a ``NullHandler``).

    Args:
        name: the destination name.
        handler: any ``logging.Handler``.
        replace: allow replacing an existing destination (else it is an error).

    Raises:
        TypeError: ``handler`` is not a ``logging.Handler``.
        ValueError: ``name`` is empty, or already registered and ``replace`` is False.
    """
    if not isinstance(handler, logging.Handler):
        raise TypeError(f"handler must be a logging.Handler, got {type(handler).__name__}")
    if not name:
        raise ValueError("handler name must be a non-empty string")
    with _lock:
        old = _log_handlers.get(name)
        if old is not None and old is not handler and not replace:
            raise ValueError(f"event handler {name!r} already registered (pass replace=True)")
        _log_handlers[name] = handler
    # The logger built for this destination (if any) must switch to the new handler.
    _rebind_logger(name, old, handler)


def unregister_handler(name: str) -> None:
    """Removes the destination ``name``; the built-in ones cannot be removed.

    Raises:
        ValueError: ``name`` is a built-in destination.
    """
    if name in ("null", "console", "dynamic_rendezvous"):
        raise ValueError(f"cannot unregister the built-in event handler {name!r}")
    with _lock:
        old = _log_handlers.pop(name, None)
    _rebind_logger(name, old, None)
