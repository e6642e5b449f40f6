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
import socket
import threading
import time
from collections.abc import Callable, Generator
from datetime import timedelta
from typing import Any, Protocol, TypeVar

from fastelastic.errors import RendezvousConnectionError, StoreError, StoreTimeoutError

from ...utils import _matches_machine_hostname, parse_rendezvous_endpoint
from .. import _requests as rq
from .. import _store_ops as ops
from .._schema import RunKeys
from . import _hops as hops
from ._hops import (  # noqa: F401 (the failover's names, as callers and tests know them)
    NO_WORLD_RULE,
    Adopt,
    AppendStandby,
    CloseStore,
    Count,
    FailoverContext,
    Fenced,
    GoBack,
    HostStandby,
    JoinRound,
    LiveStore,
    MovingList,
    OnStandby,
    Pause,
    Probe,
    ReadMoving,
    Regroup,
    Settle,
    Where,
    prove_gone,
)
from ._start import HostedStandby, host_standby, keep_syncing, start

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


def _append(key: str, value: bytes) -> rq.RequestGen[None]:
    yield rq.Append(key, value)


class _Stopped(Exception):
    """The host stopped an operation during a pause (``Candidates.run``'s ``stop``)."""


class _AsIs(Exception):  # noqa: N818 (a carrier, not an error of its own)
    """Carries an error that ``Candidates.run`` throws into the operation unchanged."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class _Out(_AsIs):
    """Carries an error that ends the operation unchanged (``Candidates.run`` raises it)."""


class Host(Protocol):
    """What an operation of :mod:`._hops` changes on the node that runs it (the handler)."""

    _store: Any

    def _do(self, store: Any, op: Any) -> Any: ...
    def _switch(self, client: Any, live: LiveStore) -> None: ...
    def _close_store(self, live: LiveStore) -> None: ...
    def _join_round(self) -> Any: ...
    def _where(self) -> LiveStore | None: ...
    def _settle(self, live: LiveStore) -> None: ...


class _Taker:
    """The host of an operation run without a handler: it keeps the adopted connection."""

    _store: Any = None
    client: Any = None

    def _do(self, store: Any, op: Any) -> Any:
        raise rq.unknown(op)

    def _switch(self, client: Any, live: LiveStore) -> None:
        self.client = client

    def _close_store(self, live: LiveStore) -> None:
        raise AssertionError("no store to close")

    def _join_round(self) -> Any:
        raise AssertionError("no round to join")

    def _where(self) -> LiveStore | None:
        raise AssertionError("nowhere yet")

    def _settle(self, live: LiveStore) -> None:
        raise AssertionError("nowhere yet")


class Candidates:
    """The candidates, this node's standby store, and the runner of the failover's
    operations (:mod:`._hops`) on them."""

    def __init__(self, run_id: str, endpoints: list[tuple[str, int]], is_host: bool | None,
                 read_timeout: timedelta, token: bytes | None = None) -> None:
        self.endpoints = endpoints
        self.read_timeout = read_timeout
        self.token = token
        self.plan = FailoverContext([f"{h}:{p}" for h, p in endpoints], RunKeys(run_id),
                                    read_timeout.total_seconds(), run_id)
        self.standby: Any = None  # the store this node hosts, if it owns a candidate
        self.standby_index = -1
        self._closing = threading.Event()
        self._syncer: threading.Thread | None = None
        mine = [] if is_host is False else [
            i for i, (host, _) in enumerate(endpoints) if is_host or _is_mine(host)]
        if mine:
            hosted = self.run(host_standby(self.plan, mine))
            if hosted is not None and not hosted.synced:
                self._syncer = threading.Thread(target=self._sync_until_done, args=(hosted,),
                                                daemon=True, name="fastelastic-candidate-sync")
                self._syncer.start()

    def _sync_until_done(self, standby: HostedStandby) -> None:
        """:func:`._start.keep_syncing` in the syncer thread, until the standby closes."""
        try:
            self.run(keep_syncing(self.plan, standby.index, standby.nonce), stop=self._closing)
        except _Stopped:
            pass
        except Exception as e:  # noqa: BLE001 (a daemon thread: log)
            log.debug("candidate sync: %s", e)

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

    def run(self, gen: Generator[Any, Any, T], host: Host | None = None,
            stop: threading.Event | None = None) -> T:
        """Runs one of :mod:`._hops`' operations: the failover's requests on the candidates
        (each probe's connection kept for ``Adopt`` until the next probe of that
        candidate; the rest closed at the end), the machine's store requests on ``host``'s
        store. A request that fails as a connection error is thrown into the operation.
        ``stop`` set during a ``Pause`` ends it (raises ``_Stopped``)."""
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
                    reply = self._hop(op, conns, host, stop)
                except _Out as e:
                    raise e.error from None
                except _AsIs as e:
                    error = e.error
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

    def _hop(self, op: Any, conns: dict[int, Any], host: Host | None,
             stop: threading.Event | None = None) -> Any:
        match op:
            case Probe(i, key, quick):
                old = conns.pop(i, None)
                if old is not None:
                    old.close()
                if quick:  # a start's look: a silent candidate gets PRE_PROBE_S
                    listens = self._listens(i, PRE_PROBE_S)
                    if listens is not True:
                        return listens or f"{self.name(i)}: connection refused"
                return self._probe(i, key, conns)
            case Count(i, key):
                return self._read(conns, i, lambda c: int(c.add(key, 0)))
            case ReadMoving(i):
                k = self.plan.keys.moving
                return self._read(conns, i, lambda c: bytes(c.get(k)) if c.check([k]) else b"")
            case MovingList(i, entry):
                return self._marks(i, entry)
            case Pause(seconds):
                if stop is None:
                    time.sleep(seconds)
                elif stop.wait(seconds):
                    raise _Stopped
                return None
            case HostStandby(mine):
                return self._host(mine)
            case AppendStandby(entry):
                self._append_standby(entry)
                return None
            case OnStandby(request, what):
                try:
                    return ops.apply(self.standby, request)
                except (StoreError, OSError) as e:
                    log.warning("could not %s, on the standby store at %s: %s", what,
                                self.name(self.standby_index), e)
                    return None
            case JoinRound():  # its failures as the join raised them: none rewritten
                assert host is not None
                try:
                    return host._join_round()
                except (RendezvousConnectionError, StoreTimeoutError) as e:
                    raise _AsIs(e) from e  # thrown into the operation
                except (StoreError, OSError) as e:
                    raise _Out(e) from e  # ends it
            case Where():
                assert host is not None
                return host._where()
            case Settle(live):
                assert host is not None
                host._settle(live)
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

    def _read(self, conns: dict[int, Any], i: int, read: Callable[[Any], T]) -> T | None:
        """``read`` on the connection of candidate ``i``'s last probe; None without one, or
        when the read fails."""
        c = conns.get(i)
        if c is None:
            return None
        try:
            return read(c)
        except (StoreError, OSError) as e:
            log.debug("could not read %s: %s", self.name(i), e)
            return None

    def _host(self, mine: tuple[int, ...]) -> int:
        """Hosts the standby on the first of ``mine`` that no other process hosts: its index,
        or -1."""
        from fastelastic.store import TCPStore

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
            return i
        return -1

    def _append_standby(self, entry: bytes) -> None:
        """Appends ``entry`` to the standby's ``moving`` list: from the syncer thread on a
        client of its own (not the host's), else on the host's (a failure only logged)."""
        key = self.plan.keys.moving
        if threading.current_thread() is self._syncer:
            from fastelastic.store import TCPStore

            host, port = self.endpoints[self.standby_index]
            c = TCPStore(host, port, timeout=timedelta(seconds=PROBE_S), token=self.token)
            try:
                c.append(key, entry)
            finally:
                c.close()
        else:
            self._on_standby(_append(key, entry), "append to its moving list")

    def _take(self, gen: hops.FailoverOp[T], where: Callable[[T], int]) -> tuple[Any, T]:
        """Runs ``gen`` with no handler, then hands over the connection to the candidate
        ``where`` picks from its answer: (client, answer)."""
        taker = _Taker()

        def take() -> hops.FailoverOp[T]:
            out = yield from gen
            yield Adopt(LiveStore(where(out)))
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
        gen = hops.connect(self.plan, exclude, at_least, world) if exclude >= 0 else start(
            self.plan, self.standby_index if self.standby is not None else -1, at_least, world)
        client, (i, epoch, proposed) = self._take(gen, lambda out: out[0])
        return client, i, epoch, proposed

    def check(self, live: LiveStore) -> None:
        """:func:`._hops.check` on the real candidates."""
        self.run(hops.check(self.plan, live))

    def regroup(self, live: LiveStore, j: int, world: bytes = b"") -> tuple[Any, LiveStore]:
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
