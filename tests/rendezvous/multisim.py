"""Several candidate stores, links cut per (node, store) pair, and a thin driver that mirrors
the handler's failover (``_moves.Moves._next_rendezvous_anywhere``, ``_move``, ``_go_back``,
``_follow``, ``lost_members``'s move, and ``_failover.Candidates``' probes, marks, proofs,
``connect``'s start, ``follow`` and ``check``).

What is simulated, precisely: the round state machine (``_round.Machine``) runs unchanged; the
moves around it are this module's driver, written from the handler's code, not the handler
itself (issue 27 item 2's "typed operations of the machine" is not done), except the proof
that lost members are gone and a mover's mark with its fence check, which run the real
policies (``_failover.prove_gone``, ``_failover.mark_moving``) on the simulated stores.
A request to a store
a node cannot reach fails as the handler's I/O layer sees it: a dead host refuses at once; a
cut link or a frozen host times out (after the detection window for a store request, after
``PROBE_S`` for a probe). Candidate ``i`` is hosted by node ``i``: its death kills the store,
its freeze freezes it. The server sees a connection close at once when the link is up, after
``closes_after`` seconds (TCP keep-alive) when it is cut.

A world "trains" at a time when every one of its members is in its training loop, not frozen
(its workers step only together): :meth:`MultiSim.overlaps` lists two worlds training at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from simstore import Node, Sim, Sleep

from fastelastic.errors import RendezvousConnectionError, RendezvousTimeoutError
from fastelastic.rendezvous import _failover as fo
from fastelastic.rendezvous import _requests as rq
from fastelastic.rendezvous import _schema as sc
from fastelastic.rendezvous._failover import PROBE_S, Fenced, GoBack, Live, Regroup

DOWN = object()  # the reply of a request that failed as a connection error
MAX_HOPS = 16
START_PATIENCE = 60.0  # the read timeout a node waits at its start for the first candidate


@dataclass(frozen=True, slots=True)
class At:
    """The driver's request: the machine's ``op`` on store ``store``."""

    store: int
    op: rq.Op


@dataclass(frozen=True, slots=True)
class Peek:
    """The driver's probe of store ``store`` (answered within ``PROBE_S``): ``read(data)``."""

    store: int
    read: Callable[[dict[str, bytes]], Any]


@dataclass
class MNode(Node):
    store: int = -1
    live: Live = field(default_factory=Live)
    bstore: int = -1  # the store of the request it is blocked in
    conn: int = 0  # generation of its connection (a move makes a new one)
    training: tuple[int, int] | None = None  # (store, round) while in its training loop
    segs: list[tuple[tuple[int, int], float, float]] = field(default_factory=list)
    seg_start: float = -1.0
    worlds: dict[tuple[int, int], int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    pending: At | Peek | None = None  # a request waiting for its link to come back
    closed: bool = False  # its connection closed by the node itself (``_moves._fenced``)


class MultiSim(Sim):
    """``Sim`` with ``ncand`` stores; ``self.data`` is switched to the store of each request."""

    def __init__(self, min_nodes: int, max_nodes: int, ncand: int, closes_after: float = 10.0,
                 **cfg: Any) -> None:
        super().__init__(min_nodes, max_nodes, can_move=True, **cfg)
        self.stores: list[dict[str, bytes]] = [{} for _ in range(ncand)]
        self.data = self.stores[0]
        self.store_state = ["up"] * ncand  # up, dead, frozen
        self.links_cut: set[tuple[int, int]] = set()
        self.closes_after = closes_after

    # ------------------------------------------------------------------ links

    def link(self, node: Node, i: int) -> str:
        if self.store_state[i] == "dead":
            return "refused"
        if self.store_state[i] == "frozen" or (node.id, i) in self.links_cut:
            return "timeout"
        return "ok"

    def cut_link(self, t: float, node: MNode, i: int, heal: float | None = None) -> None:
        def cut() -> None:
            self.links_cut.add((node.id, i))
            gen = node.conn
            if node.store == i and node.alive:  # the server's keep-alive closes it later
                self.at(self.clock.t + self.closes_after,
                        lambda: self._late_close(node, i, gen))
        self.at(t, cut)
        if heal is not None:
            self.at(heal, lambda: self.links_cut.discard((node.id, i)))

    def _late_close(self, node: MNode, i: int, gen: int) -> None:
        if (node.id, i) in self.links_cut and node.conn == gen and node.store == i:
            self._disconnect(node)

    def _disconnect(self, node: MNode) -> None:
        """The server of ``node``'s store runs its connection's disconnect actions."""
        if node.store >= 0 and self.store_state[node.store] != "dead":
            d = self.stores[node.store]
            for key, value in node.on_disconnect:
                d[key] = d.get(key, b"") + value
        node.on_disconnect = []
        node.conn += 1

    def host_freeze(self, t: float, node: MNode, until: float) -> None:
        """SIGSTOP of a node (and of the store it hosts), SIGCONT at ``until``."""
        def stop() -> None:
            node.frozen = True
            self._seg_end(node)
            if node.id < len(self.stores) and self.store_state[node.id] == "up":
                self.store_state[node.id] = "frozen"
        def cont() -> None:
            node.frozen = False
            node.next_beat = min(node.next_beat, self.clock.t)
            if node.id < len(self.stores) and self.store_state[node.id] == "frozen":
                self.store_state[node.id] = "up"
            if node.training is not None and node.alive:
                node.seg_start = self.clock.t
        self.at(t, stop)
        self.at(until, cont)

    # ------------------------------------------------------------------ the sim's hooks

    def _kill(self, node: Node) -> None:
        assert isinstance(node, MNode)
        self._seg_end(node)
        node.training = None
        self._stop(node)
        node.alive = False
        if node.id < len(self.stores):
            self.store_state[node.id] = "dead"
        if node.store >= 0:
            st = self.link(node, node.store)
            if st == "ok":
                self._disconnect(node)
            elif st == "timeout":
                gen = node.conn
                self.at(self.clock.t + self.closes_after,
                        lambda: self._late_close(node, node.store, gen))

    def quit(self, node: Node) -> None:
        assert isinstance(node, MNode)
        self._seg_end(node)
        node.training = None
        self._stop(node)
        if node.store >= 0 and self.link(node, node.store) == "ok":
            self.data = self.stores[node.store]
            self.call(node, node.m.leave(for_good=True))
        self._kill(node)  # then the launcher exits: its connection closes

    def _apply(self, node: Node, op: Any) -> tuple[str, Any]:
        assert isinstance(node, MNode)
        match op:  # the most frequent first (a match tries its cases in order)
            case At() | Peek():
                pass
            case Sleep() | rq.Beat() | rq.StopBeats():
                return super()._apply(node, op)
            case _:  # ``call``: a machine request on the node's store
                op = At(node.store, op)
        i = op.store
        st = self.link(node, i)
        timeout = PROBE_S if isinstance(op, Peek) else self.cfg.window
        if st == "refused":
            return "now", DOWN
        if st == "timeout":  # answered if the link comes back before the deadline
            node.bstore, node.pending = i, op
            return "block", ("fail", [], self.clock.t + timeout)
        self.data = self.stores[i]
        node.bstore = i
        if isinstance(op, Peek):
            return "now", op.read(self.data)
        return super()._apply(node, op.op)

    def _unblock(self, node: Node) -> None:
        assert isinstance(node, MNode) and node.blocked is not None
        kind, _, deadline = node.blocked
        if kind == "fail":
            if node.pending is not None and self.link(node, node.bstore) == "ok":
                op, node.pending, node.blocked = node.pending, None, None
                k, value = self._apply(node, op)
                if k == "block":
                    node.blocked = value
                    self._unblock(node)
                else:
                    node.reply = value
            elif self.clock.t >= deadline:
                node.blocked, node.reply, node.pending = None, DOWN, None
            return
        if kind != "sleep":
            st = self.link(node, node.bstore)
            if st == "refused":
                node.blocked, node.reply = None, DOWN
                return
            if st == "timeout":  # the client's reply deadline
                node.blocked, node.pending = ("fail", [], self.clock.t + self.cfg.window), None
                return
            self.data = self.stores[node.bstore]
        super()._unblock(node)

    def _fire(self) -> None:
        now = self.clock.t
        while self._events and self._events[0][0] <= now:
            heapq.heappop(self._events)[2]()
        for n in self.nodes:
            if n.beat_key is not None and n.alive and not n.frozen and n.next_beat <= now:
                assert isinstance(n, MNode)
                if self.link(n, n.store) == "ok":
                    self.stores[n.store][n.beat_key] = b"%d" % next(self._beat)
                n.next_beat = now + self.cfg.ka_interval

    # ------------------------------------------------------------------ nodes

    def start(self, t: float = 0.0, node_rank: int = -1, moved_from: int = 0,
              proposed: int = 0) -> Node:
        from fastelastic.rendezvous._round import Machine

        node = MNode(len(self.nodes), Machine(self.cfg, self.clock), node_rank)
        self.nodes.append(node)
        self.at(t, lambda: self._launch(node))
        return node

    def _seg_end(self, node: MNode) -> None:
        if node.training is not None and node.seg_start >= 0:
            node.segs.append((node.training, node.seg_start, self.clock.t))
        node.seg_start = -1.0

    def _op(self, node: MNode, gen: rq.Proto[Any]) -> Any:
        """Runs one machine operation on the node's store (the handler's ``_run``/``_do``)."""
        reply: Any = None
        try:
            for _ in range(1_000_000):
                try:
                    op = gen.send(reply)
                except StopIteration as e:
                    return e.value
                match op:
                    case rq.Beat() | rq.StopBeats():
                        reply = yield op
                    case rq.MovedElsewhere():
                        yield from self._check(node)
                        reply = None
                    case rq.GoneElsewhere(idents, world):
                        reply = yield from self._gone_elsewhere(node, idents, world)
                    case _ if node.closed:  # a request on a closed client fails at once
                        raise RendezvousConnectionError(f"store {node.store}: closed")
                    case _:
                        reply = yield At(node.store, op)
                        if reply is DOWN:
                            raise RendezvousConnectionError(f"store {node.store} lost")
            raise AssertionError("an operation that never ends")
        finally:
            gen.close()

    def _probe(self, node: MNode, exclude: int) -> Generator[Any, Any, list[tuple[int, int]]]:
        found = []
        for i in range(len(self.stores)):
            if i == exclude:
                continue
            v = yield Peek(i, lambda d: int(d.get(self.keys.epoch, b"0")))
            if v is not DOWN:
                found.append((-v, i))
        return sorted(found)

    @property
    def keys(self) -> sc.Keys:
        return sc.Keys(self.cfg.run_id)

    def _connect(self, node: MNode, exclude: int = -1, at_least: int = 0,
                 world: bytes = b"") -> Generator[Any, Any, tuple[int, int, int]]:
        start, deadline = self.clock.t, self.clock.t + START_PATIENCE
        for _ in range(100_000):  # as Candidates.connect: a start never proposes an epoch
            found = yield from self._probe(node, exclude)
            if found and (exclude >= 0 or found[0][0] != 0 or found[0][1] == 0):
                break
            if self.clock.t >= deadline and (not found or self.clock.t >= start + self.cfg.join):
                raise RendezvousConnectionError("no candidate could be reached")
            yield Sleep(0.2)
        else:
            raise RendezvousConnectionError("no candidate could be reached")
        epoch, i = -found[0][0], found[0][1]
        proposed = at_least if epoch < at_least else 0
        if exclude >= 0 or proposed:
            yield from self._mark(node, i, proposed or epoch, world)
        return i, epoch, proposed

    def _mark(self, node: MNode, i: int, epoch: int,
              world: bytes) -> Generator[Any, Any, None]:
        """``Candidates._mark``: the real policy (``_failover.mark_moving``) on store ``i``."""
        me = f"10.0.0.{node.id}|{1000 + node.id}"
        proto, reply = fo.mark_moving(self.keys.moving, me, epoch, world), None
        try:
            for _ in range(3):
                reply = yield At(i, proto.send(reply))
                if reply is DOWN:
                    raise RendezvousConnectionError(f"store {i} lost")
        except StopIteration as e:
            if e.value:
                raise Fenced(f"store {i} fenced {me} from {world!r}") from None
            return
        raise AssertionError("mark_moving asked more than two requests")

    def _switch(self, node: MNode, live: Live) -> None:
        if node.store >= 0 and not node.closed:
            self._close(node)
        node.store, node.live, node.beat_key, node.closed = live.index, live, None, False
        node.log.append(f"{self.clock.t:.1f} at {live}")

    def _close(self, node: MNode) -> None:
        """The node closes its connection (the close half of ``_switch``)."""
        old = node.store
        st = self.link(node, old)
        if st == "ok":
            self._disconnect(node)
        else:
            pending = node.on_disconnect
            node.on_disconnect, node.conn = [], node.conn + 1
            if st == "timeout":
                def late() -> None:
                    if self.store_state[old] != "dead":
                        for key, value in pending:
                            self.stores[old][key] = self.stores[old].get(key, b"") + value
                self.at(self.clock.t + self.closes_after, late)

    def _fenced(self, node: MNode) -> None:
        """``_moves._fenced``: drops its world, closes its connection; it follows next."""
        node.m.back()
        node.beat_key = None  # the handler's _move stopped them first
        if node.live.left is not None:
            node.live = Live(node.live.left[0], 0)
        if not node.closed:
            self._close(node)
        node.closed = True
        node.log.append(f"{self.clock.t:.1f} fenced, follows from {node.live}")

    def _move(self, node: MNode) -> Generator[Any, Any, None]:
        live, member = node.live, node.m.member
        try:
            yield from self._op(node, node.m.moving())
        except RendezvousConnectionError:
            pass
        try:
            i, epoch, proposed = yield from self._connect(
                node, exclude=live.index, at_least=max(live.epoch, live.proposed) + 1,
                world=node.m.world_id)
        except Fenced:
            self._fenced(node)
            return
        left = (live.index, member[0]) if member is not None else live.left
        self._switch(node, Live(i, epoch, proposed,
                                left if proposed and live.index >= 0 else None))
        if live.left is not None and i == live.left[0] and node.m.returned():
            node.live = Live(i, epoch)  # as the handler's _move_now
        else:
            node.m.moved(proposed)

    def _check(self, node: MNode) -> Generator[Any, Any, None]:
        """``Candidates.check``."""
        live = node.live
        found = yield from self._probe(node, live.index)
        if found and -found[0][0] > live.epoch:
            raise RendezvousConnectionError("the rendezvous moved on")
        if live.left is not None:
            j, left = live.left
            v = yield Peek(j, lambda d: int(d.get(self.keys.open, b"0")))
            if v is not DOWN and v > left + 1:
                raise GoBack("the store left went on")
            if v is not DOWN and v == left + 1:
                raise GoBack("the store left answers, no round since", rejoin=True)
            lower = sorted(i for _, i in found if i < live.index and i != j)
            if lower:
                raise Regroup("an earlier candidate answers", lower[0])

    def _regroup(self, node: MNode, j: int) -> Generator[Any, Any, None]:
        """``fast_rendezvous._regroup`` (``Candidates.regroup``)."""
        live = node.live
        v = yield Peek(j, lambda d: int(d.get(self.keys.epoch, b"0")))
        if v is DOWN:
            raise RendezvousConnectionError(f"store {j} lost")
        proposed = live.proposed if live.proposed > v else 0
        try:
            yield from self._mark(node, j, proposed or v, node.m.world_id)
        except Fenced:
            self._fenced(node)
            return
        self._switch(node, Live(j, v, proposed, live.left if proposed else None))
        node.m.moved(proposed)

    def _back(self, node: MNode, rejoin: bool) -> Generator[Any, Any, None]:
        """``fast_rendezvous._go_back`` (``Candidates.back``)."""
        assert node.live.left is not None
        j = node.live.left[0]
        v = yield Peek(j, lambda d: int(d.get(self.keys.epoch, b"0")))
        if v is DOWN:
            raise RendezvousConnectionError(f"store {j} lost")
        self._switch(node, Live(j, v))
        if not (rejoin and node.m.returned()):
            node.m.back()

    def _follow(self, node: MNode, until: float) -> Generator[Any, Any, None]:
        """``fast_rendezvous._follow`` (``Candidates.follow``): a node that carries no world
        never moves the rendezvous; it follows a committed epoch or waits for its store."""
        live = node.live
        for _ in range(1_000_000):
            found = yield from self._probe(node, -1)
            pick = next((f for f in found if -f[0] > live.epoch or (
                f[1] == live.index and -f[0] >= live.epoch)), None)
            if pick is not None:
                self._switch(node, Live(pick[1], -pick[0]))
                node.m.moved()
                return
            if self.clock.t >= until:
                break
            yield Sleep(0.2)
        raise RendezvousTimeoutError("lost its store while in no world; none came back")

    def _gone_elsewhere(self, node: MNode, idents: list[str],
                        world: bytes) -> Generator[Any, Any, str]:
        """``Candidates.gone_elsewhere``: the real policy (``_failover.prove_gone``), each of
        its requests (append the fence if any, then read the list) as ``Candidates._marks``
        makes them, each within ``PROBE_S``."""
        proof = fo.prove_gone([str(i) for i in range(len(self.stores))], node.live.index, idents,
                           world)
        reply = None
        try:
            for _ in range(2 * len(self.stores) + 1):
                i, fence = proof.send(reply)
                reply = yield from self._marks(node, i, fence)
        except StopIteration as e:
            return str(e.value)
        raise AssertionError("prove_gone asked more than two passes")

    def _marks(self, node: MNode, i: int, fence: bytes) -> Generator[Any, Any, Any]:
        if self.link(node, i) == "refused":
            return None
        if fence:
            r = yield Peek(i, lambda d: d.__setitem__(
                self.keys.moving, d.get(self.keys.moving, b"") + fence))
            if r is DOWN:
                return f"{i} did not answer"
        marks = yield Peek(i, lambda d: d.get(self.keys.moving, b""))
        return f"{i} did not answer" if marks is DOWN else marks

    def _join(self, node: MNode) -> Generator[Any, Any, Any]:
        m, addr = node.m, f"10.0.0.{node.id}"
        moves = len(self.stores) - 1
        until = self.clock.t + self.cfg.join
        for _ in range(MAX_HOPS):
            try:
                seat = yield from self._op(node, m.join(
                    node.node_rank, addr, 1000 + node.id, b"%s:%d" % (addr.encode(), 29500)))
                node.live = node.live.member()
                return seat
            except GoBack as e:
                yield from self._back(node, e.rejoin)
            except Regroup as e:
                yield from self._regroup(node, e.index)
            except RendezvousConnectionError:
                if m.member is None and not m.carried:  # as _next_rendezvous_anywhere
                    yield from self._follow(node, until)
                    continue
                if moves <= 0:
                    raise
                moves -= 1
                yield from self._move(node)
        raise RendezvousConnectionError("moved too many times")

    def _agent(self, node: Node) -> Generator[Any, Any, None]:
        assert isinstance(node, MNode)
        i, epoch, proposed = yield from self._connect(node)
        self._switch(node, Live(i, epoch, proposed))
        if proposed:
            node.m.moved(proposed)
        while True:
            seat = yield from self._join(node)
            key = (node.store, seat.round)
            node.seats.append((self.clock.t, seat))
            node.worlds[key] = seat.world
            node.training, node.seg_start = key, self.clock.t
            try:
                for _ in range(1_000_000):
                    yield Sleep(self.check)
                    try:
                        lost = yield from self._op(node, node.m.lost_members())
                        waiting = yield from self._op(node, node.m.num_nodes_waiting())
                    except RendezvousConnectionError:
                        self._seg_end(node)
                        node.training = None
                        yield from self._move(node)
                        break
                    if lost or waiting:
                        node.restarts += 1
                        break
            finally:
                self._seg_end(node)
                node.training = None

    def _step(self, node: Node) -> None:
        """``Sim._step`` with the driver's requests: ``At(store, op)`` and ``Peek(store, fn)``
        go to a store, the rest are local."""
        assert node.gen is not None and isinstance(node, MNode)
        try:
            op = node.gen.send(node.reply)
        except StopIteration:
            self._stop(node)
            return
        except Exception as e:  # a RendezvousError ends the launcher: its process exits
            node.error, node.error_at = e, self.clock.t
            self._kill(node)
            return
        kind, value = self._apply(node, op)
        node.reply = value
        if kind == "block":
            node.blocked = value
            node.reply = None
            self._unblock(node)

    # ------------------------------------------------------------------ what happened

    def _segments(self) -> tuple[dict[tuple[int, int], int],
                                 list[tuple[float, int, tuple[int, int]]]]:
        """Each world's size, and every member's training segment as start (+1) and end (-1)
        events in time order (a start after an end at the same time)."""
        world: dict[tuple[int, int], int] = {}
        ev: list[tuple[float, int, tuple[int, int]]] = []
        for n in self.nodes:
            assert isinstance(n, MNode)
            world.update(n.worlds)
            segs = list(n.segs)
            if n.training is not None and n.seg_start >= 0:
                segs.append((n.training, n.seg_start, self.clock.t))
            for key, a, b in segs:
                if b > a:
                    ev += [(a, 1, key), (b, -1, key)]
        ev.sort(key=lambda e: (e[0], e[1]))
        return world, ev

    def overlaps(self) -> list[tuple[tuple[int, int], tuple[int, int], float]]:
        """Two worlds (store, round) whose members all trained at once: (a, b, when)."""
        world, ev = self._segments()
        count: dict[tuple[int, int], int] = {}
        out = []
        for t, d, key in ev:
            count[key] = count.get(key, 0) + d
            full = [k for k, c in count.items() if c >= world[k]]
            if d > 0 and len(full) > 1:
                out.append((full[0], full[1], t))
        return out

    def training_now(self) -> list[tuple[int, int]]:
        """The worlds whose members all train at the end of the run."""
        count: dict[tuple[int, int], int] = {}
        world: dict[tuple[int, int], int] = {}
        for n in self.nodes:
            assert isinstance(n, MNode)
            world.update(n.worlds)
            if n.training is not None and n.alive and not n.frozen:
                count[n.training] = count.get(n.training, 0) + 1
        return [k for k, c in count.items() if c >= world[k]]

    def last_world(self) -> tuple[tuple[int, int], int, int] | None:
        """The world that trained last (whose members all trained together latest): (key, its
        size, its members still running)."""
        ends = self._full_ends()
        if not ends:
            return None
        key = max(ends, key=lambda k: ends[k])
        members = [n for n in self.nodes if key in getattr(n, "worlds", {})]
        return key, members[0].worlds[key], sum(n.alive for n in members)  # type: ignore[attr-defined]

    def _full_ends(self) -> dict[tuple[int, int], float]:
        """For each world that ever trained (all members at once): when that last ended."""
        world, ev = self._segments()
        count: dict[tuple[int, int], int] = {}
        out: dict[tuple[int, int], float] = {}
        for t, d, key in ev:
            was = count.get(key, 0) >= world[key]
            count[key] = count.get(key, 0) + d
            if was and count[key] < world[key]:
                out[key] = t
            elif count[key] >= world[key]:
                out[key] = self.clock.t  # full now: until the end so far
        return out
