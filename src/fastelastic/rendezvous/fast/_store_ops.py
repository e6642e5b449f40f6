"""The store requests of the rendezvous machine (:mod:`._round`) on a store client: one
dispatch over the typed requests of :mod:`._requests` (:func:`apply`), and the requests that
need more than one call: waits that end in a value or ``False`` instead of an exception,
disconnect actions registered together, and waits cut into slices no longer than the
detection window (``bounded``).

With several ``--rdzv-endpoint`` candidates a store that does not answer within the window is
lost, so the rendezvous moves on. A long wait (a last call of 30 s, a spare's wait of minutes)
is then made of half-window slices, each reply due within the window (a slice that passes is
cancelled, and the cancel must be answered in time): a frozen or cut host is noticed within
1.5 windows wherever the node is waiting. (A shorter reply deadline would move nodes away
from a store that is merely slow under load.)
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, TypeVar

from fastelastic.errors import StoreTimeoutError

from . import _requests as rq

T = TypeVar("T")


def apply(store: Any, op: rq.Request, bounded: float = 0.0) -> Any:
    """Runs one of the machine's store requests on ``store``: its reply (see
    :mod:`._requests`); waits in slices of at most ``bounded`` seconds (:func:`wait`).

    Raises:
        TypeError: ``op`` is not a store request (the handler answers the others itself).
    """
    match op:
        case rq.Get(key, timeout):
            return get(store, key, timeout, bounded)
        case rq.Wait(keys, timeout):
            return wait(store, keys, timeout, bounded)
        case rq.Add(key, amount):
            return store.add(key, amount)
        case rq.Check(keys):
            return store.check(keys)
        case rq.MultiGet(keys):
            return store.multi_get(keys)
        case rq.MultiSet(keys, values):
            return store.multi_set(keys, values)
        case rq.Set(key, value):
            return store.set(key, value)
        case rq.Append(key, value):
            return store.append(key, value)
        case rq.CompareSet(key, expected, desired):
            return store.compare_set(key, expected, desired)
        case rq.AppendOnDisconnect(key, value):
            return store.append_on_disconnect(key, value)
        case rq.OnDisconnect(keys, values):
            on_disconnect(store, keys, values)
            return None
        case _:
            raise rq.unknown(op)


def run_all(store: Any, gen: rq.RequestGen[T]) -> T:
    """Runs a machine operation that makes only plain store requests on ``store``."""
    reply: Any = None
    for _ in range(1_000_000):  # an operation's requests
        try:
            op = gen.send(reply)
        except StopIteration as e:
            return e.value  # type: ignore[no-any-return]
        reply = apply(store, op)
    raise AssertionError("an operation that never ends")


def on_disconnect(store: Any, keys: list[str], values: list[bytes]) -> None:
    """Registers disconnect actions in one round trip where the client can pipeline them."""
    many = getattr(store, "append_on_disconnect_many", None)
    if many is not None:
        many(keys, values)
        return
    for k, v in zip(keys, values, strict=True):
        store.append_on_disconnect(k, v)


def wait(store: Any, keys: list[str], seconds: float, bounded: float = 0.0) -> bool:
    """True once every key is set, False after ``seconds``; slices of at most ``bounded``
    seconds when it is above 0."""
    return bool(_sliced(lambda t: store.wait(keys, t) or True, seconds, bounded, False))


def get(store: Any, key: str, seconds: float | None, bounded: float = 0.0) -> Any:
    """``key``'s value, or None once ``seconds`` passed (None: the store's own timeout, whose
    passing raises ``StoreTimeoutError``; for keys known to exist); slices as :func:`wait`."""
    if seconds is None:
        return store.get(key)
    return _sliced(lambda t: store.get(key, t), seconds, bounded, None)


def _sliced(call: Callable[[timedelta], Any], seconds: float, bounded: float,
            missed: Any) -> Any:
    """``call(timeout)`` in slices of at most ``bounded`` seconds (one call when 0) until it
    returns; ``missed`` once ``seconds`` passed."""
    end = time.monotonic() + seconds
    for _ in range(1_000_000):  # bounded by ``end``
        left = end - time.monotonic()
        piece = min(left, bounded) if bounded > 0 else left
        try:
            return call(timedelta(seconds=max(piece, 0.001)))
        except StoreTimeoutError:
            if piece >= left:
                return missed
    return missed


@contextlib.contextmanager
def reply_deadline(store: Any, seconds: float, restore: timedelta) -> Iterator[Any]:
    """``store`` with its reply deadline set to ``seconds``, then back to ``restore``."""
    store.set_timeout(timedelta(seconds=seconds))
    try:
        yield store
    finally:
        with contextlib.suppress(Exception):
            store.set_timeout(restore)


@contextlib.contextmanager
def fresh(store: Any, seconds: float) -> Iterator[Any]:
    """A new connection to ``store``'s server, made within ``seconds`` (``store`` itself may
    be broken), closed afterwards."""
    store.set_timeout(timedelta(seconds=seconds))
    conn = store.clone()
    try:
        yield conn
    finally:
        with contextlib.suppress(Exception):
            conn.close()
