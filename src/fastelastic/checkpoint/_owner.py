"""The agent's side of ``fastelastic.checkpoint``: it owns each local rank's shard memory.

The memory outlives the workers: a worker crashes, hangs or is restarted, and the shards stay
in the agent, which ends with them. The agent never imports torch; the workers write the bytes.

Each local rank gets two buffers (the double buffer): a save writes the one that does not hold
the rank's newest committed shard, so a worker killed mid-save leaves the step before intact.
A buffer is an unlinked file in /dev/shm (mode 0600) or, when /dev/shm is the only limit in the
way, a memfd; either is reserved whole with ``posix_fallocate`` before a worker may write it.

Channel: a ``SOCK_SEQPACKET`` unix socket in the abstract namespace, named after the agent's
pid (``fastelastic-ckpt-<pid>``): a worker finds it among its ancestors (its parent, or the
zygote's), so the workers' environment stays torchrun's. Both ends check the other's
credentials (``SO_PEERCRED``): the agent serves its own user only, and a worker talks only to
a process of its user with the pid it looked for. One JSON request per packet, one reply;
buffers travel as file descriptors (``SCM_RIGHTS``). Requests: ``reserve``, ``commit``
(optionally waiting as ``wait`` does), ``wait`` (until every local rank committed a step),
``restore``.

Disk: a step saved with a ``checkpoint_id`` is written there behind training, in torch DCP's
format, once every local rank's shard of it is sealed (``_disk``: the workers laid the files
out; this side moves the bytes). One write at a time, newest step first: a step still waiting
when a newer one is whole is skipped, and so is a write under way when a worker needs its
buffer for a newer save, unless the write before it was skipped too (so at least every other
write lands and a save waits for the disk at most every other write). A worker's crash, a hang
verdict or a restart do not stop the write; the agent's exit waits for it up to
``drain_timeout`` (``--checkpoint-drain-timeout``).

Round: each start of the workers begins a round. The round's restore step is fixed once, before
any request of the round is answered: the newest step for which every local rank holds a sealed
shard whose MAC still checks (the one-step rule on one node). A job of several nodes fixes it
across nodes (``agree``, :mod:`._across`): every agent checks the MAC of each shard it holds,
publishes them in the round's store and applies the rule (``_schema.restore_rule``) to every
agent's publication, so every rank restores one step of one era.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import mmap
import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Optional

from fastelastic.checkpoint import _format, _room
from fastelastic.checkpoint._format import ShardError

__all__ = ["SOCKET_ENV", "ENABLE_ENV", "DRAIN_ENV", "RATE_ENV", "CheckpointError",
           "MemoryOwner", "from_env", "find_agent"]

logger = logging.getLogger("fastelastic.checkpoint")

SOCKET_ENV = "FASTELASTIC_CHECKPOINT_SOCKET"  # "@name": the channel, when not an ancestor's
NAME_PREFIX = "fastelastic-ckpt-"
ENABLE_ENV = "FASTELASTIC_CHECKPOINT"  # "0": the agent offers no checkpoint memory
_MAX_PACKET = 64 << 10
_MB = 1 << 20
_WAIT_S = 600.0  # bound on a request that waits for the round, a seal or the other ranks
DRAIN_ENV = "FASTELASTIC_CHECKPOINT_DRAIN_TIMEOUT"  # seconds the exit waits for the disk write
DRAIN_DEFAULT = 300.0
RATE_ENV = "FASTELASTIC_CHECKPOINT_WRITE_RATE"  # bytes a second the disk writes may take
_STATUS_KEEP = 256  # disk states kept (the newest steps)
WRITTEN, SKIPPED, MEMORY = "written", "skipped", "memory"  # and "failed: <why>"

EMPTY, WRITING, COMMITTED, SEALED, BAD = "empty", "writing", "committed", "sealed", "bad"


class CheckpointError(RuntimeError):
    """A checkpoint request the agent cannot serve (the message is one line saying why)."""


class _Buf:
    """One buffer of one local rank; every field is guarded by the owner's lock."""

    def __init__(self) -> None:
        self.fd = -1
        self.capacity = 0
        self.kind = ""
        self.mm: Optional[mmap.mmap] = None
        self.state = EMPTY
        self.step = -1
        self.gen = 0
        self.total = 0
        self.mac = b""
        self.dcp: Optional[dict[str, Any]] = None  # the step's disk plan (``_dcp``), if any
        self.era = 0  # the era of the round that saved it (the rule across nodes)
        self.world = 0  # the world size of that round
        self.rank = -1  # the global rank that saved it
        self.hashing = 0  # seals and checks reading the mapping now: it is not released under them

    def release(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.capacity = 0
        self.state = EMPTY

    def valid(self) -> bool:
        return self.state in (COMMITTED, SEALED)


def _alloc(capacity: int, memfd: bool) -> tuple[int, str]:
    """A new buffer of ``capacity`` bytes, every page reserved: (fd, "shm" or "memfd").

    Raises:
        OSError: the memory could not be reserved.
    """
    if not memfd:
        fd = -1
        try:
            fd = os.open(_room.SHM_DIR, os.O_TMPFILE | os.O_RDWR | os.O_EXCL | os.O_CLOEXEC,
                         0o600)
            os.ftruncate(fd, capacity)
            os.posix_fallocate(fd, 0, capacity)
            return fd, "shm"
        except OSError as e:
            if fd >= 0:
                os.close(fd)
            if e.errno not in (errno.ENOSPC, errno.EOPNOTSUPP, errno.EISDIR, errno.ENOENT,
                               errno.EACCES, errno.EROFS):
                raise
            logger.warning("checkpoint memory: /dev/shm refused %s (%s); using memfd",
                           _room.fmt_bytes(capacity), e.strerror)
    fd = os.memfd_create("fastelastic-checkpoint", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, capacity)
        os.posix_fallocate(fd, 0, capacity)
    except OSError:
        os.close(fd)
        raise
    return fd, "memfd"


class MemoryOwner:
    """Owns the local ranks' checkpoint buffers and serves the workers' channel.

    Args:
        token: the job's store token (the MAC key); None when the job has none.
        limit: bytes the owner may hold in all (``$FASTELASTIC_CHECKPOINT_MEMORY_LIMIT``).
        name: the channel's abstract name; default ``fastelastic-ckpt-<this pid>``.

    Raises:
        OSError: the name is taken (another owner in this process).
    """

    def __init__(self, token: Optional[bytes] = None, limit: Optional[int] = None,
                 name: Optional[str] = None, drain_timeout: float = DRAIN_DEFAULT,
                 write_rate: float = 0.0) -> None:
        self._key = _format.mac_key(token)
        self._limit = limit
        self._cond = threading.Condition()
        self._ranks: dict[int, list[_Buf]] = {}
        self._gen = 0
        self._round = 0
        self._local_world = 0
        self._fixed = True
        self._restore: Optional[tuple[int, dict[int, int]]] = None  # (step, {lr: buffer})
        self._closed = False
        self._memfd_said = False
        self._pool: Any = None  # hashes for the restore's check (the workers wait for it)
        self._seal_pool: Any = None  # hashes for the seals, niced (behind training)
        self._conns: set[socket.socket] = set()
        self._seals: queue.Queue[Optional[tuple[int, int, int]]] = queue.Queue()
        self.last_restore: Optional[dict[str, Any]] = None  # step and seconds of the last fix
        self.drain_timeout = drain_timeout
        self._rate = write_rate
        self._disk: dict[int, str] = {}  # step -> written, skipped, memory or failed: why
        self._queued = -1  # the newest step given to the disk
        self._pending: Optional[tuple[int, dict[int, int]]] = None  # (step, {lr: buffer})
        self._writing: Optional[int] = None
        self._pins: set[tuple[int, int]] = set()  # (lr, buffer) the write under way reads
        self._abort = threading.Event()  # gives the write under way up (a new one per write)
        self._stop = threading.Event()  # the agent's end: every write stops
        self._protect = False  # the last write was skipped: the next one is not given up
        self.last_write: Optional[dict[str, Any]] = None  # step, bytes, seconds of the last
        self.era = 0  # the era of the last round fixed across nodes (saves carry it)
        self._world = 0  # this round's world size
        self._globals: dict[int, int] = {}  # this round's local rank -> global rank
        self._agree: Any = None  # this round's exchange across nodes (None: one node)
        self._unserved: dict[int, str] = {}  # local rank -> why this round cannot restore it
        self._broken = False  # the round could not fix its step: it neither saves nor restores
        self.copier: Any = None  # ``_copy.Copier``: the copy on another node (several nodes)
        self.copy_to = 1  # the copy goes to the agent this many group ranks on (0: none)
        self.name = name or f"{NAME_PREFIX}{os.getpid()}"
        self.path = "\0" + self.name
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._sock.bind(self.path)
        except OSError:
            self._sock.close()
            raise
        self._sock.listen(64)
        self._threads = [
            threading.Thread(target=self._accept_loop, name="fe-ckpt-accept", daemon=True),
            threading.Thread(target=self._seal_loop, name="fe-ckpt-seal", daemon=True),
            threading.Thread(target=self._write_loop, name="fe-ckpt-disk", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ the agent's calls

    def start_round(self, local_world_size: int, agree: Any = None,
                    ranks: Optional[dict[int, int]] = None, world: int = 0) -> None:
        """A new start of the workers: fixes the round's restore step (in a thread: it overlaps
        the workers' start; their requests wait for it).

        Args:
            agree: in a job of several nodes, ``agree(held) -> (RestorePick, my index, every
                agent's Held)`` (see :mod:`._across`): publishes this agent's holdings and
                applies the rule to every agent's; None: the rule on this node alone.
            ranks: each local rank's global rank in this round; world: the world size.
        """
        with self._cond:
            self._round += 1
            self._local_world = local_world_size
            self._agree = agree
            self._globals = dict(ranks or {})
            self._world = world
            self._unserved = {}
            self._broken = False
            for bufs in self._ranks.values():
                for b in bufs:
                    if b.state == WRITING:  # its writer is gone: half a shard
                        b.state = BAD
            self._restore = None
            # the write under way and the step waiting for the disk hold the step of the
            # failure: the new round's saves never give them up
            self._abort = threading.Event()
            if self._pending is not None:
                self._protect = True
            self._queued = -1  # the new round may save a step again (one it could not restore)
            self._fixed = agree is None and not any(
                b.valid() for bufs in self._ranks.values() for b in bufs)
            rnd = self._round
            self._cond.notify_all()
        if not self._fixed:
            threading.Thread(target=self._fix_round, args=(rnd,), name="fe-ckpt-fix",
                             daemon=True).start()

    def held(self) -> int:
        with self._cond:
            return sum(b.capacity for bufs in self._ranks.values() for b in bufs)

    def restore_step(self, timeout: float = _WAIT_S) -> Optional[int]:
        """The step this round restores (None: nothing to restore), once it is fixed."""
        with self._cond:
            self._wait_fixed(timeout)
            return self._restore[0] if self._restore else None

    def wait_sealed(self, timeout: float = _WAIT_S) -> None:
        """Returns once no committed shard awaits its MAC."""
        with self._cond:
            if not self._cond.wait_for(self._all_sealed, timeout):
                raise CheckpointError(f"shards still unsealed after {timeout:.0f} s")

    def buffers(self, local_rank: int) -> list[tuple[str, int, int, Optional[mmap.mmap]]]:
        """(state, step, generation, mapping) of each buffer of ``local_rank`` (for tests)."""
        with self._cond:
            return [(b.state, b.step, b.gen, b.mm) for b in self._ranks.get(local_rank, [])]

    def disk_status(self, step: int) -> Optional[str]:
        with self._cond:
            return self._disk.get(step)

    def drain(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for every sealed step given to the disk to be written
        (or skipped, or failed); True when none is left."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._cond.wait_for(self._all_sealed, max(0.0, deadline - time.monotonic()))
            return self._cond.wait_for(
                lambda: self._closed or (self._pending is None and self._writing is None),
                max(0.0, deadline - time.monotonic()))

    def close(self, drain_timeout: Optional[float] = None) -> None:
        """Waits up to ``drain_timeout`` s (default: the owner's) for the disk write under way
        and the newest step waiting for it, then ends the channel and frees every buffer (the
        agent's end)."""
        budget = self.drain_timeout if drain_timeout is None else drain_timeout
        with self._cond:
            busy = self._pending is not None or self._writing is not None or not self._all_sealed()
        if busy and budget > 0:
            t0 = time.monotonic()
            logger.info("checkpoint disk: the exit waits up to %.0f s for the write of the newest "
                        "step (%s)", budget, DRAIN_ENV)
            if self.drain(budget):
                logger.info("checkpoint disk: written before the exit (%.1f s)",
                            time.monotonic() - t0)
        with self._cond:
            left = self._writing if self._writing is not None else (
                self._pending[0] if self._pending else None)
            if left is not None:
                logger.error("checkpoint disk: step %s not written: the exit's budget of %.0f s "
                             "ran out (--checkpoint-drain-timeout / %s); the disk keeps the last "
                             "step written whole", left, budget, DRAIN_ENV)
        self._stop.set()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            conns = list(self._conns)
        self._seals.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in self._threads:
            t.join(timeout=5)
        if self.copier is not None:
            self.copier.close()
        for pool in (self._pool, self._seal_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        with self._cond:
            for bufs in self._ranks.values():
                for b in bufs:
                    b.release()
            self._ranks.clear()

    # ------------------------------------------------------------------ the round's step

    def _all_sealed(self) -> bool:
        return self._closed or not any(
            b.state == COMMITTED for bufs in self._ranks.values() for b in bufs)

    def _fix_round(self, rnd: int) -> None:
        if self._agree is not None:
            self._fix_across(rnd)
            return
        t0 = time.monotonic()
        with self._cond:
            lws = self._local_world
            steps: Optional[set[int]] = None
            for lr in range(lws):
                have = {b.step for b in self._ranks.get(lr, []) if b.valid()}
                steps = have if steps is None else steps & have
        chosen: Optional[tuple[int, dict[int, int]]] = None
        for step in sorted(steps or (), reverse=True):
            with self._cond:
                picks = {lr: next(i for i, b in enumerate(self._ranks[lr])
                                  if b.valid() and b.step == step) for lr in range(lws)}
            ok = [self._check(lr, idx) for lr, idx in picks.items()]  # each on the pool
            if all(ok):
                chosen = (step, picks)
                break
        with self._cond:
            if self._round != rnd:
                return
            self._restore = chosen
            self._fixed = True
            self.last_restore = {"step": chosen[0] if chosen else None,
                                 "verify_s": time.monotonic() - t0}
            self._cond.notify_all()
        if chosen:
            logger.info("checkpoint memory: this round restores step %s on every local rank "
                        "(%.3f s to check)", chosen[0], time.monotonic() - t0)

    def _fix_across(self, rnd: int) -> None:
        """The round's step across nodes: each sealed shard here has its MAC checked, is
        published with the other agents' (``self._agree``), and the rule's pick is served
        where this node holds it. Shards of later steps are dropped: the job went back to the
        pick, so they belong to a timeline no rank continues."""
        from fastelastic.rendezvous.fast._schema import Held, HeldShard

        t0 = time.monotonic()
        with self._cond:
            cands = [(lr, i) for lr, bufs in self._ranks.items() for i, b in enumerate(bufs)
                     if b.state in (COMMITTED, SEALED) and b.world > 0]
            agree, era, lws = self._agree, self.era, self._local_world
        good = [c for c in cands if self._check(*c)]  # never publish a shard that fails
        with self._cond:
            shards = tuple(HeldShard(b.rank, b.world, b.step, b.era, b.gen)
                           for b in (self._ranks[lr][i] for lr, i in good) if b.state == SEALED)
        copier = self.copier
        if copier is not None:
            shards += tuple(HeldShard(c[0], c[1], c[2], c[3], c[4], True) for c in copier.held())
        picks: dict[int, int] = {}
        unserved: dict[int, str] = {}
        step: Optional[int] = None
        fetch: dict[int, tuple[int, str]] = {}  # local rank -> (global rank, where its shard is)
        try:
            pick, me, helds = agree(Held(era, shards, addr=copier.address if copier else ""))
            if copier is not None:
                n = len(helds)
                to = (me + self.copy_to) % n if self.copy_to and n > 1 else me
                peer = helds[to] if to != me else None
                copier.set_target(peer.addr if peer is not None and peer.addr else None)
        except Exception as e:  # noqa: BLE001 - the round cannot fix a step: say why, serve none
            why = (f"the restore step across nodes could not be fixed ({type(e).__name__}: "
                   f"{e}); this round restores nothing and saves nothing")
            logger.error("checkpoint memory: %s", why)
            unserved = {lr: why for lr in range(lws)}
            step = -1
        else:
            step = pick.step
            with self._cond:
                for lr in range(lws) if step is not None else ():
                    g = self._globals.get(lr, -1)
                    src = pick.sources.get(g)
                    idx = next((i for i, b in enumerate(self._ranks.get(lr, ()))
                                if b.state == SEALED and (b.step, b.era, b.rank, b.world)
                                == (step, pick.step_era, g, pick.world)), None)
                    if pick.world != self._world:
                        unserved[lr] = (f"step {step} was saved by a world of {pick.world} ranks "
                                        f"and this round has {self._world}: restoring it from "
                                        "memory into another world is not built yet")
                    elif src is not None and src == (me, False) and idx is not None:
                        picks[lr] = idx
                    elif (src is not None and src[0] != me and copier is not None
                          and helds[src[0]] is not None and helds[src[0]].addr):  # type: ignore
                        fetch[lr] = (g, helds[src[0]].addr)  # type: ignore[union-attr]
                    else:
                        where = (f"node {src[0]}'s memory ({'a copy' if src[1] else 'its own'})"
                                 if src is not None else "no memory")
                        unserved[lr] = (f"global rank {g}'s shard of step {step} is in {where}, "
                                        "not this local rank's: restoring it from there is not "
                                        "built yet")
        for lr, (g, addr) in fetch.items():  # a replaced node: from the copy's agent, over TCP
            try:
                picks[lr] = self._fetch(lr, g, pick.step, pick.step_era, pick.world, addr)
            except Exception as e:  # noqa: BLE001 - said in one line; this rank cannot restore
                unserved[lr] = (f"global rank {g}'s shard of step {step} could not be fetched "
                                f"from {addr}: {e}")
        with self._cond:
            if self._round != rnd:
                return
            if step is not None and step >= 0:
                if copier is not None:
                    copier.drop_after(step)
                self.era = pick.era
                for bufs_lr, bufs in self._ranks.items():
                    for i, b in enumerate(bufs):
                        if b.valid() and b.step > step and (bufs_lr, i) not in self._pins:
                            b.state = BAD
            elif step is None:
                self.era = pick.era
            self._unserved = unserved
            self._restore = None if step is None else (step, picks)
            self._broken = step == -1
            self._fixed = True
            self.last_restore = {"step": step, "verify_s": time.monotonic() - t0}
            self._cond.notify_all()
        if copier is not None:
            logger.info("checkpoint copy: %s", copier.summary())
        if step is not None and step >= 0:
            logger.info("checkpoint memory: this round restores step %s on every rank (%s local "
                        "ranks served here; %.3f s to check and agree)", step, len(picks),
                        time.monotonic() - t0)
            for lr, why in sorted(unserved.items()):
                logger.error("checkpoint memory: local rank %s: %s", lr, why)

    def _fetch(self, lr: int, g: int, step: Any, era: int, world: int, addr: str) -> int:
        """Fetches global rank ``g``'s shard of ``step`` from the agent at ``addr`` into a
        buffer of local rank ``lr``; its MAC is checked before any worker may map it.
        Returns the buffer's index.

        Raises:
            CheckpointError, CopyError, OSError: not fetched (the message says why).
        """
        t0 = time.monotonic()
        with self._cond:
            bufs = self._ranks.setdefault(lr, [_Buf(), _Buf()])
            idx = next((i for i, b in enumerate(bufs) if not b.valid()), 0)
            bufs[idx].state = WRITING

        def sink(head: dict[str, Any]) -> Any:
            with self._cond:
                if bufs[idx].capacity < int(head["total"]):
                    self._grow(lr, bufs, idx, int(head["total"]))
                return bufs[idx].mm

        try:
            head = self.copier.fetch(addr, g, int(step), era, sink)
            b = bufs[idx]
            assert b.mm is not None
            h = _format.unpack_header(b.mm, b.capacity)
            with self._cond:
                b.step, b.gen, b.total, b.mac = h.step, h.generation, h.total, h.mac
                b.era, b.world, b.rank, b.dcp = era, world, h.rank, None
                b.state = SEALED
                self._gen = max(self._gen, h.generation)
            if (h.step, h.rank, h.local_rank, int(head["gen"])) != (step, g, lr, h.generation):
                raise CheckpointError(f"the fetched shard is step {h.step} of rank {h.rank} "
                                      f"(local rank {h.local_rank})")
            if not self._verify(lr, idx):
                raise CheckpointError("the fetched shard failed its MAC")
        except BaseException:
            with self._cond:
                bufs[idx].state = BAD
            raise
        logger.info("checkpoint memory: local rank %s restores step %s from %s's memory (%s in "
                    "%.3f s)", lr, step, addr, _room.fmt_bytes(h.total), time.monotonic() - t0)
        return idx

    def _check(self, lr: int, idx: int) -> bool:
        """A candidate of the round's step: a shard whose seal is still due (the niced seal
        thread may lag behind) is sealed now, at the agent's priority, and that seal is its
        check (no worker writes a buffer before the round is fixed); a sealed one is verified."""
        with self._cond:
            b = self._ranks[lr][idx]
            state, gen = b.state, b.gen
        if state == COMMITTED and self._seal(lr, idx, gen, self._hash_pool()):
            return True
        return self._verify(lr, idx)

    def _verify(self, lr: int, idx: int) -> bool:
        """Recomputes a sealed shard's MAC; a mismatch marks it BAD (never to be unpickled)."""
        with self._cond:
            b = self._ranks[lr][idx]
            mm, capacity, step, gen, mac = b.mm, b.capacity, b.step, b.gen, b.mac
            b.hashing += 1
        try:
            assert mm is not None
            h = _format.unpack_header(mm, capacity)
            if (h.step, h.generation, h.local_rank) != (step, gen, lr):
                raise ShardError(f"header says step {h.step} generation {h.generation} rank "
                                 f"{h.local_rank}; the agent wrote step {step} generation {gen}")
            import hmac

            if not hmac.compare_digest(
                    _format.compute_mac(self._key, mm, h.total, self._hash_pool()), mac):
                raise ShardError("its MAC does not match")
        except ShardError as e:
            logger.error("checkpoint memory: local rank %s's shard of step %s rejected: %s",
                         lr, step, e)
            with self._cond:
                if b.gen == gen:
                    b.state = BAD
            return False
        finally:
            with self._cond:
                b.hashing -= 1
                self._cond.notify_all()
        return True

    def _wait_fixed(self, timeout: float) -> None:
        if not self._cond.wait_for(lambda: self._fixed or self._closed, timeout):
            raise CheckpointError(f"the restore step was not fixed within {timeout:.0f} s")
        if self._closed:
            raise CheckpointError("the agent is shutting down")

    # ------------------------------------------------------------------ seals

    def _hash_pool(self, seal: bool = False) -> Any:
        """The threads that hash a shard's chunks at once (made at first use). The seals'
        threads run niced (``_SEAL_NICE``): a seal is behind training, and a save's copy, the
        workers' steps and the restore's check go first."""
        with self._cond:
            pool = self._seal_pool if seal else self._pool
            if pool is None:
                from concurrent.futures import ThreadPoolExecutor

                pool = ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1),
                                          thread_name_prefix="fe-ckpt-seal" if seal
                                          else "fe-ckpt-hash",
                                          initializer=_lower_priority if seal else None)
                if seal:
                    self._seal_pool = pool
                else:
                    self._pool = pool
            return pool

    def _seal_loop(self) -> None:
        _lower_priority()
        while True:
            item = self._seals.get()
            if item is None:
                return
            self._seal(*item, self._hash_pool(seal=True))

    def _seal(self, lr: int, idx: int, gen: int, pool: Any) -> bool:
        """Writes the MAC of buffer ``idx`` of ``lr`` if it still holds generation ``gen``,
        committed; True when this call sealed it."""
        with self._cond:
            b = self._ranks[lr][idx]
            if b.state != COMMITTED or b.gen != gen or b.mm is None:
                return False
            mm, total = b.mm, b.total
            b.hashing += 1
        try:  # a newer save into this buffer stops the hashing at its next chunk
            mac = _format.compute_mac(self._key, mm, total, pool,
                                      lambda: b.gen != gen or self._closed)
        except ShardError:
            return False
        finally:
            with self._cond:
                b.hashing -= 1
                self._cond.notify_all()
        with self._cond:  # a shard overwritten meanwhile (a newer save) keeps no MAC
            if b.state != COMMITTED or b.gen != gen or self._closed:
                return False
            mm[_format.MAC_OFFSET:_format.MAC_OFFSET + _format.MAC_SIZE] = mac
            b.mac = mac
            b.state = SEALED
            self._queue_disk(b.step)
            self._cond.notify_all()
            copier = self.copier if self._agree is not None else None
        if copier is not None:
            copier.offer(lr, idx, gen)  # behind training: the save never waits for it
        return True

    # ------------------------------------------------------------------ the disk

    def _set_status(self, step: int, status: str) -> None:
        self._disk[step] = status
        while len(self._disk) > _STATUS_KEEP:
            del self._disk[min(self._disk)]
        self._cond.notify_all()

    def _queue_disk(self, step: int) -> None:
        """Gives ``step`` to the disk once every local rank's shard of it is sealed (lock held).
        A step still waiting for the disk is skipped for it."""
        if step <= self._queued:
            return
        picks: dict[int, int] = {}
        for lr in range(self._local_world):
            idx = next((i for i, x in enumerate(self._ranks.get(lr, []))
                        if x.state == SEALED and x.step == step), None)
            if idx is None:
                return
            picks[lr] = idx
        plans = [self._ranks[lr][i].dcp for lr, i in picks.items()]
        self._disk.pop(step, None)  # a step saved again (a new round): this save's status
        if all(p is None for p in plans):
            self._set_status(step, MEMORY)
            return
        self._queued = step
        why = None
        if any(p is None for p in plans):
            why = "not every local rank gave a checkpoint_id"
        elif len({(p["path"], p["world"], p["version"]) for p in plans if p}) != 1:
            why = "the local ranks gave different checkpoint_ids"
        elif plans[0] and plans[0]["world"] != self._local_world:
            why = (f"the world has {plans[0]['world']} ranks and this node {self._local_world}: "
                   "a job of several nodes is written to disk by a later fastelastic")
        if why is not None:
            logger.error("checkpoint disk: step %s not written: %s", step, why)
            self._set_status(step, f"failed: {why}")
            return
        if self._pending is not None:
            self._set_status(self._pending[0], SKIPPED)
            logger.info("checkpoint disk: step %s skipped: step %s is whole first",
                        self._pending[0], step)
        self._pending = (step, picks)
        self._cond.notify_all()

    def _write_loop(self) -> None:
        from fastelastic.checkpoint import _disk

        # The lock is held from a write's end to the next write's start: the step waiting for
        # the disk is taken before a save woken by the pins' release can make it skipped.
        with self._cond:
            while True:
                self._cond.wait_for(lambda: self._closed or self._pending is not None)
                if self._closed or self._pending is None:
                    return
                step, picks = self._pending
                self._pending = None
                files: dict[int, list[tuple[Any, int, int]]] = {}
                metas: dict[int, tuple[bytes, bytes, bytes]] = {}
                plan: dict[str, Any] = {}
                for lr, idx in picks.items():
                    b = self._ranks[lr][idx]
                    assert b.mm is not None and b.dcp is not None
                    plan = b.dcp
                    files[plan["rank"]] = [(b.mm, off, n) for off, n in plan["file"]]
                    m0, m1, m2 = (bytes(b.mm[off:off + n]) for off, n in plan["meta"])
                    metas[plan["rank"]] = (m0, m1, m2)
                    self._pins.add((lr, idx))
                self._writing = step
                self._abort = abort = threading.Event()
                if self._protect:
                    abort = threading.Event()  # never set: this write is not given up
                t0 = time.monotonic()
                status, nbytes = WRITTEN, 0
                self._cond.release()
                try:
                    pacer = _disk.Pacer(self._rate, abort, self._stop)
                    nbytes = _disk.write_step(step, plan["path"], plan["world"],
                                              plan["version"], files, metas, pacer)
                except _disk.Skipped:
                    status = SKIPPED
                except OSError as e:
                    status = f"failed: {plan['path']}: {e.strerror or e}"
                finally:
                    self._cond.acquire()
                dt = time.monotonic() - t0
                self._pins.difference_update((lr, idx) for lr, idx in picks.items())
                self._writing = None
                self._protect = status == SKIPPED
                self._set_status(step, status)
                if status == WRITTEN:
                    self.last_write = {"step": step, "bytes": nbytes, "seconds": dt}
                    logger.info("checkpoint disk: step %s written to %s (%s in %.2f s)", step,
                                plan["path"], _room.fmt_bytes(nbytes), dt)
                elif status == SKIPPED:
                    logger.info("checkpoint disk: step %s skipped after %.2f s: a newer step "
                                "needs its memory", step, dt)
                else:
                    logger.error("checkpoint disk: step %s %s", step, status)

    # ------------------------------------------------------------------ the channel

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            _pid, uid = peer(conn)
            if uid != os.getuid():
                logger.warning("checkpoint channel: refused a process of uid %s", uid)
                conn.close()
                continue
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="fe-ckpt-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                try:
                    msg, fds, _flags, _addr = socket.recv_fds(conn, _MAX_PACKET, 4)
                except OSError:
                    return
                for fd in fds:
                    os.close(fd)
                if not msg:
                    return
                send_fd = -1
                try:
                    req = json.loads(msg)
                    reply, send_fd = self._handle(req)
                except CheckpointError as e:
                    reply = {"error": str(e)}
                except (ValueError, KeyError, TypeError) as e:
                    reply = {"error": f"bad checkpoint request: {e!r}"}
                try:
                    socket.send_fds(conn, [json.dumps(reply).encode()],
                                    [send_fd] if send_fd >= 0 else [])
                except OSError:
                    return
        finally:
            with self._cond:
                self._conns.discard(conn)
            conn.close()

    def _handle(self, req: dict[str, Any]) -> tuple[dict[str, Any], int]:
        op = req["op"]
        with self._cond:
            self._wait_fixed(_WAIT_S)
            if self._broken and op in ("reserve", "restore"):
                raise CheckpointError(self._unserved.get(0, "the round's step was not fixed"))
            if op == "reserve":
                return self._reserve(int(req["local_rank"]), int(req["step"]),
                                     int(req["nbytes"]), [int(c) for c in req["mapped"]])
            if op == "commit":  # with "wait": and then as "wait" for its step (one trip)
                reply = self._commit(int(req["local_rank"]), int(req["slot"]), int(req["gen"]))
                if req.get("wait"):
                    t0 = time.monotonic()
                    out, fd = self._wait_step(reply[0]["step"], float(req.get("timeout", _WAIT_S)))
                    out["waited_s"] = time.monotonic() - t0  # for the other local ranks
                    return out, fd
                return reply
            if op == "wait":
                return self._wait_step(int(req["step"]), float(req.get("timeout", _WAIT_S)))
            if op == "restore":
                return self._restore_reply(int(req["local_rank"]))
            if op == "disk":
                return self._disk_reply(int(req["step"]), float(req.get("timeout", _WAIT_S)))
        raise CheckpointError(f"unknown checkpoint request {op!r}")

    def _reserve(self, lr: int, step: int, nbytes: int,
                 mapped: list[int]) -> tuple[dict[str, Any], int]:
        if not 0 <= lr < max(self._local_world, 1):
            raise CheckpointError(f"local rank {lr} is not one of this node's "
                                  f"{self._local_world} ranks")
        bufs = self._ranks.setdefault(lr, [_Buf(), _Buf()])
        valid = [b for b in bufs if b.valid()]
        newest = max(valid, key=lambda b: b.gen) if valid else None
        idx = 1 - bufs.index(newest) if newest is not None else 0
        b = bufs[idx]
        # b is not the rank's newest shard. Memory only: a seal still due or under way for it
        # is dropped (the seal keeps a MAC only for the generation it hashed, and b's is about
        # to change), so such a save never waits for the hashing of an older step. A step for
        # the disk is sealed first, as the disk writes only sealed steps.
        if b.dcp is not None and not self._cond.wait_for(
                lambda: b.state != COMMITTED or self._closed, _WAIT_S):
            raise CheckpointError("the previous shard was not sealed in time")
        if self._pending is not None and self._pending[1].get(lr) == idx:
            self._set_status(self._pending[0], SKIPPED)  # its memory is about to be reused
            logger.info("checkpoint disk: step %s skipped: step %s needs its memory",
                        self._pending[0], step)
            self._pending = None
        if (lr, idx) in self._pins:  # the disk write reads it: give that write up, or wait
            self._abort.set()
            if not self._cond.wait_for(lambda: (lr, idx) not in self._pins or self._closed,
                                       _WAIT_S):
                raise CheckpointError("the disk write of an older step did not end in time")
        if self._closed:
            raise CheckpointError("the agent is shutting down")
        if b.capacity < nbytes:
            self._grow(lr, bufs, idx, nbytes)
        self._gen += 1
        b.state, b.step, b.gen, b.total, b.mac = WRITING, step, self._gen, 0, b""
        reply = {"slot": idx, "gen": b.gen, "capacity": b.capacity}
        return reply, (b.fd if mapped[idx] != b.capacity else -1)

    def _grow(self, lr: int, bufs: list[_Buf], idx: int, nbytes: int) -> None:
        """Gives buffer ``idx`` room for ``nbytes``; the first time, the other buffer too."""
        cap = (nbytes + _MB - 1) // _MB * _MB
        grow = [i for i in (0, 1) if i == idx or bufs[i].capacity == 0]
        need = sum(cap - bufs[i].capacity for i in grow)
        room = _room.measure()
        held = sum(x.capacity for bs in self._ranks.values() for x in bs)
        why = room.refuse(need, held, self._limit)
        if why is not None:
            raise CheckpointError(f"local rank {lr}: {why}")
        memfd = room.uses_memfd(need)
        if memfd and not self._memfd_said:
            self._memfd_said = True
            logger.warning("checkpoint memory: /dev/shm has %s free, local rank %s needs %s: "
                           "using memfd (the same memory, not limited by /dev/shm's size)",
                           _room.fmt_bytes(room.shm or 0), lr, _room.fmt_bytes(need))
        for i in grow:
            old = bufs[i]
            if old.valid() and i != idx:
                continue
            # a seal of the step it held may still be reading it (a save never waits for an
            # older step's seal): that seal stops at its next chunk
            if not self._cond.wait_for(functools.partial(self._unread, old), _WAIT_S):
                raise CheckpointError(f"local rank {lr}: a seal held the buffer too long")
            old.release()
            try:
                fd, kind = _alloc(cap, memfd)
            except OSError as e:
                raise CheckpointError(
                    f"local rank {lr}: the checkpoint memory could not reserve "
                    f"{_room.fmt_bytes(cap)} ({e.strerror}): free memory or save a smaller "
                    "state per rank") from None
            old.fd, old.capacity, old.kind = fd, cap, kind
            old.mm = mmap.mmap(fd, cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        logger.info("checkpoint memory: local rank %s holds 2 x %s (%s); %s held in all", lr,
                    _room.fmt_bytes(cap), bufs[idx].kind, _room.fmt_bytes(
                        sum(x.capacity for bs in self._ranks.values() for x in bs)))

    def _unread(self, b: _Buf) -> bool:
        return b.hashing == 0 or self._closed

    def _commit(self, lr: int, idx: int, gen: int) -> tuple[dict[str, Any], int]:
        b = self._ranks[lr][idx]
        if b.state != WRITING or b.gen != gen or b.mm is None:
            raise CheckpointError(f"local rank {lr}: commit of a buffer it does not hold "
                                  f"(generation {gen}, the agent's {b.gen} {b.state})")
        try:
            h = _format.unpack_header(b.mm, b.capacity)
            if (h.step, h.generation, h.local_rank) != (b.step, gen, lr):
                raise ShardError(f"header says step {h.step} generation {h.generation} "
                                 f"local rank {h.local_rank}")
        except ShardError as e:
            b.state = BAD
            raise CheckpointError(f"local rank {lr}: malformed shard: {e}") from None
        try:
            b.dcp = _plan_of(b.mm, h)
        except ShardError as e:
            b.state = BAD
            raise CheckpointError(f"local rank {lr}: malformed shard: {e}") from None
        b.total = h.total
        b.era, b.world, b.rank = self.era, self._world, h.rank
        b.state = COMMITTED
        self._seals.put((lr, idx, gen))
        self._cond.notify_all()
        return {"step": b.step}, -1

    def _newest_step(self, lr: int) -> int:
        steps = [b.step for b in self._ranks.get(lr, []) if b.valid()]
        return max(steps) if steps else -1

    def _wait_step(self, step: int, timeout: float) -> tuple[dict[str, Any], int]:
        rnd = self._round

        def done() -> bool:
            return self._closed or self._round != rnd or all(
                self._newest_step(lr) >= step for lr in range(self._local_world))

        ok = self._cond.wait_for(done, timeout)
        if self._closed or self._round != rnd:
            raise CheckpointError("the workers were restarted before every rank saved")
        if not ok:
            missing = [lr for lr in range(self._local_world) if self._newest_step(lr) < step]
            raise CheckpointError(f"local ranks {missing} did not save step {step} within "
                                  f"{timeout:.0f} s (every rank must call save)")
        return {"step": step}, -1

    def _disk_reply(self, step: int, timeout: float) -> tuple[dict[str, Any], int]:
        """Waits until the disk is done with ``step``: written, skipped, memory only (saved
        with no checkpoint_id) or failed."""
        def done() -> bool:
            # once a newer step went to the disk, a step neither written nor waiting never will
            # be (a local rank did not save it)
            return self._closed or step in self._disk or (
                self._queued > step and self._writing != step
                and (self._pending is None or self._pending[0] != step))

        if not self._cond.wait_for(done, timeout):
            raise CheckpointError(f"step {step} was not written to disk within {timeout:.0f} s")
        if step in self._disk:
            return {"step": step, "status": self._disk[step]}, -1
        if self._closed:
            raise CheckpointError("the agent is shutting down")
        return {"step": step, "status": SKIPPED}, -1

    def _restore_reply(self, lr: int) -> tuple[dict[str, Any], int]:
        if self._restore is None:
            return {"step": None}, -1
        step, picks = self._restore
        if lr not in picks:  # the rule across nodes picked a shard this node cannot serve
            raise CheckpointError(self._unserved.get(lr, f"local rank {lr} has no shard of "
                                                     f"step {step} on this node"))
        b = self._ranks[lr][picks[lr]]
        if b.state != SEALED or b.step != step:  # the rank saved over it before loading
            return {"step": None}, -1
        return {"step": step, "slot": picks[lr], "capacity": b.capacity}, b.fd


_SEAL_NICE = 10


def _lower_priority() -> None:
    """This thread at nice +_SEAL_NICE (Linux: per thread; raising it needs no privilege)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       min(19, os.getpriority(os.PRIO_PROCESS, 0) + _SEAL_NICE))
    except OSError:
        pass


def _plan_of(mm: mmap.mmap, h: _format.Header) -> Optional[dict[str, Any]]:
    """The shard's disk plan, its byte ranges checked against the shard (None: no plan)."""
    _entries, dcp = _format.decode_full(mm[h.meta_off:h.meta_off + h.meta_len])
    if dcp is None:
        return None
    try:
        ranges = [(int(a), int(n)) for a, n in dcp["file"]] + [
            (int(a), int(n)) for a, n in dcp["meta"]]
        ok = (isinstance(dcp["path"], str) and isinstance(dcp["version"], str)
              and 0 <= int(dcp["rank"]) < int(dcp["world"]) and len(dcp["meta"]) == 3)
    except (KeyError, TypeError, ValueError) as e:
        raise ShardError(f"its disk plan is malformed: {e!r}") from None
    if not ok or any(a < h.data_off or n < 0 or a + n > h.total for a, n in ranges):
        raise ShardError("its disk plan points outside the shard")
    return dcp


def from_env() -> Optional[MemoryOwner]:
    """An owner for this agent, or None when ``$FASTELASTIC_CHECKPOINT=0``.

    Raises:
        ValueError: ``$FASTELASTIC_CHECKPOINT_MEMORY_LIMIT`` is not a size.
    """
    if os.environ.get(ENABLE_ENV, "").strip() == "0":
        return None
    from fastelastic.store.auth import token_from_env

    raw = os.environ.get(DRAIN_ENV, "").strip()
    try:
        drain = float(raw) if raw else DRAIN_DEFAULT
    except ValueError:
        raise ValueError(f"{DRAIN_ENV}={raw!r}: expected seconds") from None
    rate = os.environ.get(RATE_ENV, "").strip()
    try:
        return MemoryOwner(token=token_from_env(), limit=_room.limit_from_env(),
                           drain_timeout=drain,
                           write_rate=float(_room.parse_bytes(rate)) if rate else 0.0)
    except OSError as e:
        logger.warning("no checkpoint memory for this agent: %s", e)
        return None


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a unix socket."""
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    return pid, uid


def _ancestors(limit: int = 4) -> list[int]:
    """This process's parent, grandparent, ... (``limit`` at most; init excluded)."""
    out: list[int] = []
    pid = os.getpid()
    for _ in range(limit):
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
        out.append(pid)
    return out


def connect(path: str, pid: Optional[int]) -> Optional[socket.socket]:
    """A connection to the channel at ``path`` held by our user (and by ``pid`` if given)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.connect(path)
        got_pid, uid = peer(sock)
    except OSError:
        sock.close()
        return None
    if uid != os.getuid() or (pid is not None and got_pid != pid):
        sock.close()
        return None
    return sock


def find_agent() -> str:
    """The channel of the agent that started this process.

    Raises:
        CheckpointError: no agent among this process's ancestors holds checkpoint memory.
    """
    raw = os.environ.get(SOCKET_ENV, "").strip()
    if raw:
        path = "\0" + raw[1:] if raw.startswith("@") else raw
        sock = connect(path, None)
        if sock is None:
            raise CheckpointError(f"no checkpoint channel of this user at ${SOCKET_ENV}={raw}")
        sock.close()
        return path
    for pid in _ancestors():
        path = f"\0{NAME_PREFIX}{pid}"
        sock = connect(path, pid)
        if sock is not None:
            sock.close()
            return path
    raise CheckpointError(
        "fastelastic.checkpoint keeps the state in the agent's memory: run the script under "
        "fastrun (no agent among this process's ancestors holds checkpoint memory)")


# ---------------------------------------------------------------------- a worker's early map

_MADV_POPULATE_READ = 22  # Linux 5.14: builds the page tables of a range, as reads would


class EarlyMap:
    """The buffer of a restarted worker's restore step, mapped from the package's import on.

    Building the page tables of a buffer costs about half a copy of it (4 KiB pages: /dev/shm
    gets no huge pages). A restarted worker does that in a thread while its script starts
    (imports, the model, the process group), so its ``load`` only copies. The thread asks the
    agent what a load asks (``restore``, which waits for the round's MAC check), maps the
    buffer and populates it with ``madvise`` outside the GIL. Nothing is read from the buffer
    here. The load takes the connection, the reply and the mapping when the process has no
    channel yet (it saved nothing since: the round's step and buffer are as the agent said);
    otherwise it asks again and takes the mapping only for the buffer named then (same file).
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.done = threading.Event()
        self.slot = -1
        self.capacity = 0
        self.ident: Optional[tuple[int, int]] = None  # (st_dev, st_ino) of the buffer
        self.mm: Optional[mmap.mmap] = None
        self.seconds = 0.0  # from the thread's start to the buffer's pages mapped
        self.used = False  # the load took this mapping
        self.path = ""
        self.sock: Optional[socket.socket] = None  # the connection, kept for the load
        self.reply: Optional[dict[str, Any]] = None  # the agent's answer to "restore"

    def run(self, local_rank: int) -> None:
        t0 = time.monotonic()
        sock = None
        try:
            path = find_agent()
            sock = connect(path, None)
            if sock is None:
                return
            sock.settimeout(_WAIT_S)
            sock.sendall(json.dumps({"op": "restore", "local_rank": local_rank}).encode())
            msg, fds, _flags, _addr = socket.recv_fds(sock, _MAX_PACKET, 4)
            sock.settimeout(None)
            try:
                reply = json.loads(msg) if msg else {}
                if "error" in reply or "step" not in reply:
                    return
                if reply["step"] is None:
                    self.path, self.sock, self.reply, sock = path, sock, reply, None
                    return
                if not fds:
                    return
                st = os.fstat(fds[0])
                mm = mmap.mmap(fds[0], int(reply["capacity"]), mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                for fd in fds:
                    os.close(fd)
            _populate(mm)
            self.slot, self.capacity = int(reply["slot"]), int(reply["capacity"])
            self.ident, self.mm = (st.st_dev, st.st_ino), mm
            self.path, self.sock, self.reply, sock = path, sock, reply, None
        except (OSError, CheckpointError, ValueError, KeyError, TypeError):
            pass  # the load maps the buffer itself
        finally:
            if sock is not None:
                sock.close()
            self.seconds = time.monotonic() - t0
            self.done.set()

    def take(self, slot: int, capacity: int, ident: tuple[int, int]) -> Optional[mmap.mmap]:
        """The mapping, if it is of this buffer (waits for the thread); else None."""
        self.done.wait(_WAIT_S)
        mm, self.mm = self.mm, None
        if mm is not None and (self.slot, self.capacity, self.ident) == (slot, capacity, ident):
            self.used = True
            return mm
        if mm is not None:
            mm.close()
        return None


def _populate(mm: mmap.mmap) -> None:
    """Builds ``mm``'s page tables now (MADV_POPULATE_READ through ctypes, which lets go of the
    GIL; Python's own mmap calls keep it). On a kernel without it the pages fault in later."""
    import ctypes

    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    anchor = ctypes.c_char.from_buffer(mm)
    try:
        madvise(ctypes.addressof(anchor), len(mm), _MADV_POPULATE_READ)
    finally:
        del anchor


_early: Optional[EarlyMap] = None


def start_early_map() -> None:
    """In a restarted worker (``TORCHELASTIC_RESTART_COUNT`` > 0, ``LOCAL_RANK`` set), starts
    mapping its restore buffer in a thread (``EarlyMap``); elsewhere (the agent, a first start,
    ``FASTELASTIC_CHECKPOINT=0``) does nothing."""
    global _early
    env = os.environ
    if (_early is not None or env.get(ENABLE_ENV, "").strip() == "0"
            or env.get("TORCHELASTIC_RESTART_COUNT", "0").strip() in ("", "0")
            or not env.get("LOCAL_RANK", "").strip().isdigit()):
        return
    _early = EarlyMap()
    threading.Thread(target=_early.run, args=(int(env["LOCAL_RANK"]),), name="fe-ckpt-early",
                     daemon=True).start()


def take_early_map() -> Optional[EarlyMap]:
    """The early map of this process, once (None: none was started here, e.g. before a fork)."""
    global _early
    e, _early = _early, None
    return e if e is not None and e.pid == os.getpid() else None
