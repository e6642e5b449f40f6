"""Several candidate stores, links cut per (node, store) pair, and a thin driver that runs the
handler's failover on them.

What is simulated, precisely: the round state machine (``_round.Machine``) and the failover's
operations run unchanged: a node's start (``_start``: hosting a restarted standby, its sync,
the connect), its joins with every move, return, regroup and follow (``_hops.join_anywhere``),
the proof that lost members are gone and a mover's mark. This driver only answers their
requests (``_hop``, as ``_failover.Candidates.run`` does on real stores) and plays the world:
links, clocks, hosts, and a node's training loop (``_agent``).
A request to a store a node cannot reach fails as the handler's I/O layer sees it: a dead
host refuses at once; a cut link or a frozen host times out (after the detection window for
a store request, after ``PROBE_S`` for a probe). Candidate ``i`` is hosted by node ``i``: its
death kills the store, its freeze freezes it. The server sees a connection close at once when
the link is up, after ``closes_after`` seconds (TCP keep-alive) when it is cut.

A world "trains" at a time when every one of its members is in its training loop, not frozen
(its workers step only together): :meth:`MultiSim.overlaps` lists two worlds training at once.
Nodes are named as pods and hosts name them: each draws an empty address or its own, pid 1 or
its own, a shared hostname or its own (``MultiSim.identity``); only the nonce of its identity
(``_schema.node_id``) is its own for sure.
A world is named (store, round); a store that came back empty after its host restarted
(:meth:`MultiSim.restart`) is named anew, ``store + ncand`` per restart.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from simstore import Node, Sim, Sleep

from fastelastic.errors import RendezvousConnectionError
from fastelastic.rendezvous.fast import _requests as rq
from fastelastic.rendezvous.fast import _schema as sc
from fastelastic.rendezvous.fast.failover import _hops as hops
from fastelastic.rendezvous.fast.failover import _start as start_ops
from fastelastic.rendezvous.fast.failover._failover import PROBE_S
from fastelastic.rendezvous.fast.failover._hops import LiveStore

DOWN = object()  # the reply of a request that failed as a connection error
START_PATIENCE = 60.0  # the read timeout a node waits at its start for the first candidate
SYNC_RETRY_S = 1.0  # seconds between a restarted standby's attempts to sync


@dataclass(frozen=True, slots=True)
class At:
    """The driver's request: the machine's ``op`` on store ``store``."""

    store: int
    op: rq.Request


@dataclass(frozen=True, slots=True)
class Peek:
    """The driver's probe of store ``store`` (answered within ``PROBE_S``): ``read(data)``."""

    store: int
    read: Callable[[dict[str, bytes]], Any]


@dataclass
class MNode(Node):
    store: int = -1
    live: LiveStore = field(default_factory=LiveStore)
    bstore: int = -1  # the store of the request it is blocked in
    conn: int = 0  # generation of its connection (a move makes a new one)
    training: tuple[int, int] | None = None  # (store, round) while in its training loop
    segs: list[tuple[tuple[int, int], float, float]] = field(default_factory=list)
    seg_start: float = -1.0
    worlds: dict[tuple[int, int], int] = field(default_factory=dict)
    log: list[str] = field(default_factory=list)
    pending: At | Peek | None = None  # a request waiting for its link to come back
    closed: bool = False  # its connection closed by the node itself (``_hops.drop_world``)
    plan: hops.FailoverContext | None = None  # what its failover operations know (``start``)
    hosts: int = -1  # the candidate whose store it hosts (node i hosts candidate i at first)
    addr: str = ""  # its --local-addr ("" as in a pod)
    pid: int = 0
    ident: str = ""  # its identity (``_schema.node_id``): the only name that is its own


class MultiSim(Sim):
    """``Sim`` with ``ncand`` stores; ``self.data`` is switched to the store of each request."""

    def __init__(self, min_nodes: int, max_nodes: int, ncand: int, closes_after: float = 10.0,
                 flaky_fences: float = 0.0, seed: int = 0, **cfg: Any) -> None:
        super().__init__(min_nodes, max_nodes, can_move=True, **cfg)
        self.flaky_fences = flaky_fences  # see _marks
        self.rnd = random.Random(seed)
        self.ids = random.Random(seed * 104_729 + 11)  # identities: a stream of their own
        self.by_ident: dict[str, int] = {}
        self.stores: list[dict[str, bytes]] = [{} for _ in range(ncand)]
        self.data = self.stores[0]
        self.store_state = ["up"] * ncand  # up, dead, frozen
        self.restarts = [0] * ncand  # of each store: a world's key is (store + ncand x this, round)
        self.links_cut: set[tuple[int, int]] = set()
        self.links_refused: set[tuple[int, int]] = set()  # the store's host alive behind them
        self.closes_after = closes_after
        self.queued_closes: list[list[tuple[MNode, int]]] = [[] for _ in range(ncand)]

    # ------------------------------------------------------------------ links

    def link(self, node: Node, i: int) -> str:
        if self.store_state[i] == "dead" or (node.id, i) in self.links_refused:
            return "refused"
        if self.store_state[i] == "frozen" or (node.id, i) in self.links_cut:
            return "timeout"
        return "ok"

    def cut_link(self, t: float, node: MNode, i: int, heal: float | None = None,
                 refuse: bool = False) -> None:
        """Cuts the link between ``node`` and store ``i`` from ``t`` to ``heal``: its packets
        dropped (a timeout), or with ``refuse`` rejected as a firewall's REJECT does (the
        node's requests fail at once, while the store serves the others). Either way the
        server closes the node's connection by keep-alive, ``closes_after`` later."""
        cuts = self.links_refused if refuse else self.links_cut

        def cut() -> None:
            cuts.add((node.id, i))
            gen = node.conn
            if node.store == i and node.alive:  # the server's keep-alive closes it later
                self.at(self.clock.t + self.closes_after,
                        lambda: self._late_close(node, i, gen))
        self.at(t, cut)
        if heal is not None:
            self.at(heal, lambda: cuts.discard((node.id, i)))

    def _late_close(self, node: MNode, i: int, gen: int) -> None:
        cut = (node.id, i) in self.links_cut or (node.id, i) in self.links_refused
        if cut and node.conn == gen and node.store == i:
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
            if node.hosts >= 0 and self.store_state[node.hosts] == "up":
                self.store_state[node.hosts] = "frozen"
        def cont() -> None:
            node.frozen = False
            node.next_beat = min(node.next_beat, self.clock.t)
            if node.hosts >= 0 and self.store_state[node.hosts] == "frozen":
                self.store_state[node.hosts] = "up"
                # the closes its kernel queued while it was stopped (a node killed meanwhile)
                closes, self.queued_closes[node.hosts] = self.queued_closes[node.hosts], []
                for other, gen in closes:
                    if other.conn == gen and other.store == node.hosts:
                        self._disconnect(other)
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
        if node.hosts >= 0:
            self.store_state[node.hosts] = "dead"
        if node.store >= 0:
            st = self.link(node, node.store)
            if st == "ok":
                self._disconnect(node)
            elif ((node.id, node.store) in self.links_cut
                  or (node.id, node.store) in self.links_refused):  # the server's keep-alive
                gen = node.conn
                self.at(self.clock.t + self.closes_after,
                        lambda: self._late_close(node, node.store, gen))
            elif st == "timeout":  # its host is stopped: seen once it runs again
                self.queued_closes[node.store].append((node, node.conn))

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
        from fastelastic.rendezvous.fast._round import Machine

        node = MNode(len(self.nodes), Machine(self.cfg, self.clock), node_rank)
        node.hosts = node.id if node.id < len(self.stores) else -1
        node.addr, node.pid, node.ident = self.identity(node.id)
        self.by_ident[node.ident] = node.id
        node.plan = hops.FailoverContext(
            [str(i) for i in range(len(self.stores))], self.keys, START_PATIENCE,
            self.cfg.run_id, node.ident, start_wait=self.cfg.join,
            join_s=self.cfg.join, clock=self.clock,
            say=lambda fmt, *a: node.log.append(f"{self.clock.t:.1f} " + fmt % a),
            sync_retry_s=SYNC_RETRY_S,
            nonce=lambda: b"%d" % (len(self.stores) * self.restarts[node.hosts] + node.hosts))
        self.nodes.append(node)
        self.at(t, lambda: self._launch(node))
        return node

    def identity(self, i: int) -> tuple[str, int, str]:
        """Node ``i``'s address, pid and identity: pods share the empty address, pid 1 and
        maybe a hostname; hosts' pids collide; a replacement may reuse everything but the
        nonce. Each is drawn, so schedules mix colliding and distinct names."""
        r = self.ids
        addr = r.choice(["", f"10.0.0.{i}"])
        pid = r.choice([1, 1000 + i % 3])
        host = r.choice(["pod", f"h{i}"])
        return addr, pid, sc.node_id(host, pid, r.getrandbits(64))

    def restart(self, t: float, i: int) -> MNode:
        """The host of candidate ``i`` restarted (its agent and store were killed): a new
        agent starts there at ``t`` with the same command; its store comes back empty, as
        ``Candidates`` hosts it (the other candidates probed first, ``_hops.behind``)."""
        node = self.start(t)
        assert isinstance(node, MNode) and node.hosts < 0
        node.hosts = i
        return node

    def _seg_end(self, node: MNode) -> None:
        if node.training is not None and node.seg_start >= 0:
            node.segs.append((node.training, node.seg_start, self.clock.t))
        node.seg_start = -1.0

    def _op(self, node: MNode, gen: rq.RequestGen[Any]) -> Any:
        """Runs one machine operation on the node's store (the handler's ``_run``/``_do``):
        its ``MovedElsewhere`` and ``GoneElsewhere`` are the failover's real operations
        (``_hops.check``, ``_hops.prove_gone``)."""
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
                        yield from self._hop(node, hops.check(node.plan, node.live))
                        reply = None
                    case rq.GoneElsewhere(idents, world):
                        reply = yield from self._hop(node, hops.prove_gone(
                            node.plan.names, node.live.index, idents, world))
                    case _ if node.closed:  # a request on a closed client fails at once
                        raise RendezvousConnectionError(f"store {node.store}: closed")
                    case _:
                        reply = yield At(node.store, op)
                        if reply is DOWN:
                            raise RendezvousConnectionError(f"store {node.store} lost")
            raise AssertionError("an operation that never ends")
        finally:
            gen.close()

    def _hop(self, node: MNode, gen: hops.FailoverOp[Any]) -> Generator[Any, Any, Any]:
        """Runs one of the failover's operations (``_hops``) as ``Candidates.run`` does on
        real stores: a probe within ``PROBE_S``; a request that fails as a connection error
        thrown into the operation."""
        reply: Any = None
        error: BaseException | None = None
        try:
            for _ in range(1_000_000):
                try:
                    op = gen.send(reply) if error is None else gen.throw(error)
                except StopIteration as e:
                    return e.value
                reply, error = None, None
                match op:
                    case hops.Probe(i, key):
                        v = yield Peek(i, lambda d, key=key: int(d.get(key, b"0")))
                        reply = f"{i}: did not answer" if v is DOWN else v
                    case hops.MovingList(i, entry):
                        reply = yield from self._marks(node, i, entry)
                    case hops.Pause(seconds):
                        yield Sleep(seconds)
                    case hops.JoinRound():
                        try:
                            reply = yield from self._op(node, node.m.join(
                                node.node_rank, node.addr, node.pid,
                                b"%s:%d" % (node.addr.encode(), 29500), node.ident))
                        except RendezvousConnectionError as e:
                            error = e
                    case hops.OnStandby(request):  # a failure only logged, as the handler's
                        reply = yield At(node.hosts, request)
                        reply = None if reply is DOWN else reply
                    case hops.Adopt(live):
                        self._switch(node, live)
                    case hops.CloseStore(live):
                        if not node.closed:
                            self._close(node)
                        node.closed, node.live = True, live
                        node.log.append(f"{self.clock.t:.1f} closed, follows from {live}")
                    case rq.Beat() | rq.StopBeats():
                        reply = yield op
                    case _ if type(op).__module__ == hops.__name__:  # no time, no link
                        reply = self._local(node, op)
                    case _ if node.closed:
                        error = RendezvousConnectionError(f"store {node.store}: closed")
                    case _:
                        reply = yield At(node.store, op)
                if reply is DOWN:
                    reply, error = None, RendezvousConnectionError(f"store {op} lost")
            raise AssertionError("a failover operation that never ends")
        finally:
            gen.close()

    @property
    def keys(self) -> sc.RunKeys:
        return sc.RunKeys(self.cfg.run_id)

    def _switch(self, node: MNode, live: LiveStore) -> None:
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
            if st == "timeout" or self.store_state[old] != "dead":  # cut, or refused alive
                def late() -> None:
                    if self.store_state[old] != "dead":
                        for key, value in pending:
                            self.stores[old][key] = self.stores[old].get(key, b"") + value
                self.at(self.clock.t + self.closes_after, late)

    def _marks(self, node: MNode, i: int, entry: bytes) -> Generator[Any, Any, Any]:
        """``Candidates._marks``. With ``flaky_fences``, that share of a proof's fences on its
        last candidate meet that candidate as it stops answering the prover (the fence lands or
        not; no answer within ``PROBE_S``): the proof fails after fencing the others, which it
        withdraws."""
        if self.link(node, i) == "refused":
            return None
        last = max(j for j in range(len(self.stores)) if j != node.live.index)
        if (entry.startswith(b"x") and i == last and self.flaky_fences
                and self.rnd.random() < self.flaky_fences):
            if self.rnd.random() < 0.5:
                self.stores[i][self.keys.moving] = self.stores[i].get(self.keys.moving, b"") + entry
            yield Sleep(PROBE_S)
            return f"{i} did not answer"
        if entry:
            r = yield Peek(i, lambda d: d.__setitem__(
                self.keys.moving, d.get(self.keys.moving, b"") + entry))
            if r is DOWN:
                return f"{i} did not answer"
        marks = yield Peek(i, lambda d: d.get(self.keys.moving, b""))
        return f"{i} did not answer" if marks is DOWN else marks

    def _local(self, node: MNode, op: Any) -> Any:
        """The failover's requests that cost no simulated time: a look at a store over a
        probe's connection (answered while the link is up), the node's own store hosted or
        appended to by its host, where its rendezvous is."""
        match op:
            case hops.Probe(i, key):  # only from a background operation (``_background``)
                return (int(self.stores[i].get(key, b"0")) if self.link(node, i) == "ok"
                        else f"{i}: did not answer")
            case hops.Count(i, key):
                return int(self.stores[i].get(key, b"0")) if self.link(node, i) == "ok" else None
            case hops.ReadMoving(i):
                return (self.stores[i].get(self.keys.moving, b"") if self.link(node, i) == "ok"
                        else None)
            case hops.HostStandby(mine):
                i = mine[0]  # the candidate of its host (``restart``)
                self.stores[i], self.store_state[i] = {}, "up"
                self.restarts[i] += 1
                return i
            case hops.AppendStandby(entry):
                d = self.stores[node.hosts]
                d[self.keys.moving] = d.get(self.keys.moving, b"") + entry
                return None
            case hops.Where():
                return node.live
            case hops.Settle(live):
                node.live = live
                return None
        raise AssertionError(f"not a local request: {op}")

    def _background(self, node: MNode, gen: hops.FailoverOp[Any], reply: Any = None) -> None:
        """Runs a thread of ``node``'s host (``_start.keep_syncing``): its reads at once, its
        pauses as events; it ends with the node or the store it hosts."""
        try:
            for _ in range(1_000_000):
                op = gen.send(reply)
                if isinstance(op, hops.Pause):
                    def resume() -> None:
                        if node.alive and self.store_state[node.hosts] != "dead":
                            self._background(node, gen)
                        else:
                            gen.close()
                    self.at(self.clock.t + op.seconds, resume)
                    return
                reply = self._local(node, op)
        except StopIteration:
            return

    def _agent(self, node: Node) -> Generator[Any, Any, None]:
        """A launcher: its start (the handler's, ``_start``; a store already up when the
        simulation starts was hosted before it), its joins (``_hops.join_anywhere``), its
        training loop and ``lost_members``'s move."""
        assert isinstance(node, MNode)
        if node.hosts >= 0 and self.store_state[node.hosts] == "dead":  # a restarted host
            hosted = yield from self._hop(node, start_ops.host_standby(node.plan, [node.hosts]))
            if hosted is not None and not hosted.synced:
                self._background(node, start_ops.keep_syncing(node.plan, hosted.index,
                                                              hosted.nonce))
        i, epoch, proposed = yield from self._hop(node, start_ops.start(node.plan, node.hosts))
        self._switch(node, hops.begin(node.m, i, epoch, proposed))
        while True:
            seat = yield from self._hop(node, hops.join_anywhere(node.plan, node.m))
            key = (node.store + len(self.stores) * self.restarts[node.store], seat.round)
            node.seats.append((self.clock.t, seat))
            node.worlds[key] = seat.world
            node.training, node.seg_start = key, self.clock.t
            try:
                for _ in range(1_000_000):
                    yield Sleep(self.check)
                    try:
                        lost = yield from self._op(node, node.m.lost_members())
                        waiting = yield from self._op(node, node.m.num_nodes_waiting())
                    except RendezvousConnectionError as e:
                        self._seg_end(node)
                        node.training = None
                        yield from self._hop(node, hops.move(node.plan, node.m, node.live, e))
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

    def lost_majority_carriers(self, store: int) -> list[int]:
        """The live nodes on ``store`` that still carry a world (moved with it) whose majority
        is lost: the majority rule holds them, and every round they join there, by design."""
        out = []
        for n in self.nodes:
            assert isinstance(n, MNode)
            if not (n.alive and n.store == store and n.m.carried and n.worlds):
                continue
            key = list(n.worlds)[-1]  # its last world
            members = [x for x in self.nodes if key in getattr(x, "worlds", {})]
            if 2 * sum(x.alive for x in members) <= n.worlds[key]:
                out.append(n.id)
        return out

    def dead_movers(self, store: int) -> list[int]:
        """When a majority of the last world formed on ``store`` is dead: those of its dead
        members that marked another candidate first (they moved, then died there). Their
        marks block the proof that they are gone, by design: nothing on that candidate tells
        a mover that died there from one alive there (README)."""
        d = self.stores[store]
        done = [int(k.split("/")[1]) for k, v in d.items()
                if k.endswith("/res") and k.split("/")[1].isdigit() and v.startswith(b"M")]
        if not done:
            return []
        r = max(done)
        world = int(d[f"{self.keys.base}{r}/res"][1:].split(b"\n")[0])
        members = [d.get(f"{self.keys.base}{r}/who/{i}", b"") for i in range(world)]
        ids = [self.by_ident[sc.who_node(raw)] for raw in members if raw]
        dead = [i for i in ids if not self.nodes[i].alive]
        if 2 * (world - len(dead)) > world:
            return []
        marked = {who for j, o in enumerate(self.stores) if j != store
                  for _, who in sc.marks(o.get(self.keys.moving, b""))}
        return [i for i in dead if self.nodes[i].ident in marked]

    def best_reachable_quorum(self) -> int:
        """The most candidates that count (up, synced: ``_schema.counts``) any live node
        reaches now."""
        counting = [i for i, d in enumerate(self.stores) if self.store_state[i] != "dead"
                    and sc.counts(d.get(self.keys.moving, b""))]
        return max((sum(self.link(n, i) == "ok" for i in counting) for n in self.nodes
                    if n.alive), default=0)

    def last_world_majority_dead(self) -> bool:
        """Whether some live node's last world (its round formed there, trained or not) has
        lost a majority of its members to death."""
        for n in self.nodes:
            assert isinstance(n, MNode)
            if n.alive and n.worlds:
                key, size = list(n.worlds.items())[-1]
                alive = sum(x.alive for x in self.nodes if key in getattr(x, "worlds", {}))
                if 2 * alive <= size:
                    return True
        return False

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
