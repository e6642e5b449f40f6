"""Our stores as ``torch.distributed.Store``s, for processes that have imported torch.

torch's ``Store`` is subclassable from Python (a pybind trampoline): C++ calls to ``set``,
``get``, ``add``, ``compare_set``, ``wait``, ``check``, ``multi_get``, ``multi_set``,
``append``, ``has_extended_api`` and ``clone`` reach the Python methods of a subclass. An
adapter of that kind wraps one of our stores, so ``init_process_group(store=...)`` and
``torch.distributed.PrefixStore`` accept it, and forwards every other attribute to it, so our own
callers keep its extensions (one-round-trip ``get``, pipelined ``multi_get``, disconnect actions).

Nothing here imports torch: an adapter is made only when ``torch.distributed`` is already in
``sys.modules`` (:func:`maybe_torch_store`) or when asked for (:func:`as_torch_store`), so the
launcher, which never imports torch, hands out and uses our plain stores.
"""

from __future__ import annotations

import abc
import sys
from datetime import timedelta
from typing import Any, Optional

__all__ = ["as_torch_store", "maybe_torch_store", "unwrap"]

_INNER = "_fastelastic_store"
# Bound straight onto each adapter (the instance dict wins over the class): Python callers and
# torch's trampoline both call the wrapped store's own method, with no Python frame in between.
_DIRECT = (
    "set", "get", "add", "compare_set", "wait", "check", "multi_get", "multi_set", "append",
    "delete_key", "num_keys", "list_keys", "queue_push", "queue_pop", "queue_len", "barrier",
)
_classes: dict[type, type] = {}
# torch's C++ holds a Python-subclassed Store without a reference to its Python object; were the
# adapter collected while C++ still used it, every call would hit the base class ("Not
# implemented"). So each adapter stays alive until its store is closed (or the process ends).
_alive: dict[int, Any] = {}


def unwrap(store: Any) -> Any:
    """Returns the fastelastic store an adapter wraps (``store`` itself if it is no adapter)."""
    return getattr(store, _INNER, store)


def torch_loaded() -> bool:
    """Whether this process has imported ``torch.distributed`` (never imports it)."""
    return "torch.distributed" in sys.modules


def maybe_torch_store(store: Any) -> Any:
    """``as_torch_store(store)`` if this process has imported torch, else ``store`` unchanged."""
    if store is None or not torch_loaded():
        return store
    return as_torch_store(store)


def as_torch_store(store: Any) -> Any:
    """Returns ``store`` as a ``torch.distributed.Store`` (imports torch).

    A torch store is returned unchanged; a fastelastic store is wrapped in an adapter that is a
    ``torch.distributed.Store`` and forwards everything to it (a wrapped store is wrapped once).

    Raises:
        ImportError: torch is not installed.
    """
    import torch.distributed as dist

    if isinstance(store, dist.Store):
        return store
    cls = _classes.get(type(store))
    if cls is None:
        cls = _classes[type(store)] = _adapter_class(dist.Store, type(store))
    return cls(store)


def _adapter_class(base: Any, wrapped: type) -> type:
    """Builds the ``torch.distributed.Store`` subclass that wraps instances of ``wrapped``."""

    def __new__(cls: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 - a method body
        if len(args) == 1 and not kwargs and isinstance(args[0], wrapped):
            return base.__new__(cls)
        # type(store)(host, port, ...): a new store of the wrapped class, wrapped
        return as_torch_store(wrapped(*args, **kwargs))

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:  # noqa: N807
        if _INNER in self.__dict__:
            return  # built by __new__ from the wrapped class's arguments
        (store,) = args
        base.__init__(self)
        object.__setattr__(self, _INNER, store)
        _alive[id(self)] = self
        for name in _DIRECT:
            method = getattr(store, name, None)
            if method is not None:
                self.__dict__[name] = method
        timeout = getattr(store, "timeout", None)
        if isinstance(timeout, timedelta):
            base.set_timeout(self, timeout)

    def _s(self: Any) -> Any:
        return object.__getattribute__(self, _INNER)

    # The methods torch's C++ calls through the trampoline, plus the rest of its Store API
    # (used only where the wrapped store lacks one; see _DIRECT).
    def set(self: Any, key: str, value: Any) -> None:
        _s(self).set(key, value)

    def get(self: Any, key: str) -> bytes:
        return bytes(_s(self).get(key))

    def add(self: Any, key: str, value: int) -> int:
        return int(_s(self).add(key, value))

    def compare_set(self: Any, key: str, expected_value: Any, desired_value: Any) -> bytes:
        return bytes(_s(self).compare_set(key, expected_value, desired_value))

    def wait(self: Any, keys: list[str], timeout: Optional[timedelta] = None) -> None:
        if timeout is None:
            _s(self).wait(keys)
        else:
            _s(self).wait(keys, timeout)

    def check(self: Any, keys: list[str]) -> bool:
        return bool(_s(self).check(keys))

    def multi_get(self: Any, keys: list[str]) -> list[bytes]:
        return [bytes(v) for v in _s(self).multi_get(keys)]

    def multi_set(self: Any, keys: list[str], values: list[Any]) -> None:
        _s(self).multi_set(keys, values)

    def append(self: Any, key: str, value: Any) -> None:
        _s(self).append(key, value)

    def delete_key(self: Any, key: str) -> bool:
        return bool(_s(self).delete_key(key))

    def num_keys(self: Any) -> int:
        return int(_s(self).num_keys())

    def list_keys(self: Any) -> list[str]:
        return list(_s(self).list_keys())

    def queue_push(self: Any, key: str, value: Any) -> None:
        _s(self).queue_push(key, value)

    def queue_pop(self: Any, key: str, block: bool = True) -> bytes:
        return bytes(_s(self).queue_pop(key, block))

    def queue_len(self: Any, key: str) -> int:
        return int(_s(self).queue_len(key))

    def has_extended_api(self: Any) -> bool:
        return True

    def clone(self: Any) -> Any:
        return as_torch_store(_s(self).clone())

    def set_timeout(self: Any, timeout: timedelta) -> None:
        _s(self).set_timeout(timeout)
        base.set_timeout(self, timeout)

    def close(self: Any) -> None:
        """Closes the wrapped store's connection; the adapter may then be collected."""
        _alive.pop(id(self), None)
        _s(self).close()

    def shutdown_server(self: Any) -> None:
        """Stops the wrapped store's hosted server; the adapter may then be collected."""
        _alive.pop(id(self), None)
        _s(self).shutdown_server()

    def __getattr__(self: Any, name: str) -> Any:  # noqa: N807
        # only for what the adapter lacks: our extensions, ports, counters...
        if name == _INNER:
            raise AttributeError(name)
        return getattr(_s(self), name)

    def __repr__(self: Any) -> str:  # noqa: N807
        return f"<torch.distributed.Store over {_s(self)!r}>"

    methods = (
        __new__, __init__, set, get, add, compare_set, wait, check, multi_get, multi_set, append,
        delete_key, num_keys, list_keys, queue_push, queue_pop, queue_len, has_extended_api,
        clone, set_timeout, close, shutdown_server, __getattr__, __repr__,
    )
    namespace: dict[str, Any] = {f.__name__: f for f in methods}
    namespace["__module__"] = __name__
    namespace["__doc__"] = (
        f"A ``torch.distributed.Store`` over a fastelastic ``{wrapped.__name__}``; every "
        "attribute it does not define is the wrapped store's."
    )
    # Same class name as the wrapped one: torch and our code branch on type names.
    cls = type(wrapped.__name__, (base,), namespace)
    if isinstance(wrapped, abc.ABCMeta):
        wrapped.register(cls)  # isinstance(adapter, fastelastic.store.TCPStore) holds
    return cls
