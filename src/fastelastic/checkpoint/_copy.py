"""The copy of each local shard on another node's agent, and its fetch back: one TCP port per
agent.

After a shard is sealed, the agent sends it to the agent of another node (by default the next
in group-rank order, ``--checkpoint-copy-to``), behind training: a sender thread takes the
newest sealed shard of each local rank, so a save never waits for a copy. The receiving agent
keeps two copies per rank (the newest two that arrived) and serves them back (``get``) to a
replaced node's agent.

Connection rules, the store's: the server sends a random challenge; the client answers
HMAC-SHA256(key, CONTEXT + challenge), the key being the job's store token (without one, a
fixed key: any process that reaches the port may copy, as anyone may use a store without a
token). Every frame is bounded: a JSON head of at most ``_MAX_HEAD`` bytes, then ``total`` bytes
read in 1 MiB chunks straight into a buffer of the receiver's own, reserved whole before the
first byte is read, after ``total`` was checked against the memory room. A copy whose MAC (the
shard's, recomputed by the receiver under the same key) fails is dropped: it is never held, so
never served, never unpickled. The sender is paced (``FASTELASTIC_CHECKPOINT_COPY_RATE``,
bytes a second); sender and receiver add up their own CPU time (``stats``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import mmap
import os
import queue
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Optional

from fastelastic.checkpoint import _format, _room

__all__ = ["COPY_TO_ENV", "COPY_RATE_ENV", "Copier", "parse_copy_to", "CopyError"]

logger = logging.getLogger("fastelastic.checkpoint")

COPY_TO_ENV = "FASTELASTIC_CHECKPOINT_COPY_TO"  # next (default) | +K | off
COPY_RATE_ENV = "FASTELASTIC_CHECKPOINT_COPY_RATE"  # bytes a second (e.g. 500M); unpaced
CONTEXT = b"fastelastic.checkpoint.copy/1"
_MAX_HEAD = 4096
_CHUNK = 1 << 20
_IO_TIMEOUT_S = 30.0  # a peer that sends or reads nothing for this long is dropped
_MB = 1 << 20


class CopyError(RuntimeError):
    """A copy or a fetch that failed (the message says why, in one line)."""


def parse_copy_to(raw: str) -> int:
    """``next`` -> 1, ``+K`` -> K, ``off`` -> 0.

    Raises:
        ValueError: anything else.
    """
    raw = raw.strip().lower()
    if raw in ("", "next"):
        return 1
    if raw in ("off", "none", "0"):
        return 0
    if raw.startswith("+") and raw[1:].isdigit() and int(raw[1:]) > 0:
        return int(raw[1:])
    raise ValueError(f"--checkpoint-copy-to {raw!r}: expected next, +K (the K-th next node in "
                     "rank order) or off")


# ---------------------------------------------------------------------- frames


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise CopyError("the peer closed the connection")
        got += k
    return bytes(buf)


def _send_head(sock: socket.socket, head: dict[str, Any]) -> None:
    raw = json.dumps(head, separators=(",", ":")).encode()
    sock.sendall(struct.pack("<I", len(raw)) + raw)


def _recv_head(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > _MAX_HEAD:
        raise CopyError(f"a head of {n} bytes (at most {_MAX_HEAD})")
    head = json.loads(_recv_exact(sock, n))
    if not isinstance(head, dict):
        raise CopyError("a head that is not an object")
    return head


def _recv_into(sock: socket.socket, mm: Any, total: int) -> None:
    view = memoryview(mm)
    try:
        got = 0
        while got < total:
            k = sock.recv_into(view[got:got + min(_CHUNK, total - got)])
            if k == 0:
                raise CopyError("the peer closed the connection mid-shard")
            got += k
    finally:
        view.release()


def _send_from(sock: socket.socket, mm: Any, total: int,
               pace: Optional[Callable[[int], None]] = None) -> None:
    view = memoryview(mm)
    try:
        for off in range(0, total, _CHUNK):
            n = min(_CHUNK, total - off)
            if pace is not None:
                pace(n)
            sock.sendall(view[off:off + n])
    finally:
        view.release()


def _sendfile(sock: socket.socket, fd: int, total: int,
              pace: Optional[Callable[[int], None]] = None) -> None:
    off = 0
    while off < total:
        n = min(_CHUNK, total - off)
        if pace is not None:
            pace(n)
        try:
            sent = os.sendfile(sock.fileno(), fd, off, n)
        except BlockingIOError:  # a socket with a timeout is non-blocking underneath
            if not select.select([], [sock], [], _IO_TIMEOUT_S)[1]:
                raise CopyError(f"the peer read nothing for {_IO_TIMEOUT_S:.0f} s") from None
            continue
        if sent == 0:
            raise CopyError("the buffer ended before the shard")
        off += sent


def _answer(key: bytes, challenge: bytes) -> bytes:
    return hmac.new(key, CONTEXT + challenge, hashlib.sha256).digest()


class _Copy:
    """A copy this agent holds for another node's rank (every field under the copier's lock)."""

    def __init__(self) -> None:
        self.fd = -1
        self.mm: Optional[mmap.mmap] = None
        self.capacity = 0
        self.valid = False
        self.busy = 0  # fetches reading it: an arriving copy takes the other slot
        self.rank = self.world = self.step = self.era = self.gen = -1
        self.total = 0
        self.arrived = 0

    def release(self) -> None:
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.capacity = 0
        self.valid = False


class Copier:
    """One agent's copy port: receives and serves copies, sends its own shards' copies.

    Args:
        owner: the agent's ``MemoryOwner`` (its shards, key and limit).
        host: the address to listen on and publish (this node's address on the job's network).
        rate: bytes a second the sender may take (0: unpaced).
    """

    def __init__(self, owner: Any, host: str = "0.0.0.0", rate: float = 0.0,
                 advertise: Optional[str] = None) -> None:
        from fastelastic.checkpoint._owner import _alloc

        self._alloc = _alloc
        self.owner = owner
        self.key: bytes = owner._key
        self.rate = rate
        self.lock = threading.Condition()
        self.copies: dict[int, list[_Copy]] = {}
        self.arrivals = 0
        self.cpu_s = {"send": 0.0, "receive": 0.0, "serve": 0.0}
        self.sent = {"bytes": 0, "copies": 0, "dropped": 0}
        self.last_copied: dict[int, int] = {}  # local rank -> newest step the target holds
        self.target: Optional[str] = None
        self._offers: dict[int, tuple[int, int]] = {}  # local rank -> (buffer, gen), newest
        self._wake = queue.Queue()  # type: queue.Queue[Optional[int]]
        self._stop = threading.Event()
        self._sock = socket.create_server((host, 0), backlog=16)
        port = self._sock.getsockname()[1]
        self.address = f"{advertise or socket.gethostname()}:{port}"
        self._conn: Optional[socket.socket] = None
        self._conn_to: Optional[str] = None
        self._threads = [
            threading.Thread(target=self._accept_loop, name="fe-ckpt-copy-accept", daemon=True),
            threading.Thread(target=self._send_loop, name="fe-ckpt-copy-send", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ the owner's calls

    def set_target(self, address: Optional[str]) -> None:
        with self.lock:
            self.target = address
            self.lock.notify_all()

    def offer(self, lr: int, idx: int, gen: int) -> None:
        """A sealed shard of local rank ``lr`` (buffer ``idx``, generation ``gen``) to copy."""
        with self.lock:
            self._offers[lr] = (idx, gen)
        self._wake.put(lr)

    def held(self) -> list[tuple[int, int, int, int, int]]:
        """(rank, world, step, era, gen) of every copy held here."""
        with self.lock:
            return [(c.rank, c.world, c.step, c.era, c.gen) for cs in self.copies.values()
                    for c in cs if c.valid]

    def drop_after(self, step: int) -> None:
        """Drops the copies of steps past ``step`` (the job went back to it)."""
        with self.lock:
            for cs in self.copies.values():
                for c in cs:
                    if c.valid and c.step > step and not c.busy:
                        c.valid = False

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return {"cpu_s": dict(self.cpu_s), **self.sent,
                    "held": sum(c.capacity for cs in self.copies.values() for c in cs)}

    def summary(self) -> str:
        """One line: copies sent and dropped, bytes, copies held here and this port's CPU time."""
        st = self.stats()
        cpu = st["cpu_s"]
        return (f"{st['copies']} copies sent ({_room.fmt_bytes(st['bytes'])}), {st['dropped']} "
                f"dropped; {_room.fmt_bytes(st['held'])} of copies held for another node; CPU "
                f"{cpu['send']:.2f} s sending, {cpu['serve']:.2f} s receiving and serving, "
                f"{cpu['receive']:.2f} s fetching")

    def close(self) -> None:
        logger.info("checkpoint copy: %s", self.summary())
        self._stop.set()
        self._wake.put(None)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for t in self._threads:
            t.join(timeout=5)
        with self.lock:
            if self._conn is not None:
                self._conn.close()
            for cs in self.copies.values():
                for c in cs:
                    c.release()
            self.copies.clear()

    # ------------------------------------------------------------------ sending

    def _connect(self, address: str) -> socket.socket:
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=_IO_TIMEOUT_S)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = _recv_exact(sock, 32)
            sock.sendall(_answer(self.key, challenge))
            reply = _recv_head(sock)
            if not reply.get("ok"):
                raise CopyError(f"the agent at {address} refused: {reply.get('error')}")
        except BaseException:
            sock.close()
            raise
        return sock

    def _send_loop(self) -> None:
        while True:
            lr = self._wake.get()
            if lr is None or self._stop.is_set():
                return
            with self.lock:
                offer = self._offers.pop(lr, None)
                target = self.target
            if offer is None or target is None:
                continue
            t0 = time.thread_time()
            try:
                self._send_one(lr, offer, target)
            except (OSError, CopyError, ValueError) as e:
                with self.lock:
                    self.sent["dropped"] += 1
                    if self._conn is not None:
                        self._conn.close()
                    self._conn = None
                logger.warning("checkpoint copy: local rank %s's shard not copied to %s: %s",
                               lr, target, e)
            finally:
                with self.lock:
                    self.cpu_s["send"] += time.thread_time() - t0

    def _send_one(self, lr: int, offer: tuple[int, int], target: str) -> None:
        from fastelastic.checkpoint._owner import SEALED

        idx, gen = offer
        own = self.owner
        with own._cond:
            b = own._ranks[lr][idx]
            if b.state != SEALED or b.gen != gen or b.mm is None:
                return  # a newer save took the buffer: its own offer follows
            # its own descriptor of the buffer: a save that grows it meanwhile replaces the file
            # and leaves this one whole (closed below); one that writes over it in place
            # changes the bytes, and the receiver's MAC check drops that copy
            fd, total = os.dup(b.fd), b.total
            head = {"op": "put", "rank": b.rank, "world": b.world, "step": b.step,
                    "era": b.era, "gen": b.gen, "total": total, "mac": b.mac.hex()}
        with self.lock:
            if self._conn is None or self._conn_to != target:
                if self._conn is not None:
                    self._conn.close()
                self._conn, self._conn_to = None, None
        if self._conn is None:
            conn = self._connect(target)
            with self.lock:
                self._conn, self._conn_to = conn, target
        conn = self._conn
        assert conn is not None
        pace = None
        if self.rate > 0:
            from fastelastic.checkpoint._disk import Pacer

            pace = Pacer(self.rate, threading.Event(), self._stop)
        try:
            _send_head(conn, head)
            _sendfile(conn, fd, total, pace)  # the kernel copies: no pass through this process
        finally:
            os.close(fd)
        reply = _recv_head(conn)
        if not reply.get("ok"):
            raise CopyError(str(reply.get("error")))
        with self.lock:
            self.sent["bytes"] += total
            self.sent["copies"] += 1
            self.last_copied[lr] = head["step"]
        logger.debug("checkpoint copy: step %s of rank %s copied to %s (%s)", head["step"],
                     head["rank"], target, _room.fmt_bytes(total))

    def fetch(self, address: str, rank: int, step: int, era: int,
              sink: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
        """Fetches the copy of ``rank``'s ``step`` of ``era`` from the agent at ``address``;
        ``sink(head)`` gives the buffer to read ``head["total"]`` bytes into. Returns the
        head (its ``mac`` checked by the caller)."""
        t0 = time.thread_time()
        sock = self._connect(address)
        try:
            _send_head(sock, {"op": "get", "rank": rank, "step": step, "era": era})
            head = _recv_head(sock)
            if "error" in head:
                raise CopyError(f"the agent at {address}: {head['error']}")
            total = int(head["total"])
            mm = sink(head)
            _recv_into(sock, mm, total)
            return head
        finally:
            sock.close()
            with self.lock:
                self.cpu_s["receive"] += time.thread_time() - t0

    # ------------------------------------------------------------------ receiving

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _addr = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="fe-ckpt-copy-conn",
                             daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        t0 = time.thread_time()
        try:
            conn.settimeout(_IO_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            challenge = os.urandom(32)
            conn.sendall(challenge)
            if not hmac.compare_digest(_recv_exact(conn, 32), _answer(self.key, challenge)):
                _send_head(conn, {"error": "not this job's store token"})
                logger.warning("checkpoint copy: refused a peer without the job's store token")
                return
            _send_head(conn, {"ok": True})
            while not self._stop.is_set():
                try:
                    head = _recv_head(conn)
                except CopyError:
                    return  # the peer is done
                if head.get("op") == "put":
                    _send_head(conn, self._receive(conn, head))
                elif head.get("op") == "get":
                    self._serve_get(conn, head)
                    return
                else:
                    return
        except (OSError, CopyError, ValueError, KeyError, TypeError) as e:
            logger.warning("checkpoint copy: a connection ended: %s", e)
        finally:
            conn.close()
            with self.lock:
                self.cpu_s["serve"] += time.thread_time() - t0

    def _receive(self, conn: socket.socket, head: dict[str, Any]) -> dict[str, Any]:
        rank, world, step = int(head["rank"]), int(head["world"]), int(head["step"])
        era, gen, total = int(head["era"]), int(head["gen"]), int(head["total"])
        mac = bytes.fromhex(str(head["mac"]))
        if not (0 <= rank < world and _format.HEADER_SIZE <= total):
            raise CopyError(f"a copy's head out of range: {head}")
        c = self._slot_for(rank, total)  # raises: no room (then the connection ends)
        ok = False
        try:
            assert c.mm is not None
            _recv_into(conn, c.mm, total)  # raises: the sender died mid-copy
            h = _format.unpack_header(c.mm, c.capacity)
            ok = ((h.step, h.generation, h.rank, h.total) == (step, gen, rank, total)
                  and hmac.compare_digest(h.mac, mac)
                  and hmac.compare_digest(_format.compute_mac(self.key, c.mm, total), mac))
        except _format.ShardError:
            ok = False
        finally:
            with self.lock:
                c.busy -= 1  # the slot is free again whatever happened to the copy
        with self.lock:
            if not ok:
                logger.warning("checkpoint copy: rank %s's step %s failed its check on receipt: "
                               "dropped", rank, step)
                return {"error": "the copy failed its check"}
            self.arrivals += 1
            c.valid, c.rank, c.world, c.step, c.era, c.gen = True, rank, world, step, era, gen
            c.total, c.arrived = total, self.arrivals
        return {"ok": True}

    def _slot_for(self, rank: int, total: int) -> _Copy:
        """The slot an arriving copy of ``rank`` goes to: not the newest copy, not being read;
        made room for ``total`` bytes (marked busy: the caller ends that)."""
        with self.lock:
            cs = self.copies.setdefault(rank, [_Copy(), _Copy()])
            newest = max((c for c in cs if c.valid), key=lambda c: c.arrived, default=None)
            free = [c for c in cs if c is not newest and not c.busy]
            if not free:
                raise CopyError(f"rank {rank}'s copies are both in use")
            c = free[0]
            c.valid = False
            c.busy += 1
        if c.capacity < total:
            cap = (total + _MB - 1) // _MB * _MB
            held = self.owner.held() + sum(x.capacity for xs in self.copies.values() for x in xs)
            why = _room.measure().refuse(cap - c.capacity, held, self.owner._limit)
            if why is not None:
                with self.lock:
                    c.busy -= 1
                raise CopyError(f"no room for rank {rank}'s copy: {why}")
            c.release()
            try:
                c.fd, _kind = self._alloc(cap, False)
            except OSError as e:
                with self.lock:
                    c.busy -= 1
                raise CopyError(f"no room for rank {rank}'s copy: {e.strerror}") from None
            c.capacity = cap
            c.mm = mmap.mmap(c.fd, cap, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return c

    def _serve_get(self, conn: socket.socket, head: dict[str, Any]) -> None:
        rank, step, era = int(head["rank"]), int(head["step"]), int(head["era"])
        with self.lock:
            c = next((c for c in self.copies.get(rank, []) if c.valid and c.step == step
                      and c.era == era), None)
            if c is None:
                _send_head(conn, {"error": f"no copy of rank {rank}'s step {step} here"})
                return
            c.busy += 1
        try:
            assert c.mm is not None
            _send_head(conn, {"total": c.total, "gen": c.gen, "world": c.world})
            _send_from(conn, c.mm, c.total)
        finally:
            with self.lock:
                c.busy -= 1
