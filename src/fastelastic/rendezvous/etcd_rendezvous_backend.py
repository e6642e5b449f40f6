"""torch-shaped :class:`EtcdRendezvousBackend`: dynamic-rendezvous state in one etcd v3 key."""

from __future__ import annotations

import base64
import queue
from datetime import timedelta
from typing import Any

from fastelastic.errors import (
    RendezvousConnectionError,
    RendezvousStateError,
    StoreError,
)

from .api import RendezvousParameters
from .dynamic_rendezvous import RendezvousBackend, Token
from .etcd_impl.etcd_kv import EtcdKV, _prefix_end

__all__ = ["EtcdRendezvousBackend", "create_backend"]

_DEFAULT_PREFIX = "/torch/elastic/rendezvous/"
_DEFAULT_TTL = 7200


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else bytes(data)).decode()


class EtcdRendezvousBackend(RendezvousBackend):
    """A rendezvous backend on etcd v3 through an ``etcd3gw`` client.

    The fencing token is the key's ``mod_revision``; ``set_state`` is one transaction comparing
    it (or, without a token, requiring the key to be absent). Every write attaches a fresh lease
    of ``ttl`` seconds, so an abandoned rendezvous disappears. ``wait_for_change`` watches the
    key from the token's revision, so nodes block instead of polling.

    Args:
        client: The ``etcd3gw`` client.
        run_id: The run id of the rendezvous.
        key_prefix: Path under which the state key is stored (default
            ``/torch/elastic/rendezvous/``).
        ttl: TTL of the state in seconds (default 7200).

    Raises:
        ValueError: Empty run id or non-positive TTL.
    """

    def __init__(self, client: Any, run_id: str, key_prefix: str | None = None,
                 ttl: int | None = None) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        if ttl is not None and ttl <= 0:
            raise ValueError("The TTL must be a positive integer.")
        self._client = client
        self._key = (key_prefix or _DEFAULT_PREFIX) + run_id
        self._ttl = ttl or _DEFAULT_TTL

    @property
    def name(self) -> str:
        """See base class."""
        return "etcd-v2"

    def _post(self, path: str, body: dict) -> dict:
        from etcd3gw import exceptions as etcd_exc

        try:
            return dict(self._client.post(self._client.get_url(path), json=body))
        except etcd_exc.Etcd3Exception as e:
            raise RendezvousConnectionError(
                "The connection to etcd has failed. See inner exception for details."
            ) from e

    def _decode(self, kvs: list[dict]) -> tuple[bytes, Token] | None:
        if not kvs:
            return None
        try:
            value = base64.b64decode(kvs[0].get("value", ""), validate=True)
        except ValueError as e:
            raise RendezvousStateError("The state object is corrupt.") from e
        return value, int(kvs[0]["mod_revision"])

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        resp = self._post("/kv/range", {"key": _b64(self._key)})
        return self._decode(resp.get("kvs") or [])

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        key = _b64(self._key)
        if token is None:
            guard = {"key": key, "target": "CREATE", "create_revision": 0}
        else:
            try:
                guard = {"key": key, "target": "MOD", "mod_revision": int(token)}
            except (TypeError, ValueError):
                current = self.get_state()
                return None if current is None else (*current, False)
        lease = int(self._post("/lease/grant", {"TTL": self._ttl, "ID": 0})["ID"])
        put = {"request_put": {"key": key, "value": _b64(state), "lease": lease}}
        resp = self._post("/kv/txn", {"compare": [guard], "success": [put, {"request_range":
                                      {"key": key}}], "failure": [{"request_range": {"key": key}}]})
        won = bool(resp.get("succeeded"))
        ranges = [r["response_range"] for r in resp.get("responses", []) if "response_range" in r]
        pair = self._decode(ranges[-1].get("kvs") or []) if ranges else None
        if not won:
            self._post("/kv/lease/revoke", {"ID": lease})
        if pair is None:
            return None
        return pair[0], pair[1], won

    def wait_for_change(self, token: Token | None, timeout: float) -> None:
        """Blocks until the state key changes after revision ``token`` (or ``timeout``)."""
        from etcd3gw.watch import Watcher

        if timeout <= 0:
            return
        start = int(token) + 1 if token is not None else 1
        events: queue.Queue[Any] = queue.Queue()
        raw = self._key
        try:
            watcher = Watcher(self._client, raw, lambda ev: events.put(ev), start_revision=start,
                              range_end=base64.b64decode(_prefix_end(raw)).decode())
        except Exception as e:
            raise RendezvousConnectionError(f"etcd watch failed: {e}") from e
        try:
            events.get(timeout=timeout)
        except queue.Empty:
            pass
        finally:
            watcher.stop()


def create_backend(params: RendezvousParameters) -> tuple[EtcdRendezvousBackend, Any]:
    """Create an :class:`EtcdRendezvousBackend` and the control-plane store from parameters.

    ``rdzv_conf`` keys: ``read_timeout`` (seconds, default 60), ``protocol`` (http/https),
    ``ssl_cert``, ``ssl_cert_key``, ``ca_cert``, ``key_prefix``, ``ttl``.

    Returns:
        The backend and a store-shaped etcd view under ``/torch/elastic/store/``.

    Raises:
        ValueError: A malformed option.
        RendezvousConnectionError: etcd cannot be reached.
    """
    from .etcd_rendezvous import etcd_clients_from_params, etcd_retry_seconds

    clients = etcd_clients_from_params(params)
    read_timeout = params.get_as_int("read_timeout", 60) or 60
    store = EtcdKV(clients, "/torch/elastic/store/", timeout=timedelta(seconds=read_timeout),
                   retry_s=etcd_retry_seconds(params))
    try:
        store.check(["probe"])
    except StoreError as e:
        raise RendezvousConnectionError(f"etcd at {params.endpoint} is unreachable: {e}") from e
    backend = EtcdRendezvousBackend(clients[0], params.run_id, params.get("key_prefix"),
                                    params.get_as_int("ttl"))
    return backend, store
