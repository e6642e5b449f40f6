"""A rendezvous store that outlives its host: the candidate endpoints of ``--rdzv-endpoint
h1:p1,h2:p2,...``, a standby store on this node's candidate, and the choice of the live one.

Every node that owns a candidate (its host is this machine; at most one candidate per node)
hosts a store on it from the start, empty. All nodes meet on the live store: the reachable
candidate with the highest ``epoch`` key, the first in the list among equals. When the live
store's host is lost, the survivors move to the next one, raise its ``epoch`` past the old
one's, and join there afresh (the rendezvous state is soft: the members re-create it). A node
started later probes the candidates the same way and finds where the others went. What keeps
the two sides of a partition from both training is the majority rule of ``_round.Machine.moved``.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from fastelastic.errors import RendezvousConnectionError, StoreError

from .utils import _matches_machine_hostname, parse_rendezvous_endpoint

log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous")

PROBE_S = 2.0  # seconds a candidate has to accept and answer a probe


def parse_candidates(endpoint: str, default_port: int) -> list[tuple[str, int]]:
    """``h1:p1,h2:p2,...`` as ``[(host, port), ...]``; at least two, no duplicates.

    Raises:
        ValueError: A malformed or repeated candidate.
    """
    out = [parse_rendezvous_endpoint(e, default_port) for e in endpoint.split(",")]
    if any(not e.strip() for e in endpoint.split(",")):
        raise ValueError(f"The rendezvous endpoint list {endpoint!r} has an empty entry.")
    if len(set(out)) != len(out):
        raise ValueError(f"The rendezvous endpoint list {endpoint!r} repeats a candidate.")
    return out


class Candidates:
    """The candidates, this node's standby store and the connection to the live one."""

    def __init__(self, run_id: str, endpoints: list[tuple[str, int]], is_host: bool | None,
                 read_timeout: timedelta, token: bytes | None = None) -> None:
        self.key = f"fe.rdzv.{run_id}/epoch"
        self.endpoints = endpoints
        self.read_timeout = read_timeout
        self.token = token
        self.standby: Any = None  # the store this node hosts, if it owns a candidate
        self.standby_index = -1
        if is_host is not False:
            self._host(is_host)

    def _host(self, is_host: bool | None) -> None:
        from fastelastic.store import TCPStore

        for i, (host, port) in enumerate(self.endpoints):
            if not (is_host or _matches_machine_hostname(host)):
                continue
            try:
                self.standby = TCPStore(host, port, is_master=True, multi_tenant=True,
                                        wait_for_workers=False, timeout=self.read_timeout,
                                        token=self.token)
                self.standby_index = i
                return
            except (StoreError, OSError) as e:  # hosted by another node of this machine
                log.debug("candidate %s:%d already hosted (%s)", host, port, e)

    def name(self, i: int) -> str:
        host, port = self.endpoints[i]
        return f"{host}:{port}"

    def connect(self, exclude: int = -1, at_least: int = 0) -> tuple[Any, int, int]:
        """Connects to the live store: (client, candidate index, epoch). Its epoch is raised
        to ``at_least`` when lower (this node moves the rendezvous there).

        Raises:
            RendezvousConnectionError: No candidate answered.
        """
        from fastelastic.store import TCPStore

        found: list[tuple[int, int, Any]] = []
        errors = []
        for i, (host, port) in enumerate(self.endpoints):
            if i == exclude:
                continue
            try:
                c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
            except (StoreError, OSError) as e:
                errors.append(f"{host}:{port}: {e}")
                continue
            try:
                found.append((-int(c.add(self.key, 0)), i, c))
            except (StoreError, OSError) as e:
                errors.append(f"{host}:{port}: {e}")
                c.close()
        if not found:
            raise RendezvousConnectionError(
                "No rendezvous store candidate could be reached: " + "; ".join(errors))
        found.sort(key=lambda f: (f[0], f[1]))
        neg, i, client = found[0]
        for _, _, other in found[1:]:
            other.close()
        epoch = -neg
        if epoch < at_least:
            epoch = int(client.add(self.key, at_least - epoch))
        client.set_timeout(self.read_timeout)
        return client, i, epoch

    def close(self) -> None:
        if self.standby is not None:
            standby, self.standby = self.standby, None
            standby.close()
