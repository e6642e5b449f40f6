"""A store-shaped view of etcd v3 (via the ``etcd3gw`` HTTP gateway client) for the rendezvous.

It offers the subset of the TCPStore API the ticket protocol uses (``add``, ``set``, ``get``,
``check``, ``wait``, ``multi_set``, ``multi_get``, ``compare_set``, ``append``,
``append_on_disconnect``) with etcd primitives: read-modify-write steps are transactions
guarded by ``mod_revision`` (compare-and-set), waits are watches started at the revision of the
read that found the keys missing (nothing is missed, nothing is polled), and liveness is a
lease: ``append_on_disconnect(key, v)`` puts ``key/.dc/<lease>`` under this client's lease;
when the lease expires (the process died) etcd deletes the marker and any node watching ``key``
appends ``v`` to it. Several endpoints may be given; requests fail over between them.
"""

from __future__ import annotations

import base64
import builtins
import logging
import queue
import random
import threading
import time
from datetime import timedelta
from typing import Any

from fastelastic.errors import StoreConnectionError, StoreError, StoreTimeoutError

__all__ = ["EtcdKV"]

log = logging.getLogger(__name__)

_MARK = "/.dc/"
_MAX_CAS = 10_000
_RETRY_S = 30.0  # how long a request retries across endpoints / leader elections, at most
_NOTE_EVERY_S = 5.0  # how often a retrying request says what it waits for
_WATCH_CHECK_S = 2.0


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else bytes(data)
    return base64.b64encode(raw).decode()


def _unb64(data: str) -> bytes:
    return base64.b64decode(data)


def _prefix_end(prefix: str) -> str:
    raw = bytearray(prefix.encode())
    raw[-1] += 1
    return _b64(bytes(raw))


class EtcdKV:
    """Store-shaped client over one or more etcd members.

    Args:
        clients: ``etcd3gw`` clients, one per member endpoint (failover order).
        prefix: Key prefix for everything this object reads and writes.
        timeout: Default timeout of ``get``/``wait``.
        lease_ttl: TTL in seconds of the liveness lease behind ``append_on_disconnect``.
        retry_s: How long one request retries while no member answers (at most 30 s); the
            handlers pass their join timeout when it is shorter.
    """

    supports_extensions = True

    def __init__(self, clients: list[Any], prefix: str, timeout: timedelta = timedelta(seconds=60),
                 lease_ttl: int = 3, retry_s: float = _RETRY_S) -> None:
        if not clients:
            raise ValueError("at least one etcd endpoint is required")
        self._clients = list(clients)
        self.retry_s = max(0.0, min(float(retry_s), _RETRY_S))
        self._cur = 0
        self._prefix = prefix
        self.timeout = timeout
        self._ttl = max(2, int(lease_ttl))
        self._lease_id: int | None = None
        self._lease_stop = threading.Event()
        self._lease_thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ plumbing

    @property
    def host(self) -> str:
        return str(self._clients[self._cur].host)

    @property
    def port(self) -> int:
        return int(self._clients[self._cur].port)

    def endpoints(self) -> str:
        """The members' ``host:port``, comma separated (for messages)."""
        return ",".join(f"{c.host}:{c.port}" for c in self._clients)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _post(self, path: str, body: dict, retry_s: float | None = None) -> dict:
        """POSTs to the current member, failing over and retrying through elections (for
        ``retry_s`` seconds, default the store's)."""
        from etcd3gw import exceptions as etcd_exc

        start = time.monotonic()
        deadline = start + (self.retry_s if retry_s is None else retry_s)
        next_note = start
        delay = 0.05
        while True:
            client = self._clients[self._cur]
            try:
                return dict(client.post(client.get_url(path), json=body))
            except (etcd_exc.ConnectionFailedError, etcd_exc.ConnectionTimeoutError,
                    etcd_exc.InternalServerError) as e:
                detail = getattr(e, "detail_text", None) or str(e)
                now = time.monotonic()
                if now >= deadline or "CERTIFICATE_VERIFY_FAILED" in detail:
                    raise StoreConnectionError(
                        f"etcd request {path} to {client.host}:{client.port} failed "
                        f"(no member of {self.endpoints()} answered in {now - start:.1f} s): "
                        f"{detail}"
                    ) from e
                if now >= next_note:
                    log.warning(
                        "waiting for etcd: no member of %s answers %s (%s); retrying for up to "
                        "%.1f s more", self.endpoints(), path, detail, deadline - now)
                    next_note = now + _NOTE_EVERY_S
                self._cur = (self._cur + 1) % len(self._clients)
                # down, or an election in progress: back off, bounded by the deadline
                threading.Event().wait(min(delay, max(0.0, deadline - now)))
                delay = min(delay * 2, 1.0)
            except etcd_exc.Etcd3Exception as e:
                detail = getattr(e, "detail_text", None) or str(e)
                raise StoreError(f"etcd request {path} failed: {detail}") from e

    def _range(self, key: str) -> tuple[bytes | None, int, int]:
        """Returns (value or None, mod_revision, header revision)."""
        resp = self._post("/kv/range", {"key": _b64(self._k(key))})
        rev = int(resp["header"]["revision"])
        kvs = resp.get("kvs") or []
        if not kvs:
            return None, 0, rev
        return _unb64(kvs[0].get("value", "")), int(kvs[0]["mod_revision"]), rev

    def _txn(self, compare: list[dict], success: list[dict], failure: list[dict] | None = None
             ) -> dict:
        return self._post("/kv/txn", {"compare": compare, "success": success,
                                      "failure": failure or []})

    def _put_op(self, key: str, value: str | bytes, lease: int | None = None) -> dict:
        put: dict[str, Any] = {"key": _b64(self._k(key)), "value": _b64(value)}
        if lease is not None:
            put["lease"] = lease
        return {"request_put": put}

    def _rmw(self, key: str, fn: Any) -> bytes:
        """Read-modify-write ``key`` with ``fn(old or None) -> new`` under a revision guard."""
        for _ in range(_MAX_CAS):
            old, mod, _rev = self._range(key)
            new = fn(old)
            guard = {"key": _b64(self._k(key)), "target": "MOD", "mod_revision": mod}
            if old is None:
                guard = {"key": _b64(self._k(key)), "target": "CREATE", "create_revision": 0}
            if self._txn([guard], [self._put_op(key, new)]).get("succeeded"):
                return bytes(new)
            threading.Event().wait(random.uniform(0, 0.002))  # contention: tiny jitter
        raise StoreError(f"etcd compare-and-set on {key!r} kept losing")

    # ------------------------------------------------------------------ store API

    def set(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(self._k(key)), "value": _b64(value)})

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._txn([], [self._put_op(k, v) for k, v in zip(keys, values, strict=True)])

    def add(self, key: str, delta: int) -> int:
        out = self._rmw(key, lambda old: b"%d" % (int(old or b"0") + int(delta)))
        return int(out)

    def append(self, key: str, value: str | bytes) -> None:
        extra = value.encode() if isinstance(value, str) else bytes(value)
        self._rmw(key, lambda old: (old or b"") + extra)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        exp = expected.encode() if isinstance(expected, str) else bytes(expected)
        des = desired.encode() if isinstance(desired, str) else bytes(desired)
        k = _b64(self._k(key))
        guard: dict[str, Any]
        if exp:
            guard = {"key": k, "target": "VALUE", "value": _b64(exp)}
        else:
            guard = {"key": k, "target": "CREATE", "create_revision": 0}
        resp = self._txn([guard], [self._put_op(key, des)], [{"request_range": {"key": k}}])
        if resp.get("succeeded"):
            return des
        kvs = resp["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else exp

    def check(self, keys: list[str]) -> bool:
        return all(self._range(k)[0] is not None for k in keys)

    def get(self, key: str, timeout: timedelta | None = None) -> bytes:
        self.wait([key], timeout)
        value = self._range(key)[0]
        if value is None:
            raise StoreError(f"etcd key {key!r} vanished")
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.wait(keys)
        resp = self._txn([], [{"request_range": {"key": _b64(self._k(k))}} for k in keys])
        out = []
        for r in resp["responses"]:
            kvs = r["response_range"].get("kvs") or []
            out.append(_unb64(kvs[0].get("value", "")) if kvs else b"")
        return out

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Blocks until every key exists (watch from the revision the keys were read at)."""
        from etcd3gw.watch import Watcher

        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        missing, rev = self._missing(keys)
        if not missing:
            return
        full = [self._k(k) for k in missing]
        common = full[0]
        for f in full[1:]:
            while not f.startswith(common):
                common = common[:-1]
        events: queue.Queue[Any] = queue.Queue()

        def watch(from_rev: int) -> Any:
            return Watcher(self._clients[self._cur], common, lambda ev: events.put(ev),
                           start_revision=from_rev + 1, prev_kv=True,
                           range_end=_unb64(_prefix_end(common)).decode())

        watcher = watch(rev)
        try:
            while missing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(f"wait timeout after {limit:.3f}s, keys: {keys}")
                try:
                    ev = events.get(timeout=min(remaining, _WATCH_CHECK_S))
                except queue.Empty:
                    # A watch stream dies silently with its member (e.g. a stopped leader):
                    # after a quiet spell re-read and re-watch from the new revision.
                    watcher.stop()
                    missing, rev = self._missing(sorted(missing))
                    watcher = watch(rev)
                    continue
                self._on_event(ev, missing)
        finally:
            watcher.stop()

    def _missing(self, keys: list[str]) -> tuple[builtins.set[str], int]:
        resp = self._txn([], [{"request_range": {"key": _b64(self._k(k)), "count_only": True}}
                              for k in keys])
        missing = {k for k, r in zip(keys, resp["responses"], strict=True)
                   if not int(r["response_range"].get("count", 0))}
        return missing, int(resp["header"]["revision"])

    def _on_event(self, ev: dict, missing: builtins.set[str]) -> None:
        key = ev["kv"]["key"]
        key = key.decode() if isinstance(key, bytes) else str(key)
        short = key[len(self._prefix):]
        if ev.get("type") == "DELETE":
            if _MARK in short:
                base = short.split(_MARK, 1)[0]
                value = ev.get("prev_kv", {}).get("value", "")
                value = value if isinstance(value, bytes) else _unb64(value)
                log.info("etcd lease of a node expired; appending to %s", base)
                self.append(base, value)
                missing.discard(base)
        else:
            missing.discard(short)

    # ------------------------------------------------------------------ liveness

    def append_on_disconnect(self, key: str, value: str | bytes) -> None:
        for attempt in range(2):
            lease = self._lease()
            try:
                self._post("/kv/put", {"key": _b64(self._k(f"{key}{_MARK}{lease}")),
                                       "value": _b64(value), "lease": lease})
                return
            except StoreError:
                if attempt:
                    raise
                with self._lock:  # the lease expired (e.g. a long election): take a new one
                    if self._lease_id == lease:
                        self._lease_id = None

    def _lease(self) -> int:
        with self._lock:
            if self._lease_id is None:
                resp = self._post("/lease/grant", {"TTL": self._ttl, "ID": 0})
                self._lease_id = int(resp["ID"])
                if self._lease_thread is None:
                    self._lease_thread = threading.Thread(
                        target=self._keep_lease, name="fe-etcd-lease", daemon=True)
                    self._lease_thread.start()
            return self._lease_id

    def _keep_lease(self) -> None:
        """Refreshes the lease every TTL/3; once it could not for a whole TTL the lease is
        gone (etcd expired it), so the thread ends and the next hook takes a new lease."""
        interval = self._ttl / 3.0
        last_ok = time.monotonic()
        while not self._lease_stop.wait(interval):
            lease = self._lease_id
            if lease is None:
                break
            try:
                # a lease not refreshed for its TTL is gone: retrying longer is pointless
                self._post("/lease/keepalive", {"ID": lease}, retry_s=float(self._ttl))
                last_ok = time.monotonic()
            except StoreError as e:
                if time.monotonic() - last_ok > self._ttl:
                    log.warning("etcd lease %d lost: %s", lease, e)
                    with self._lock:
                        if self._lease_id == lease:
                            self._lease_id = None
                    break
        with self._lock:
            self._lease_thread = None

    def close(self) -> None:
        """Stops the keep-alive and revokes the lease (markers vanish: peers see us leave)."""
        self._lease_stop.set()
        if self._lease_id is not None:
            try:
                self._post("/kv/lease/revoke", {"ID": self._lease_id})
            except StoreError:
                log.debug("lease revoke failed", exc_info=True)
