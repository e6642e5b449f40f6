"""Liveness of the fast rendezvous's members: the keep-alive counters a member bumps
(``KeepAlive``, one thread per process), the rule by which the others call it silent
(``SilenceDetector``), and what they read to apply it (``MemberWatch``,
``DeciderWatch``)."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

from fastelastic.errors import StoreError

from ._requests import Add, Append, Check, MultiGet, MultiSet, RequestGen
from ._schema import (
    LEFT_SILENT,
    PRESENT,
    RoundKeys,
    encode_gone,
    encode_number,
    host_finished,
    parse_gone,
    tickets_taken,
    who_node,
    who_parts,
)

# a child of fast_rendezvous's logger: logging configs written for that name keep working
log = logging.getLogger("fastelastic.rendezvous.fast_rendezvous.liveness")

__all__ = ["BEATER", "DeciderWatch", "KeepAlive", "MemberWatch", "SilenceDetector",
           "lost_members"]


class SilenceDetector:
    """Keep-alive counters polled now and then; says which stood still for a whole window.

    A node that froze right after a beat is called silent within that beat's window: a change
    is dated up to ``slack`` (at most half a keep-alive interval) before the poll that saw it,
    and a counter is called silent at the last poll before its window ends. A poll more than
    half a window after the previous one means this process was starved, and maybe its peers'
    keep-alives too: unchanged counters then get a fresh window, not a verdict.
    """

    def __init__(self, window: float, slack: float) -> None:
        self.window = window
        self.slack = max(0.0, min(slack, window / 4))
        self.since: dict[Any, tuple[Any, float]] = {}  # key -> (value, changed no earlier than)
        self._prev: float | None = None

    def observe(self, values: dict[Any, Any], now: float | None = None) -> dict[Any, float]:
        """Records one poll of ``values``; returns ``{key: seconds still}`` of the silent ones."""
        now = time.monotonic() if now is None else now
        # a change seen now happened at most ``gap`` ago; the next poll is taken to be as late
        gap = 0.0 if self._prev is None else min(max(0.0, now - self._prev), self.slack)
        blackout = self._prev is not None and now - self._prev > self.window / 2  # starved
        self._prev = now
        silent = {}
        for key, value in values.items():
            last = self.since.get(key)
            if last is None or blackout:
                self.since[key] = (value, now)
            elif last[0] != value:
                self.since[key] = (value, now - gap)
            elif now - last[1] >= self.window - gap:
                silent[key] = now - last[1]
        return silent


class MemberWatch:
    """What a member of a complete round reads to notice a lost peer (``lost_members``)."""

    def __init__(self, k: RoundKeys, rank: int, world: int, peer_tickets: list[bytes],
                 window: float, slack: float) -> None:
        self.k = k
        self.rank = rank
        self.peers = [(rank + i) % world for i in range(1, len(peer_tickets) + 1)]
        self.keys = [k.gone] + [k.beat(t) for t in peer_tickets]
        self.beats = SilenceDetector(window, slack)  # keyed by rank
        self.reported: set[int] = set()
        self.host_done = False  # the store's host finished (read in ``gone``)


class DeciderWatch:
    """What a ticket holder waiting for an outcome checks each quarter window: the holders of
    the deciding tickets (``min_nodes``: last call; ``max_nodes``: publish) have a record and
    a moving keep-alive counter. One request per check once their records are seen."""

    def __init__(self, cfg: Any, clock: Callable[[], float], k: RoundKeys, ticket: int) -> None:
        self.run_id, self.clock, self.k = cfg.run_id, clock, k
        self.roles = [x for x in sorted({cfg.min_nodes, cfg.max_nodes}) if x != ticket]
        self.recorded: set[int] = set()
        self.count = 0
        self.seen = SilenceDetector(cfg.window, cfg.ka_interval / 2)

    def stalled(self) -> RequestGen[bool]:
        k = self.k
        if any(role > self.count for role in self.roles):
            # sealed or not (the coordinator is publishing): the tickets taken
            self.count = tickets_taken(int((yield Add(k.tickets, 0))))
        roles = [x for x in self.roles if x <= self.count]
        states: dict[int, Any] = {}
        for role in roles:
            if role not in self.recorded:
                if not (yield Check([k.record(role)])):
                    states[role] = -1
                    continue
                self.recorded.add(role)
        known = [x for x in roles if x in self.recorded]
        if known:
            vals = yield MultiGet([k.beat(x) for x in known])
            states.update((x, bytes(v)) for x, v in zip(known, vals, strict=True))
        stalled = self.seen.observe(states, self.clock())
        for role, still in stalled.items():
            why = "no record" if states[role] == -1 else "no keep-alive"
            log.warning("rendezvous %s round %d: the node holding ticket %d (%s for %.1fs) is "
                        "lost; abandoning the round", self.run_id, k.r, role, why, still)
        return bool(stalled)


def lost_members(w: MemberWatch, cfg: Any, spare_ready: bool, clock: Callable[[], float]
                 ) -> RequestGen[list[tuple[int, str]]]:
    """Members of a round lost since the last call, as a member watching ``w`` reads them
    (one ``multi_get``; see ``FastRendezvousHandler.lost_members``)."""
    vals = [bytes(v) for v in (yield MultiGet(w.keys))]
    now = clock()
    gone = parse_gone(vals[0])
    w.host_done = w.host_done or host_finished(vals[0])
    silent = w.beats.observe(dict(zip(w.peers, vals[1:], strict=True)), now)
    if spare_ready:  # a spare can take a silent peer's seat: suspect it sooner
        silent.update((rank, now - since) for rank, (_, since) in w.beats.since.items()
                      if rank not in silent and now - since >= cfg.spare_window)
    for rank, still in silent.items():
        if rank not in gone:
            log.warning("rendezvous %s: rank %d sent no keep-alive for %.1fs; dropping it",
                        cfg.run_id, rank, still)
            yield Append(w.k.gone, encode_gone(rank, "silent"))
            yield MultiSet([w.k.left(rank), w.k.broken], [LEFT_SILENT, PRESENT])
            gone[rank] = "silent"
    fresh = [(r, why) for r, why in gone.items() if r not in w.reported and why != "done"]
    if not fresh:
        return []
    w.reported.update(r for r, _ in fresh)
    records = yield MultiGet([w.k.who(r) for r, _ in fresh])
    out = []
    for (rank, why), rec in zip(fresh, records, strict=True):
        _, addr, pid = who_parts(bytes(rec))
        stale = now - w.beats.since[rank][1] if rank in w.beats.since else 0.0
        if why == "closed":
            text = (f"cut: no keep-alive for {stale:.1f}s, then its connection timed out"
                    if stale >= 2 * cfg.ka_interval else "dead: its connection closed")
        elif why == "left":
            text = "left the round: it is re-joining"
        elif why == "quit":
            text = "left the job (preempted: SIGTERM/SIGINT)"
        elif why == "moved":
            text = "moved to another candidate (it lost the rendezvous store)"
        else:
            text = (f"silent: connected but no keep-alive for "
                    f"{cfg.spare_window if spare_ready else cfg.window:g}s (frozen "
                    f"or hung{'; a spare is ready' if spare_ready else ''})")
        # no address (a pod's default): its identity names it (hostname, pid, nonce)
        name = addr or who_node(bytes(rec)) or "?"
        who = "this node" if rank == w.rank else f"node {name} (pid {pid or '?'})"
        out.append((rank, f"{who} {text}"))
    return out


class BeatingMember(Protocol):
    """What ``KeepAlive`` needs of a member handler (``FastRendezvousHandler`` is one)."""

    @property
    def run_id(self) -> str: ...

    @property
    def keep_alive_interval(self) -> float:
        """Seconds between two bumps of its counter."""

    @property
    def detection_window(self) -> float:
        """Seconds after which the other members count a still counter as lost."""

    def beat(self, key: str, value: bytes) -> None:
        """Writes ``value`` to ``key`` without waiting (fire-and-forget).

        Raises:
            StoreError, OSError: the write did not get out.
        """


class KeepAlive:
    """One daemon thread per process bumps the keep-alive counter of every member handler.

    A bump is one ``set`` of a value never written before: fire-and-forget, so it never waits
    for a connection blocked in a wait, and one request per node per interval.

    Handlers are held weakly: one dropped without ``shutdown()`` stops beating once it is
    collected. A handler whose keep-alives have failed for its whole window is dropped too: by
    then the other members count it gone, and the thread must not retry a dead store forever.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # id(handler) -> (weak handler, next due, key, last success)
        self._due: dict[int, tuple[weakref.ref[BeatingMember], float, str, float]] = {}
        self._thread: threading.Thread | None = None
        self._beats = itertools.count(1)  # a keep-alive writes a value never written before

    def add(self, handler: BeatingMember, key: str) -> None:
        now = time.monotonic()
        with self._cond:
            self._due[id(handler)] = (weakref.ref(handler), now + handler.keep_alive_interval,
                                      key, now)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fe-rdzv-keepalive",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def remove(self, handler: BeatingMember) -> None:
        with self._cond:
            self._due.pop(id(handler), None)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._due:
                    self._thread = None
                    return
                now = time.monotonic()
                hid, (ref, when, key, last_ok) = min(self._due.items(), key=lambda kv: kv[1][1])
                handler = ref()
                if handler is None:
                    del self._due[hid]
                    continue
                if when > now:
                    del handler
                    self._cond.wait(when - now)
                    continue
                self._due[hid] = (ref, now + handler.keep_alive_interval, key, last_ok)
            beat = next(self._beats)
            try:  # outside the lock: a slow store must not block add/remove
                handler.beat(key, encode_number(beat))
                ok = True
            except (StoreError, OSError) as e:
                ok = False
                if getattr(handler, "store_host_finished", False):  # the job ended there
                    self.remove(handler)
                    del handler
                    continue
                log.warning("rendezvous %s: keep-alive %s failed: %s", handler.run_id, key, e)
            with self._cond:
                entry = self._due.get(hid)
                if entry is not None and entry[0] is ref:
                    done = time.monotonic()
                    if ok:
                        self._due[hid] = (ref, entry[1], key, done)
                    elif done - entry[3] > handler.detection_window:
                        del self._due[hid]
                        log.warning(
                            "rendezvous %s: no keep-alive got through for %.1fs (the others "
                            "count this node gone); stopping them", handler.run_id,
                            done - entry[3])
            del handler


BEATER = KeepAlive()
