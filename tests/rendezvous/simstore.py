"""A simulated store, clock and set of nodes that run the rendezvous machine (``_round``).

No sockets, no threads: every node is a generator of store requests (its agent's loop
around ``Machine.join``); a request that waits blocks the node until its keys are set or its
deadline passes on the simulated clock, which jumps to the next deadline, keep-alive or
scripted event (kill, freeze, cut, close) whenever no node can run. So a scenario at torch's
default timeouts (30 s last call, 600 s join) runs in milliseconds, and the same scenario
always runs the same way.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from fastelastic.errors import RendezvousConnectionError, RendezvousError
from fastelastic.rendezvous.fast import _requests as rq
from fastelastic.rendezvous.fast import _schema as sc
from fastelastic.rendezvous.fast._round import Config, Machine, Seat
from fastelastic.rendezvous.fast._schema import Membership

MAX_STEPS = 2_000_000
LOCAL = ("beat", "stop_beats", "sleep", "moved_elsewhere", "gone_elsewhere")  # not the store


@dataclass(frozen=True, slots=True)
class Sleep:
    """The simulated agent's own request (not the machine's): ``seconds`` on the clock."""

    name: ClassVar[str] = "sleep"
    seconds: float


class SimClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@dataclass
class Node:
    id: int
    m: Machine
    node_rank: int = -1
    gen: Generator[Any, Any, Any] | None = None
    reply: Any = None
    blocked: tuple[str, list[str], float] | None = None  # (kind, keys, deadline)
    alive: bool = True
    frozen: bool = False
    beat_key: str | None = None
    next_beat: float = 0.0
    on_disconnect: list[tuple[str, bytes]] = field(default_factory=list)
    seats: list[tuple[float, Seat]] = field(default_factory=list)  # (when, seat)
    paths: list[list[Any]] = field(default_factory=list)  # the phases that led to each seat
    error_at: float = -1.0
    restarts: int = 0
    error: BaseException | None = None
    lost_seen: list[list[tuple[int, str]]] = field(default_factory=list)
    addr: str | None = None  # its --local-addr (None: 10.0.0.<id>; "": none, as a pod)
    requests: Counter[str] = field(default_factory=Counter)
    join_requests: list[int] = field(default_factory=list)  # store requests of each join


class Sim:
    """Nodes, one store and one clock. ``check`` is the agents' membership check interval."""

    def __init__(self, min_nodes: int, max_nodes: int, check: float | None = None,
                 **cfg: Any) -> None:
        self.clock = SimClock()
        self.cfg = Config("sim", min_nodes, max_nodes, **cfg)
        self.check = self.cfg.ka_interval if check is None else check
        self.data: dict[str, bytes] = {}
        self.nodes: list[Node] = []
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._beat = itertools.count(1)
        self.moved_on = False  # another candidate has a higher epoch (``moved_elsewhere``)
        # what the other candidates say of members whose connection closed (``gone_elsewhere``):
        # "" proves them gone (all refuse or have no mark of them); by default one is silent
        self.elsewhere = "a candidate did not answer (timed out)"
        self.writes: list[tuple[float, str, list[str]]] = []  # (when, request, keys written)

    # ------------------------------------------------------------------ scripting

    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def start(self, t: float = 0.0, node_rank: int = -1, moved_from: int = 0,
              proposed: int = 0) -> Node:
        """A node whose agent starts at ``t``: joins, trains, re-joins when a member is
        lost or a node waits, until the rendezvous closes. ``moved_from``: it was a member
        of a world of that size on a store that was lost (this store is the successor);
        ``proposed``: the epoch it proposes here (its move is committed by a round here)."""
        node = Node(len(self.nodes), Machine(self.cfg, self.clock), node_rank)
        if moved_from or proposed:
            node.m.moved(proposed, Membership(0, node_rank, moved_from) if moved_from else None)
        self.nodes.append(node)
        self.at(t, lambda: self._launch(node))
        return node

    def kill(self, t: float, node: Node) -> None:
        """SIGKILL: the process is gone and the server sees its connection close."""
        self.at(t, lambda: self._kill(node))

    def freeze(self, t: float, node: Node, until: float | None = None) -> None:
        """SIGSTOP (connected, silent); SIGCONT at ``until``."""
        def stop() -> None:
            node.frozen = True
        self.at(t, stop)
        if until is not None:
            def cont() -> None:
                node.frozen = False
                node.next_beat = min(node.next_beat, self.clock.t)
            self.at(until, cont)

    def cut(self, t: float, node: Node, closes_after: float) -> None:
        """A cut link: silent at once; the server's TCP keep-alive closes it later."""
        self.freeze(t, node)
        self.kill(t + closes_after, node)

    def close(self, t: float, node: Node) -> None:
        """``node``'s agent finishes: marks done and closes the rendezvous (its shutdown)."""
        def fin() -> None:
            self.call(node, node.m.mark_done())
            self.call(node, node.m.set_closed())
            self._stop(node)
        self.at(t, fin)

    def quit(self, node: Node) -> None:
        """SIGTERM: the agent stops and tells its round it leaves for good (its ``leave()``)."""
        self._stop(node)
        self.call(node, node.m.leave(for_good=True))

    def call(self, node: Node, gen: rq.RequestGen[Any]) -> Any:
        """Runs an operation that never waits (set_closed, leave, ...) at once."""
        reply = None
        for _ in range(10_000):
            try:
                op = gen.send(reply)
            except StopIteration as e:
                return e.value
            kind, value = self._apply(node, op)
            assert kind == "now", f"{op.name} blocks; call() runs only non-blocking requests"
            reply = value
        raise AssertionError("an operation that never ends")

    # ------------------------------------------------------------------ what happened

    def rounds(self) -> list[tuple[int, int, float]]:
        """Complete rounds: (round, world, when the first member got its seat)."""
        first: dict[int, tuple[int, float]] = {}
        for n in self.nodes:
            for t, s in n.seats:
                if s.round not in first or t < first[s.round][1]:
                    first[s.round] = (s.world, t)
        return [(r, w, t) for r, (w, t) in sorted(first.items())]

    def worlds(self) -> list[int]:
        return [w for _, w, _ in self.rounds()]

    # ------------------------------------------------------------------ running

    def run(self, until: float) -> None:
        for _ in range(MAX_STEPS):
            for n in self.nodes:
                if n.blocked is not None and n.alive and not n.frozen:
                    self._unblock(n)
            runnable = [n for n in self.nodes if n.gen is not None and n.alive
                        and not n.frozen and n.blocked is None]
            for n in runnable:
                self._step(n)
            if runnable:
                continue
            t = self._next_time()
            if t is None or t > until:
                self.clock.t = max(self.clock.t, until)
                return
            self.clock.t = max(self.clock.t, t)
            self._fire()
        raise AssertionError("the simulation did not settle")

    def _agent(self, node: Node) -> Generator[rq.Request | Sleep, Any, None]:
        m = node.m
        addr = f"10.0.0.{node.id}" if node.addr is None else node.addr
        while True:
            seat = yield from m.join(node.node_rank, addr, 1000 + node.id, b"%s:%d" % (
                addr.encode(), 29500 + node.id), sc.node_id(f"h{node.id}", 1000 + node.id,
                                                            node.id))
            node.seats.append((self.clock.t, seat))
            node.paths.append([p.name for p in m.path])
            node.join_requests.append(sum(v for k, v in node.requests.items()
                                          if k not in LOCAL) - sum(node.join_requests))
            while True:  # training: the agent's membership checks
                yield Sleep(self.check)
                lost = yield from m.lost_members()
                waiting = yield from m.num_nodes_waiting()
                if lost:
                    node.lost_seen.append(lost)
                if lost or waiting:
                    node.restarts += 1
                    break

    def _launch(self, node: Node) -> None:
        node.gen = self._agent(node)
        node.reply = None

    def _stop(self, node: Node) -> None:
        if node.gen is not None:
            node.gen.close()
        node.gen, node.blocked, node.beat_key = None, None, None

    def _kill(self, node: Node) -> None:
        self._stop(node)
        node.alive = False
        for key, value in node.on_disconnect:
            self.data[key] = self.data.get(key, b"") + value

    def _step(self, node: Node) -> None:
        assert node.gen is not None
        try:
            op = node.gen.send(node.reply)
            kind, value = self._apply(node, op)  # the I/O layer may raise too
        except StopIteration:
            self._stop(node)
            return
        except RendezvousError as e:
            node.error, node.error_at = e, self.clock.t
            self._stop(node)
            return
        node.reply = value
        if kind == "block":
            node.blocked = value
            node.reply = None
            self._unblock(node)

    def _apply(self, node: Node, op: Any) -> tuple[str, Any]:
        d, now = self.data, self.clock.t
        node.requests[getattr(op, "name", "?")] += 1
        match op:  # the most frequent first (a match tries its cases in order)
            case rq.Get(key, timeout):
                return "block", ("get", [key], now + (300.0 if timeout is None else timeout))
            case rq.Add(key, amount):
                if amount:
                    self.writes.append((now, op.name, [key]))
                v = int(d.get(key, b"0")) + amount
                d[key] = b"%d" % v
                return "now", v
            case rq.MultiGet(keys):
                missing = [k for k in keys if k not in d]
                assert not missing, f"multi_get of missing keys {missing[:3]}"
                return "now", [d[k] for k in keys]
            case Sleep(seconds):
                return "block", ("sleep", [], now + seconds)
            case rq.Wait(keys, timeout):
                return "block", ("wait", list(keys), now + timeout)
            case rq.MultiSet(keys, values):
                self.writes.append((now, op.name, list(keys)))
                for k, v in zip(keys, values, strict=True):
                    d[k] = bytes(v)
                return "now", None
            case rq.AppendOnDisconnect(key, value):
                node.on_disconnect.append((key, bytes(value)))
                return "now", None
            case rq.Beat(key):
                node.beat_key, node.next_beat = key, now + self.cfg.ka_interval
                return "now", None
            case rq.StopBeats():
                node.beat_key = None
                return "now", None
            case rq.CompareSet(key, expected, desired):
                cur = d.get(key)
                if (cur is None and expected == "") or cur == expected:
                    d[key] = bytes(desired)
                return "now", d[key]
            case rq.OnDisconnect(keys, values):
                node.on_disconnect += [(k, bytes(v)) for k, v in zip(keys, values, strict=True)]
                return "now", None
            case rq.Append(key, value):
                self.writes.append((now, op.name, [key]))
                d[key] = d.get(key, b"") + bytes(value)
                return "now", None
            case rq.Set(key, value):
                self.writes.append((now, op.name, [key]))
                d[key] = bytes(value)
                return "now", None
            case rq.Check(keys):
                return "now", all(k in d for k in keys)
            case rq.GoneElsewhere():
                return "now", self.elsewhere
            case rq.MovedElsewhere():
                if self.moved_on:  # the real handler moves there (``_failover``); here: its cue
                    raise RendezvousConnectionError("the rendezvous moved on")
                return "now", None
            case _:
                raise rq.unknown(op)

    def _unblock(self, node: Node) -> None:
        """Wakes ``node`` if what it waits for is there, or its deadline passed."""
        assert node.blocked is not None
        kind, keys, deadline = node.blocked
        ready = kind != "sleep" and all(k in self.data for k in keys)
        if ready:
            node.reply = self.data[keys[0]] if kind == "get" else True
        elif self.clock.t >= deadline:
            node.reply = None if kind == "get" else False
        else:
            return
        node.blocked = None

    def _next_time(self) -> float | None:
        times = [n.blocked[2] for n in self.nodes
                 if n.blocked is not None and n.alive and not n.frozen]
        times += [n.next_beat for n in self.nodes
                  if n.beat_key is not None and n.alive and not n.frozen]
        if self._events:
            times.append(self._events[0][0])
        return min(times) if times else None

    def _fire(self) -> None:
        now = self.clock.t
        while self._events and self._events[0][0] <= now:
            heapq.heappop(self._events)[2]()
        for n in self.nodes:
            if n.beat_key is not None and n.alive and not n.frozen and n.next_beat <= now:
                self.data[n.beat_key] = b"%d" % next(self._beat)
                n.next_beat = now + self.cfg.ka_interval
