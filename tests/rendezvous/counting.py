"""A store proxy that counts wire requests per node, shared by tests and the benchmark."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

# Requests each client call puts on the wire (tcpstore-protocol.md, section 5).
_WIRE = {"get": 2, "multi_get": 2}


class CountingStore:
    """Forwards every call to ``inner`` and counts the wire requests it costs."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.messages = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.messages += _WIRE.get(name, 1)
            return attr(*args, **kwargs)

        return call


def run_counted(port: int, run_id: str, n: int, join: float = 60.0,
                keep_alive_interval: float = 1.0) -> list[int]:
    """Runs ``n`` fast-rendezvous nodes as threads (min = max = n); returns messages per node.

    A node waiting for the outcome also looks at its deciders' keep-alives every quarter of
    the detection window (``keep_alive_interval`` x 5): requests that count the round's
    length in time, not its size."""
    from fastelastic.rendezvous.fast.fast_rendezvous import FastRendezvousHandler
    from fastelastic.rendezvous.timeouts import RendezvousTimeout
    from fastelastic.store import TCPStore

    stores = [CountingStore(TCPStore("127.0.0.1", port, timeout=timedelta(seconds=join)))
              for _ in range(n)]
    timeout = RendezvousTimeout(join=timedelta(seconds=join), last_call=timedelta(microseconds=1))
    handlers = [FastRendezvousHandler(run_id, s, "c10d", n, n, timeout,
                                      keep_alive_interval=keep_alive_interval) for s in stores]
    errors: list[BaseException] = []

    def node(h: FastRendezvousHandler) -> None:
        try:
            h.next_rendezvous()
            h._stop_heartbeats()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=node, args=(h,)) for h in handlers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(join)
    if errors:
        raise errors[0]
    counts = [s.messages for s in stores]
    for h in handlers:
        h._wstore.close()  # the workers' store socket each node bound when it joined
    for s in stores:
        s.close()
    return counts
