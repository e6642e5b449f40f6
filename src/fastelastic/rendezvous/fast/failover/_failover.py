"""A rendezvous store that outlives its host: the candidate endpoints of ``--rdzv-endpoint
h1:p1,h2:p2,...``, a standby store on this node's candidate, and the choice of the live one.

Every node that owns a candidate (its host is this machine; at most one candidate per node)
hosts a store on it from the start, empty. All nodes meet on the live store: the reachable
candidate with the highest ``epoch`` key, the first in the list among equals. When the live
store's host is lost, the survivors move to the next one, raise its ``epoch`` past the old
one's, and join there afresh (the rendezvous state is soft: the members re-create it). A node
started later probes the candidates the same way and finds where the others went. What keeps
the two sides of a partition from both training is the majority rule of ``_round.Machine.moved``.

The rules of every move are :mod:`._hops`' operations; this module runs them on the real
stores (:meth:`Candidates.run`), as the tests' simulation runs them on simulated ones.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from fastelastic.errors import RendezvousConnectionError, StoreError

from ...utils import _matches_machine_hostname, parse_rendezvous_endpoint
from .. import _requests as rq
from .. import _store_ops as ops
from .._schema import Keys, encode_started, encode_synced
from . import _hops as hops
from ._hops import (  # noqa: F401 (the failover's names, as callers and tests know them)
    NO_WORLD_RULE,
    Adopt,
    CloseStore,
    Fenced,
    GoBack,
    Live,
    Marks,
    Pause,
    Plan,
    Probe,
    Regroup,
    prove_gone,
)

T = TypeVar("T")
# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.failover")


def _is_mine(host: str) -> bool:
    """Whether ``host`` is an address of this node (of its network namespace): a literal
    address is tried with a bind, which no lookup can get wrong; a name is looked up."""
    try:
        addr = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return _matches_machine_hostname(host)
    with socket.socket(socket.AF_INET6 if addr.version == 6 else socket.AF_INET) as s:
        try:
            s.bind((str(addr), 0))
            return True
        except OSError:
            return False


PROBE_S = 2.0  # seconds a candidate has to accept and answer a probe
SYNC_RETRY_S = 0.5  # seconds between a standby's attempts to copy the others' lists
SYNC_WARN_S = 60.0  # a standby not synced this long says so
PRE_PROBE_S = 0.5  # seconds a silent candidate gets before a node hosts its standby
QUICK_S = 0.2  # each plain connect of a probe: what refuses is told at once, a heal seen soon


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


def _append(key: str, value: bytes) -> rq.Proto[None]:
    yield rq.Append(key, value)


class Host(Protocol):
    """What an operation of :mod:`._hops` changes on the node that runs it (the handler)."""

    _store: Any

    def _do(self, store: Any, op: Any) -> Any: ...
    def _switch(self, client: Any, live: Live) -> None: ...
    def _close_store(self, live: Live) -> None: ...


class _Taker:
    """The host of an operation run without a handler: it keeps the adopted connection."""

    _store: Any = None
    client: Any = None

    def _do(self, store: Any, op: Any) -> Any:
        raise rq.unknown(op)

    def _switch(self, client: Any, live: Live) -> None:
        self.client = client

    def _close_store(self, live: Live) -> None:
        raise AssertionError("no store to close")


class Candidates:
    """The candidates, this node's standby store, and the runner of the failover's
    operations (:mod:`._hops`) on them."""

    def __init__(self, run_id: str, endpoints: list[tuple[str, int]], is_host: bool | None,
                 read_timeout: timedelta, token: bytes | None = None) -> None:
        self.endpoints = endpoints
        self.read_timeout = read_timeout
        self.token = token
        self.plan = Plan([f"{h}:{p}" for h, p in endpoints], Keys(run_id),
                         read_timeout.total_seconds(), run_id)
        self.standby: Any = None  # the store this node hosts, if it owns a candidate
        self.standby_index = -1
        self._nonce = b""  # the standby's incarnation (``_schema.encode_started``)
        self._closing = threading.Event()
        self._syncer: threading.Thread | None = None
        mine = [] if is_host is False else [
            i for i, (host, _) in enumerate(endpoints) if is_host or _is_mine(host)]
        if mine:
            self._host(mine)

    def _host(self, mine: list[int]) -> None:
        """Hosts the standby on the first of the candidates ``mine`` (this machine's) that
        no other process hosts. The candidates are asked first (:meth:`_read_others`): a
        committed epoch there means this host restarted after the rendezvous moved away, and
        its store, empty, is marked ``behind`` it (:func:`._hops.behind`). The store's first
        entry says it does not count toward the failover's quorums until it is synced
        (:meth:`_sync`): only a request in the microseconds between the server's start and
        that entry sees it unmarked."""
        from fastelastic.store import TCPStore

        found, lists, fresh = self._read_others()
        for i in mine:
            host, port = self.endpoints[i]
            try:
                self.standby = TCPStore(host, port, is_master=True, multi_tenant=True,
                                        wait_for_workers=False, timeout=self.read_timeout,
                                        token=self.token)
            except (StoreError, OSError) as e:  # hosted by another node of this machine
                log.debug("candidate %s:%d already hosted (%s)", host, port, e)
                continue
            self.standby_index = i
            others = {j: raw for j, raw in lists.items() if j != i}
            if not hops.may_have_lost_state(found is not None, list(others.values()),
                                            others.get(0), fresh):
                return  # a job's start: nothing to copy, the store counts at once
            self._nonce = os.urandom(8).hex().encode()
            self._on_standby(_append(self.plan.keys.moving, encode_started(self._nonce)),
                             "mark it as not synced")
            if found is not None:
                self._behind(*found)
            if not self._sync(others, fresh and i != 0):
                self._syncer = threading.Thread(target=self._sync_until_done, daemon=True,
                                                name="fastelastic-candidate-sync")
                self._syncer.start()
            return

    def _read_others(self, skip: int = -1) -> tuple[tuple[int, int] | None,
                                                    dict[int, bytes | None], bool]:
        """(index, epoch) of the answering candidate with the highest committed epoch, if any
        is above 0; each candidate's ``moving`` list (None: no answer) but ``skip``'s; and
        whether the first candidate answered and shows no world formed yet
        (:func:`._hops.no_world_yet`).
        Quick, so a job's start does not wait for it: a refused connection (nothing listens
        there yet, such as this node's own candidate) answers at once, a silent host gets
        ``PRE_PROBE_S``. The start's ``connect`` looks again, and marks the standby then."""
        best: tuple[int, int] | None = None
        lists: dict[int, bytes | None] = {}
        fresh = False
        for i in range(len(self.endpoints)):
            if i == skip:
                continue
            lists[i] = None
            if self._listens(i, PRE_PROBE_S) is not True:
                continue
            conns: dict[int, Any] = {}
            epoch = self._probe(i, self.plan.keys.epoch, conns)
            c, key = conns.get(i), self.plan.keys.moving
            try:
                if c is not None:
                    lists[i] = bytes(c.get(key)) if c.check([key]) else b""
                    if i == 0 and isinstance(epoch, int):
                        fresh = hops.no_world_yet(epoch, int(c.add(self.plan.keys.open, 0)),
                                                  lists[i] or b"")
            except (StoreError, OSError) as e:
                log.debug("could not read %s's moving list: %s", self.name(i), e)
            finally:
                if c is not None:
                    c.close()
            if isinstance(epoch, int) and epoch > (best[1] if best else 0):
                best = (i, epoch)
        return best, lists, fresh

    def _sync(self, lists: dict[int, bytes | None], no_world_yet: bool = False) -> bool:
        """Appends to the standby what :func:`._hops.sync_entries` makes of the other
        candidates' ``lists``, with the entry that makes it count; False while too few of
        them answered."""
        entries = hops.sync_entries(list(lists.values()), len(self.endpoints), no_world_yet)
        if entries is None:
            return False
        entry = entries + encode_synced(self._nonce)
        if threading.current_thread() is self._syncer:  # a client of its own, not the host's
            from fastelastic.store import TCPStore

            host, port = self.endpoints[self.standby_index]
            c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
            try:
                c.append(self.plan.keys.moving, entry)
            finally:
                c.close()
        else:
            self._on_standby(_append(self.plan.keys.moving, entry),
                             "copy the other candidates' marks to it")
        log.debug("candidate %s synced from the others", self.name(self.standby_index))
        return True

    def _sync_until_done(self) -> None:
        """:meth:`_sync`, every ``SYNC_RETRY_S`` until it is done or the standby closes (at a
        job's start the other candidates' hosts start about when this one does)."""
        waited = 0.0
        while not self._closing.wait(SYNC_RETRY_S):
            waited += SYNC_RETRY_S
            try:
                _, lists, fresh = self._read_others(self.standby_index)
                if self._sync(lists, fresh and self.standby_index != 0):
                    return
            except Exception as e:  # noqa: BLE001 (a daemon thread: log, try again)
                log.debug("candidate sync: %s", e)
            if waited >= SYNC_WARN_S and waited - SYNC_RETRY_S < SYNC_WARN_S:
                log.warning(
                    "the rendezvous candidate %s hosted here has not read the other "
                    "candidates' lists after %.0fs: it does not count toward the failover's "
                    "quorums until it does (it waits for every other candidate, or a "
                    "majority of them synced)", self.name(self.standby_index), waited)

    def _listens(self, i: int, timeout: float) -> bool | str:
        """Whether candidate ``i`` accepts a connection: False when it is refused (nothing
        listens there: at once, where a store client retries until its timeout), why when it
        does not answer within ``timeout``. A silent host gets a fresh connect every
        ``QUICK_S``: a link that heals meanwhile is seen within ``QUICK_S``, where one connect
        waits for the kernel's SYN retransmission (1 s after the first SYN, then 3 s)."""
        end = time.monotonic() + timeout
        for _ in range(1_000_000):  # bounded by ``end``
            left = end - time.monotonic()
            try:
                socket.create_connection(self.endpoints[i], timeout=max(min(QUICK_S, left),
                                                                        0.01)).close()
            except ConnectionRefusedError:
                return False
            except TimeoutError as e:
                if left > QUICK_S:
                    continue
                return f"{self.name(i)} did not answer ({e})"
            except OSError as e:
                return f"{self.name(i)} did not answer ({e})"
            return True
        return f"{self.name(i)} did not answer within {timeout:g}s"

    def _behind(self, i: int, epoch: int) -> None:
        """:func:`._hops.behind` on the standby."""
        self._on_standby(hops.behind(self.plan, self.standby_index, i, epoch),
                         f"mark it as behind epoch {epoch}")

    def _on_standby(self, gen: Any, what: str) -> None:
        """Runs ``gen``'s requests on the standby; a failure is only logged (each narrows a
        hole that the standby's first microseconds leave open anyway)."""
        try:
            ops.run_all(self.standby, gen)
        except (StoreError, OSError) as e:
            log.warning("could not %s, on the standby store at %s: %s", what,
                        self.name(self.standby_index), e)

    def name(self, i: int) -> str:
        return self.plan.name(i)

    # ------------------------------------------------------------------ running operations

    def run(self, gen: Generator[Any, Any, T], host: Host | None = None) -> T:
        """Runs one of :mod:`._hops`' operations: the failover's requests on the candidates
        (each probe's connection kept for ``Adopt`` until the next probe of that
        candidate; the rest closed at the end), the machine's store requests on ``host``'s
        store. A request that fails as a connection error is thrown into the operation."""
        conns: dict[int, Any] = {}
        reply: Any = None
        error: BaseException | None = None
        try:
            for _ in range(1_000_000):  # an operation's requests; bounded by its own clock
                try:
                    op = gen.send(reply) if error is None else gen.throw(error)
                except StopIteration as e:
                    return e.value  # type: ignore[no-any-return]
                reply, error = None, None
                try:
                    reply = self._hop(op, conns, host)
                except (StoreError, OSError, RendezvousConnectionError) as e:
                    error = e if isinstance(e, RendezvousConnectionError) else (
                        RendezvousConnectionError(f"{self._where(op)}: {e}"))
            raise AssertionError("a failover operation that never ends")
        finally:
            gen.close()
            for c in conns.values():
                with contextlib.suppress(Exception):
                    c.close()

    def _where(self, op: Any) -> str:
        i = getattr(op, "index", -1)
        return self.name(i) if i >= 0 else "the rendezvous store"

    def _hop(self, op: Any, conns: dict[int, Any], host: Host | None) -> Any:
        match op:
            case Probe(i, key):
                old = conns.pop(i, None)
                if old is not None:
                    old.close()
                return self._probe(i, key, conns)
            case Marks(i, entry):
                return self._marks(i, entry)
            case Pause(seconds):
                time.sleep(seconds)
                return None
            case Adopt(live):
                assert host is not None
                client = conns.pop(live.index)
                client.set_timeout(self.read_timeout)
                host._switch(client, live)
                return None
            case CloseStore(live):
                assert host is not None
                host._close_store(live)
                return None
            case _:  # the machine's store requests, on the node's store
                assert host is not None, op
                return host._do(host._store, op)

    def _probe(self, i: int, key: str, conns: dict[int, Any]) -> int | str:
        """Candidate ``i``'s counter ``key`` (its connection kept in ``conns``), or why not. A
        refused connection answers at once: a store client retries it until its timeout, and
        a start or a move probes every candidate, so each whose host is lost or not up yet
        cost ``PROBE_S`` (4 s for a rack's replacements with two candidates' hosts lost)."""
        from fastelastic.store import TCPStore

        host, port = self.endpoints[i]
        t0 = time.monotonic()
        listens = self._listens(i, PROBE_S)  # a fresh connect every QUICK_S (see _listens)
        if listens is False:
            return f"{host}:{port}: connection refused"
        if listens is not True:
            return f"{host}:{port}: {listens}"
        # it accepts: the store client (its connect, handshake and request), at least QUICK_S
        left = max(PROBE_S - (time.monotonic() - t0), QUICK_S)
        try:
            c = TCPStore(host, port, timeout=timedelta(seconds=left), token=self.token)
        except (StoreError, OSError) as e:
            return f"{host}:{port}: {e}"
        try:
            value = int(c.add(key, 0))
        except (StoreError, OSError) as e:
            c.close()
            return f"{host}:{port}: {e}"
        conns[i] = c
        return value

    def _take(self, gen: hops.Ops[T], where: Callable[[T], int]) -> tuple[Any, T]:
        """Runs ``gen`` with no handler, then hands over the connection to the candidate
        ``where`` picks from its answer: (client, answer)."""
        taker = _Taker()

        def take() -> hops.Ops[T]:
            out = yield from gen
            yield Adopt(Live(where(out)))
            return out
        out = self.run(take(), taker)
        return taker.client, out

    # ------------------------------------------------------------------ for callers and tests

    def connect(self, exclude: int = -1, at_least: int = 0,
                world: bytes = b"") -> tuple[Any, int, int, int]:
        """:func:`._hops.connect` on the real candidates: (client, candidate index, its
        committed epoch, the epoch this node proposes there or 0).

        Raises:
            RendezvousConnectionError: No candidate answered (see :func:`._hops.connect`).
            Fenced: ``world`` declared this node gone before its mark reached the candidate.
        """
        client, (i, epoch, proposed) = self._take(
            hops.connect(self.plan, exclude, at_least, world), lambda out: out[0])
        if exclude < 0 and self.standby is not None:  # a start: is this node's store behind?
            self._behind(i, epoch)
        return client, i, epoch, proposed

    def check(self, live: Live) -> None:
        """:func:`._hops.check` on the real candidates."""
        self.run(hops.check(self.plan, live))

    def regroup(self, live: Live, j: int, world: bytes = b"") -> tuple[Any, Live]:
        """:func:`._hops.regroup_to` on the real candidates: (client, where it is now)."""
        return self._take(hops.regroup_to(self.plan, live, j, world), lambda new: new.index)

    def gone_elsewhere(self, index: int, idents: list[str], world: bytes = b"") -> str:
        """:func:`._hops.prove_gone` on the real candidates."""
        return self.run(prove_gone(self.plan.names, index, idents, world))

    def _marks(self, i: int, entry: bytes) -> bytes | str | None:
        """Candidate ``i``'s ``moving`` list, after appending ``entry`` (if any); None when it
        refuses the connection; why, when it does not answer."""
        from fastelastic.store import TCPStore

        listens = self._listens(i, PROBE_S)
        if listens is not True:
            return None if listens is False else listens
        host, port = self.endpoints[i]
        try:
            c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
            try:
                key = self.plan.keys.moving
                if entry:
                    c.append(key, entry)
                return bytes(c.get(key)) if c.check([key]) else b""
            finally:
                c.close()
        except (StoreError, OSError) as e:
            return f"{self.name(i)} did not answer ({e})"

    def close(self) -> None:
        self._closing.set()
        if self.standby is not None:
            standby, self.standby = self.standby, None
            standby.close()
