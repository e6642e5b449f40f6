"""A store-shaped view of etcd v3 (its JSON gateway, through ``etcd3gw`` clients) for the
rendezvous.

It offers the subset of the TCPStore API the ticket protocol uses (``add``, ``set``, ``get``,
``check``, ``wait``, ``multi_set``, ``multi_get``, ``compare_set``, ``append``,
``append_on_disconnect``) with etcd primitives:

* Read-modify-write steps (``add``, ``append``) are transactions guarded by ``mod_revision``
  that also create an operation key ``<key>/.op/<id>`` holding the value written. A request
  whose answer was lost (its member died, or a leader election timed it out) is retried on
  another member; if it had been applied, the operation key exists and the retry returns its
  value instead of applying it twice (a ticket counted twice would be a phantom member).
* Waits are watches started at the revision of the read that found the keys missing (nothing
  is missed, nothing is polled). A watch stream that ends (its member died) is re-opened on
  the next member at once.
* Liveness is a lease: ``append_on_disconnect(key, v)`` puts ``key/.dc/<lease>`` under this
  client's lease. When the lease ends (it expired: the process died or was cut off; or it was
  revoked: see :py:meth:`EtcdKV.revoke`) etcd deletes the marker, and every client that holds a
  lease watches for such deletions and appends ``v`` to ``key``; the operation key
  ``key/.op/dc-<lease>`` makes that happen once, whoever sees it first. Nobody needs to be
  waiting on ``key`` for the action to take effect, as with the TCPStore's.

Several endpoints may be given; requests fail over between them.
"""

from __future__ import annotations

import base64
import builtins
import logging
import os
import queue
import random
import threading
import time
from datetime import timedelta
from typing import Any

from fastelastic.errors import StoreConnectionError, StoreError, StoreTimeoutError

from .etcd_stream import CONNECT_S, Unanswered, WatchStream, member_url

__all__ = ["EtcdKV"]

log = logging.getLogger("fastelastic.rendezvous.etcd_kv")  # its name before the move

_MARK = "/.dc/"
_OP = "/.op/"
_MAX_CAS = 10_000
_RETRY_S = 30.0  # how long a request retries across endpoints / leader elections, at most
_NOTE_EVERY_S = 5.0  # how often a retrying request says what it waits for
_WATCH_CHECK_S = 5.0  # a quiet wait re-reads its keys this often (a stream that stalls silently)
_REQUEST_S = 5.0  # read timeout of a request's later tries
_FIRST_TRY_S = 1.0  # read timeout of its first try
_MAX_RESTREAMS = 100_000  # bound on the re-opened streams of one reaper
_MAX_KEEPALIVES = 1 << 40  # bound on a lease's keep-alives


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
        self._reaper: threading.Thread | None = None
        self._reaper_stream: WatchStream | None = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._req_s = min(_REQUEST_S, max(1.0, float(getattr(clients[0], "timeout", None)
                                                     or _REQUEST_S)))

    # ------------------------------------------------------------------ plumbing

    @property
    def host(self) -> str:
        return str(self._clients[self._cur].host)

    @property
    def port(self) -> int:
        return int(self._clients[self._cur].port)

    @property
    def lease_id(self) -> int | None:
        """This client's liveness lease (None until it registered a disconnect action)."""
        return self._lease_id

    def endpoints(self) -> str:
        """The members' ``host:port``, comma separated (for messages)."""
        return ",".join(f"{c.host}:{c.port}" for c in self._clients)

    def _k(self, key: str) -> str:
        return self._prefix + key

    def _failover(self, what: str, fn: Any, retry_s: float | None = None) -> Any:
        """Runs ``fn(client)`` on the current member, moving to the next one and retrying
        (backing off, bounded by ``retry_s``, default the store's) while none answers."""
        start = time.monotonic()
        deadline = start + (self.retry_s if retry_s is None else retry_s)
        next_note = start
        delay = 0.02
        n = len(self._clients)
        for attempt in range(1, 10_000_000):  # ends at the deadline (a raise)
            cur = self._cur
            client = self._clients[cur]
            try:
                return fn(client, attempt)
            except Unanswered as e:
                detail = str(e)
                now = time.monotonic()
                if now >= deadline or "CERTIFICATE_VERIFY_FAILED" in detail:
                    raise StoreConnectionError(
                        f"etcd request {what} to {client.host}:{client.port} failed "
                        f"(no member of {self.endpoints()} answered in {now - start:.1f} s): "
                        f"{detail}"
                    ) from e
                if now >= next_note:
                    log.warning(
                        "waiting for etcd: no member of %s answers %s (%s); retrying for up to "
                        "%.1f s more", self.endpoints(), what, detail, deadline - now)
                    next_note = now + _NOTE_EVERY_S
                if self._cur == cur:
                    self._cur = (cur + 1) % n
                if attempt % n == 0:
                    # every member tried: down, or an election in progress; back off
                    threading.Event().wait(min(delay, max(0.0, deadline - now)))
                    delay = min(delay * 2, 0.5)
        raise AssertionError("unreachable")

    def _post(self, path: str, body: dict, retry_s: float | None = None) -> dict:
        """POSTs to the current member, failing over and retrying through elections."""
        import requests

        def once(client: Any, attempt: int) -> dict:
            # A member without a leader holds a write until its own timeout (7 s at etcd's
            # defaults) although an election takes ~1-2 s: the first try on each member gives
            # up after 1 s and goes to the next one, later rounds wait longer (a slow disk, a
            # loaded host).
            # Retrying is safe: writes are idempotent or done once (see _rmw).
            rounds = (attempt - 1) // len(self._clients)
            read_s = min(self._req_s, _FIRST_TRY_S * 2 ** min(rounds, 8))
            try:
                resp = client.session.post(member_url(client, path), json=body,
                                           timeout=(CONNECT_S, read_s))
            except requests.exceptions.RequestException as e:
                raise Unanswered(str(e)) from e
            if resp.status_code in (408, 500, 503, 504):
                # 503: no leader, leader changed, member stopping; 500: transport closing
                raise Unanswered(resp.text[:300])
            if resp.status_code != 200:
                raise StoreError(f"etcd request {path} failed: {resp.text[:300]}")
            return dict(resp.json())

        return dict(self._failover(path, once, retry_s))

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

    def _rmw(self, key: str, fn: Any, op: str | None = None) -> bytes:
        """Read-modify-write ``key`` with ``fn(old or None) -> new`` under a revision guard,
        at most once: the transaction creates ``key/.op/<op>`` (default: a fresh id, under
        this client's lease) with the value written, and a retry that finds it returns it."""
        return self._rmw_once(key, fn, op)[0]

    def _rmw_once(self, key: str, fn: Any, op: str | None) -> tuple[bytes, bool]:
        """``_rmw``; also says whether this call wrote (False: the operation was done)."""
        op_key = f"{key}{_OP}{op or os.urandom(8).hex()}"
        lease = None if op is not None else self._lease_id
        k, ok = _b64(self._k(key)), _b64(self._k(op_key))
        for _ in range(_MAX_CAS):
            old, mod, _rev = self._range(key)
            new = bytes(fn(old))
            guard = {"key": k, "target": "MOD", "mod_revision": mod}
            if old is None:
                guard = {"key": k, "target": "CREATE", "create_revision": 0}
            fresh = {"key": ok, "target": "CREATE", "create_revision": 0}
            try:
                resp = self._txn([guard, fresh],
                                 [self._put_op(key, new), self._put_op(op_key, new, lease)],
                                 [{"request_range": {"key": ok}}])
            except StoreError as e:
                if lease is None or "lease not found" not in str(e):
                    raise
                lease = None  # our lease ended (a long outage): the op key does without
                self._forget_lease(self._lease_id)
                continue
            if resp.get("succeeded"):
                return new, True
            kvs = resp["responses"][0]["response_range"].get("kvs") or []
            if kvs:  # applied already: by our unanswered attempt, or (op) by another client
                return _unb64(kvs[0].get("value", "")), False
            threading.Event().wait(random.uniform(0, 0.002))  # contention: tiny jitter
        raise StoreError(f"etcd compare-and-set on {key!r} kept losing")

    # ------------------------------------------------------------------ store API

    def set(self, key: str, value: str | bytes) -> None:
        self._post("/kv/put", {"key": _b64(self._k(key)), "value": _b64(value)})

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._txn([], [self._put_op(k, v) for k, v in zip(keys, values, strict=True)])

    def add(self, key: str, delta: int) -> int:
        if int(delta) == 0:  # a read: no write, no operation key
            return int(self._range(key)[0] or b"0")
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
        # A retry of an applied compare_set fails its guard and reads our value: same answer.
        resp = self._txn([guard], [self._put_op(key, des)], [{"request_range": {"key": k}}])
        if resp.get("succeeded"):
            return des
        kvs = resp["responses"][0]["response_range"].get("kvs") or []
        return _unb64(kvs[0].get("value", "")) if kvs else exp

    def check(self, keys: list[str]) -> bool:
        if len(keys) == 1:
            return self._range(keys[0])[0] is not None
        return not self._missing(keys)[0]

    def get(self, key: str, timeout: timedelta | None = None) -> bytes:
        """One read when the key exists; else a watch from that read's revision, whose event
        carries the value (no read after it)."""
        value, _, rev = self._range(key)
        if value is not None:
            return value
        value = self._await({key}, rev, timeout, [key]).get(key)
        if value is None:  # seen by a re-read after a stream ended, not by an event
            value = self._range(key)[0]
        if value is None:
            raise StoreError(f"etcd key {key!r} vanished")
        return value

    def multi_get(self, keys: list[str]) -> list[bytes]:
        for _ in range(3):  # keys are never deleted: the second read finds them all
            resp = self._txn([], [{"request_range": {"key": _b64(self._k(k))}} for k in keys])
            out: list[bytes | None] = []
            for r in resp["responses"]:
                kvs = r["response_range"].get("kvs") or []
                out.append(_unb64(kvs[0].get("value", "")) if kvs else None)
            missing = [k for k, v in zip(keys, out, strict=True) if v is None]
            if not missing:
                return [v for v in out if v is not None]
            self.wait(missing)  # as the TCPStore's: wait for the missing ones
        raise StoreError(f"etcd keys {missing[:3]!r} vanished")

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Blocks until every key exists: a watch from the revision the keys were read at,
        re-opened on the next member if its stream ends."""
        missing, rev = self._missing(keys)
        if missing:
            self._await(missing, rev, timeout, keys)

    def _await(self, missing: builtins.set[str], rev: int, timeout: timedelta | None,
               keys: list[str]) -> dict[str, bytes]:
        """Watches from ``rev + 1`` until every key of ``missing`` was put; returns the values
        the events carried."""
        limit = (timeout or self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        full = [self._k(k) for k in missing]
        common = full[0]
        for f in full[1:]:
            while not f.startswith(common):
                common = common[:-1]
        body = {"key": _b64(common), "range_end": _prefix_end(common), "filters": ["NODELETE"]}
        events: queue.Queue[Any] = queue.Queue()
        stream: WatchStream | None = None
        seen: dict[str, bytes] = {}
        try:
            while missing:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise StoreTimeoutError(f"wait timeout after {limit:.3f}s, keys: {keys}")
                if stream is None:
                    stream = self._failover("/watch", lambda c, _a, r=rev + 1: WatchStream(
                        c, body, r, events.put, lambda: events.put(None)),
                        retry_s=min(self.retry_s, remaining))
                try:
                    ev = events.get(timeout=min(remaining, _WATCH_CHECK_S))
                except queue.Empty:
                    ev = None
                if ev is not None:
                    short = _unb64(ev["kv"]["key"]).decode()[len(self._prefix):]
                    if short in missing:
                        missing.discard(short)
                        seen[short] = _unb64(ev["kv"].get("value", ""))
                    continue
                # the stream ended (its member died) or stayed quiet: re-read, re-watch
                stream.stop()
                stream = None
                if events.qsize():  # events queued before the end still count
                    continue
                missing, rev = self._missing(sorted(missing))
        finally:
            if stream is not None:
                stream.stop()
        return seen

    def _missing(self, keys: list[str]) -> tuple[builtins.set[str], int]:
        resp = self._txn([], [{"request_range": {"key": _b64(self._k(k)), "count_only": True}}
                              for k in keys])
        missing = {k for k, r in zip(keys, resp["responses"], strict=True)
                   if not int(r["response_range"].get("count", 0))}
        return missing, int(resp["header"]["revision"])

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
                self._forget_lease(lease)  # it expired (e.g. a long outage): take a new one

    def append_on_disconnect_many(self, keys: list[str], values: list[str | bytes]) -> None:
        """Several disconnect actions in one request."""
        for attempt in range(2):
            lease = self._lease()
            try:
                self._txn([], [self._put_op(f"{k}{_MARK}{lease}", v, lease)
                               for k, v in zip(keys, values, strict=True)])
                return
            except StoreError:
                if attempt:
                    raise
                self._forget_lease(lease)

    def revoke(self, lease: int) -> bool:
        """Ends another client's lease now: its disconnect actions take effect, as if its
        lease had expired (its process is known to be gone). False if it had ended already.
        """
        try:
            self._post("/kv/lease/revoke", {"ID": int(lease)})
            return True
        except StoreError as e:
            if "not found" in str(e):
                return False
            raise

    def lease(self) -> int:
        """This client's liveness lease, taken (with its keep-alive) on first need."""
        return self._lease()

    def _forget_lease(self, lease: int | None) -> None:
        with self._lock:
            if lease is not None and self._lease_id == lease:
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
            if self._reaper is None and not self._closed.is_set():
                self._start_reaper()
            return self._lease_id

    def _keep_lease(self) -> None:
        """Refreshes the lease every TTL/3. Only etcd says a lease is gone (a keep-alive
        answered with TTL 0: it expired or was revoked); while no member answers (an
        election: the new leader extends every lease by its TTL) it keeps trying at once."""
        interval = self._ttl / 3.0
        delay = interval
        last_ok = last_note = time.monotonic()
        for _ in range(_MAX_KEEPALIVES):
            if self._lease_stop.wait(delay):
                break
            lease = self._lease_id
            if lease is None:
                break
            try:
                resp = self._post("/lease/keepalive", {"ID": lease}, retry_s=interval)
                ttl = int((resp.get("result") or resp).get("TTL", 0))
            except StoreConnectionError as e:
                now = time.monotonic()
                if now - last_note >= self._ttl:
                    log.warning("etcd lease %d: no keep-alive got through for %.1f s (%s); "
                                "still trying", lease, now - last_ok, e)
                    last_note = now
                delay = 0.0
                continue
            except StoreError as e:  # an answer, and an error: the lease is unknown
                log.warning("etcd lease %d: %s", lease, e)
                ttl = 0
            if ttl <= 0:
                log.warning("etcd lease %d ended (expired or revoked): this node's disconnect "
                            "actions took effect; the next one registered takes a new lease",
                            lease)
                self._forget_lease(lease)
                break
            last_ok = last_note = time.monotonic()
            delay = interval
        with self._lock:
            self._lease_thread = None
            if self._lease_id is not None and not self._lease_stop.is_set():
                # a new lease was taken while this thread was ending: it needs refreshing
                self._lease_thread = threading.Thread(
                    target=self._keep_lease, name="fe-etcd-lease", daemon=True)
                self._lease_thread.start()

    # ------------------------------------------------------------------ disconnect actions

    def _start_reaper(self) -> None:
        """Starts the thread that carries out the disconnect actions of ended leases."""
        self._reaper = threading.Thread(target=self._reap, name="fe-etcd-reaper", daemon=True)
        self._reaper.start()

    def _reap(self) -> None:
        """Watches this prefix for deletions (only: ``NOPUT``) from now on, re-opening the
        stream on the next member from the last revision seen whenever it ends; while this
        client holds a lease (the next one it takes starts a new watch)."""
        try:
            self._reap_while_leased()
        except StoreError as e:
            log.warning("etcd: stopped watching for ended leases: %s", e)
        finally:
            with self._lock:
                self._reaper = None  # the next disconnect action registered starts another

    def _reap_while_leased(self) -> None:
        rev = self._range("")[2] + 1
        body = {"key": _b64(self._prefix), "range_end": _prefix_end(self._prefix),
                "filters": ["NOPUT"], "prev_kv": True}
        for _ in range(_MAX_RESTREAMS):
            if self._closed.is_set() or self._lease_id is None:
                return
            ended = threading.Event()
            try:
                stream = self._failover("/watch", lambda c, _a, r=rev, e=ended: WatchStream(
                    c, body, r, self._on_delete, e.set))
            except StoreConnectionError as e:
                log.warning("etcd: cannot watch for ended leases: %s; retrying", e)
                continue
            self._reaper_stream = stream
            if self._closed.is_set():
                stream.stop()
            ended.wait()
            rev = stream.last_rev + 1
            if stream.error and "compacted" in stream.error:
                rev = self._range("")[2] + 1  # history gone: from now on
            if not self._closed.is_set():
                log.info("etcd: lease watch on %s:%s ended (%s); re-opening",
                         self.host, self.port, stream.error or "closed")
                if self._clients[self._cur] is stream.client:
                    self._cur = (self._cur + 1) % len(self._clients)

    def _on_delete(self, ev: dict) -> None:
        """A deleted marker ``<key>/.dc/<lease>``: append its value to ``<key>``, once."""
        if ev.get("type") != "DELETE":
            return
        key = _unb64(ev["kv"]["key"]).decode("utf-8", "replace")
        short = key[len(self._prefix):]
        if _MARK not in short:
            return
        base, _, lease = short.partition(_MARK)
        value = _unb64((ev.get("prev_kv") or {}).get("value", ""))
        try:
            if self._rmw_once(base, lambda old: (old or b"") + value, f"dc-{lease}")[1]:
                log.info("etcd lease %s ended; its disconnect action on %s is done",
                         lease, base)
        except StoreError as e:
            log.warning("etcd: the disconnect action of lease %s on %s failed: %s",
                        lease, base, e)

    def close(self) -> None:
        """Stops the keep-alive and the lease watch, and revokes the lease (markers vanish:
        peers see us leave)."""
        self._closed.set()
        self._lease_stop.set()
        stream = self._reaper_stream
        if stream is not None:
            stream.stop()
        lease = self._lease_id
        if lease is not None:
            try:
                self.revoke(lease)
            except StoreError:
                log.debug("lease revoke failed", exc_info=True)
