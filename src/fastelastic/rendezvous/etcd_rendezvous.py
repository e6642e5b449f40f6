"""The ``etcd`` rendezvous: the ticket protocol of :mod:`.fast.fast_rendezvous` on etcd v3.

Rendezvous state lives in etcd (transactions for compare-and-set, a lease per node for
liveness, watches for waiting; see :mod:`.etcd_impl.etcd_kv`), outside any training node. The
store handed to workers is still fastelastic's TCPStore: each round's rank 0 hosts a fresh one
and its address travels in the round's outcome, so a round after rank 0's node was lost is
hosted by a survivor and nobody is given the lost one's. A member's death is known through its
connection to that store at once, and the others end its lease
(:mod:`.etcd_impl.etcd_liveness`); the lease expiring is the fallback.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

from fastelastic.errors import RendezvousConnectionError, StoreError

from .api import RendezvousParameters, RendezvousStoreInfo
from .etcd_impl.etcd_kv import EtcdKV
from .etcd_impl.etcd_liveness import RoundLiveness
from .fast.fast_rendezvous import FastRendezvousHandler, _prefix_store
from .timeouts import timeout_from_params
from .utils import parse_rendezvous_endpoint

__all__ = [
    "EtcdFastRendezvousHandler",
    "create_rdzv_handler",
    "etcd_clients_from_params",
    "etcd_retry_seconds",
]

log = logging.getLogger(__name__)

DEFAULT_PORT = 2379


class EtcdFastRendezvousHandler(FastRendezvousHandler):
    """Fast rendezvous whose coordination goes through etcd; workers get a TCPStore.

    Each round's members are linked through rank 0's workers' store, so that a member's
    death is known at once rather than when its etcd lease expires (see
    :mod:`.etcd_impl.etcd_liveness`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._client: Any = None  # this round's connection to rank 0's worker store
        self._liveness: RoundLiveness | None = None

    def _round_store(self, r: int, rank: int,
                     wstore: bytes = b"") -> tuple[Any, RendezvousStoreInfo]:
        from fastelastic.store import TCPStore

        # The last round's link ends on purpose, before its hub retires its store (below).
        self._stop_liveness()
        info = self._worker_store_info(r, rank, self._store, wstore)
        if self._client is not None and self._client is not self._worker_server:
            self._client.close()
        if self._worker_server is not None:
            self._client = self._worker_server
        else:
            self._client = TCPStore(info.master_addr, info.master_port,
                                    timeout=self._store.timeout)
        link = None
        try:  # a connection of its own: the hub's store ties our disconnect action to it
            link = TCPStore(info.master_addr, info.master_port, timeout=self._store.timeout)
            self._liveness = RoundLiveness(self._store, link, rank == 0, f"{self._run_id}/{r}")
        except (StoreError, OSError) as e:  # the lease stays: slower, not wrong
            if link is not None:
                link.close()
            log.warning("rendezvous %s round %d: no fast liveness link to rank 0's store "
                        "(%s); a lost node is noticed when its etcd lease expires",
                        self._run_id, r, e)
        return _prefix_store(str(self.store_prefix), self._client), info

    def _stop_liveness(self) -> None:
        link, self._liveness = self._liveness, None
        if link is not None:
            link.stop()

    def shutdown(self) -> bool:
        """See base class; also revokes this node's etcd lease."""
        self._stop_liveness()
        ok = super().shutdown()
        self._store.close()
        return ok


def etcd_clients_from_params(params: RendezvousParameters) -> list[Any]:
    """Builds one ``etcd3gw`` client per endpoint in ``params.endpoint`` (comma-separated).

    ``rdzv_conf``: ``protocol`` (http/https), ``ca_cert``, ``ssl_cert``, ``ssl_cert_key``,
    ``read_timeout`` (request timeout in seconds, default 60).

    Raises:
        ValueError: An unknown protocol or an incomplete client certificate pair.
        RendezvousConnectionError: ``etcd3gw`` is not installed.
    """
    try:
        import etcd3gw
    except ImportError as e:
        raise RendezvousConnectionError(
            "The etcd rendezvous needs the etcd3gw package (pip install fastelastic[etcd])."
        ) from e
    protocol = str(params.get("protocol", "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise ValueError(f"The etcd protocol must be http or https, not {protocol!r}.")
    cert, key = params.get("ssl_cert"), params.get("ssl_cert_key")
    if (cert is None) != (key is None):
        raise ValueError("ssl_cert and ssl_cert_key must be given together.")
    read_timeout = params.get_as_int("read_timeout", 60)
    ca_cert = params.get("ca_cert")
    clients = []
    for endpoint in (params.endpoint or "").split(","):
        host, port = parse_rendezvous_endpoint(endpoint, DEFAULT_PORT)
        clients.append(etcd3gw.client(host=host, port=port, protocol=protocol,
                                      timeout=read_timeout, session=_session(ca_cert, cert, key)))
    return clients


def etcd_retry_seconds(params: RendezvousParameters) -> float:
    """How long an etcd request retries while no member answers: at most 30 s, ``read_timeout``
    and the join timeout (a rendezvous never outwaits its own timeouts)."""
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    join = timeout_from_params(params).join.total_seconds()
    return float(min(30, read_timeout, join))


def _session(ca_cert: str | None, cert: str | None, key: str | None) -> Any:
    import requests

    session = requests.Session()
    if ca_cert is not None:
        session.verify = ca_cert
        # requests lets REQUESTS_CA_BUNDLE/CURL_CA_BUNDLE override session.verify unless the
        # environment is ignored (psf/requests#3829); an explicit ca_cert must win.
        session.trust_env = False
    if cert is not None and key is not None:
        session.cert = (cert, key)
    return session


def _keep_alive_interval(params: RendezvousParameters) -> float:
    """Seconds between keep-alives (default 5: each is an etcd write); a fraction is fine, as
    for the ``c10d`` handler."""
    try:
        value = float(params.get("keep_alive_interval", 5) or 5)
    except (TypeError, ValueError) as e:
        raise ValueError("The rendezvous configuration option 'keep_alive_interval' must be a "
                         "number of seconds.") from e
    if value <= 0:
        raise ValueError("keep_alive_interval must be > 0.")
    return value


def create_rdzv_handler(params: RendezvousParameters) -> EtcdFastRendezvousHandler:
    """Creates the ``etcd`` handler.

    ``rdzv_conf`` keys: those of :func:`etcd_clients_from_params`, ``key_prefix`` (default
    ``/fastelastic/``), ``lease_ttl`` (seconds, default 3: how fast a node is noticed dead
    when its connection to rank 0's workers' store does not tell: frozen, cut off, lost while
    a round forms), ``keep_alive_interval`` (default 5 s: each keep-alive is an etcd write),
    ``keep_alive_max_attempt`` (default 3) and the timeouts of the ``c10d`` handler.

    Raises:
        ValueError: A malformed option.
        RendezvousConnectionError: etcd cannot be reached.
    """
    clients = etcd_clients_from_params(params)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    kv = EtcdKV(clients, str(params.get("key_prefix", "/fastelastic/")),
                timeout=timedelta(seconds=read_timeout),
                lease_ttl=params.get_as_int("lease_ttl", 3) or 3,
                retry_s=etcd_retry_seconds(params))
    try:
        kv.check(["probe"])
    except StoreError as e:
        raise RendezvousConnectionError(f"etcd at {params.endpoint} is unreachable: {e}") from e
    rank = params.get_as_int("rank", -1)
    return EtcdFastRendezvousHandler(
        params.run_id, kv, params.backend, params.min_nodes, params.max_nodes,
        timeout_from_params(params), local_addr=params.local_addr,
        node_rank=-1 if rank is None else rank,
        keep_alive_interval=_keep_alive_interval(params),
        keep_alive_max_attempt=params.get_as_int("keep_alive_max_attempt", 3) or 3,
    )
