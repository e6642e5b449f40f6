"""The workers' side: flatten a state_dict into a shard in the agent's memory, and back."""

from __future__ import annotations

import json
import mmap
import os
import pickle
import socket
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, Optional

import torch

from fastelastic.checkpoint import _format
from fastelastic.checkpoint._format import HEADER_SIZE, Header, TensorRef
from fastelastic.checkpoint._owner import (
    _MAX_PACKET,
    CheckpointError,
    EarlyMap,
    connect,
    find_agent,
    take_early_map,
)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
last_restore: dict[str, float] = {}  # seconds of the last load's phases: reply, map, copy
last_save: dict[str, float] = {}  # seconds of the last save's phases (for the benchmark)


def _copy_tensor(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.copy_(src)


class _Mapping:
    """A worker's mapping of one agent buffer (the file ``ident``), kept across saves and
    loads: its page tables are built once, at the map (MAP_POPULATE), and a later save or load
    faults nothing."""

    def __init__(self, mm: mmap.mmap, capacity: int, ident: tuple[int, int]) -> None:
        self.mm = mm
        self.capacity = capacity
        self.ident = ident
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return self.base[offset:offset + nbytes].view(dtype).view(shape)


class _Channel:
    """This process's connection to its agent (one request at a time)."""

    def __init__(self, path: str, local_rank: int,
                 sock: Optional[socket.socket] = None) -> None:
        self.local_rank = local_rank
        self.path = path
        self.lock = threading.Lock()
        if sock is None:
            sock = connect(path, None)
        if sock is None:
            raise CheckpointError("the agent's checkpoint channel went away")
        self.sock = sock
        self.maps: dict[int, _Mapping] = {}
        self.last_step = 0
        self.pid = os.getpid()  # a forked child (a data loader's worker) opens its own

    def call(self, **req: Any) -> tuple[dict[str, Any], Optional[int]]:
        req.setdefault("local_rank", self.local_rank)
        with self.lock:
            self.sock.sendall(json.dumps(req).encode())
            msg, fds, _flags, _addr = socket.recv_fds(self.sock, _MAX_PACKET, 4)
        if not msg:
            for fd in fds:
                os.close(fd)
            raise CheckpointError("the agent closed the checkpoint channel")
        reply = json.loads(msg)
        if "error" in reply:
            for fd in fds:
                os.close(fd)
            raise CheckpointError(reply["error"])
        return reply, (fds[0] if fds else None)

    def mapping(self, slot: int, capacity: int, fd: Optional[int],
                early: Optional[EarlyMap] = None) -> _Mapping:
        """This process's mapping of buffer ``slot``: the one it has when ``fd`` (the buffer
        the agent sent, closed here) is the same file, else ``early``'s, else a new one."""
        if fd is not None:
            try:
                st = os.fstat(fd)
                ident = (st.st_dev, st.st_ino)
                old = self.maps.get(slot)
                if old is None or (old.ident, old.capacity) != (ident, capacity):
                    self.maps.pop(slot, None)
                    mm = early.take(slot, capacity, ident) if early is not None else None
                    if mm is None:
                        mm = mmap.mmap(fd, capacity, mmap.MAP_SHARED | _POPULATE,
                                       mmap.PROT_READ | mmap.PROT_WRITE)
                    self.maps[slot] = _Mapping(mm, capacity, ident)
            finally:
                os.close(fd)
        m = self.maps.get(slot)
        if m is None or m.capacity != capacity:
            raise CheckpointError(f"the agent sent no buffer for slot {slot}")
        return m


_channel: Optional[_Channel] = None
_channel_lock = threading.Lock()


def channel() -> _Channel:
    global _channel
    with _channel_lock:
        if _channel is None or _channel.sock.fileno() < 0 or _channel.pid != os.getpid():
            _channel = _Channel(find_agent(), int(os.environ.get("LOCAL_RANK", "0")))
        return _channel


# ---------------------------------------------------------------------- save


def _flatten(obj: Any, tensors: list[torch.Tensor], ids: dict[int, int]) -> Any:
    """``obj`` with each strided tensor in dicts, lists and tuples replaced by a TensorRef;
    ``ids`` maps each original tensor's id to its index (a tensor met twice is stored once)."""
    if isinstance(obj, torch.Tensor) and type(obj) is torch.Tensor and obj.layout == torch.strided:
        i = ids.get(id(obj))
        if i is None:
            tensors.append(obj.detach())
            i = ids[id(obj)] = len(tensors) - 1
        return TensorRef(i)
    t = type(obj)
    if t is dict or t is OrderedDict:
        return t((k, _flatten(v, tensors, ids)) for k, v in obj.items())
    if t is list:
        return [_flatten(v, tensors, ids) for v in obj]
    if t is tuple:
        return tuple(_flatten(v, tensors, ids) for v in obj)
    return obj


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def stage(state_dict: dict[str, Any], step: int, wait: bool = False,
          checkpoint_id: Any = None) -> int:
    """Copies ``state_dict`` into this rank's free agent buffer and commits it; returns step.

    With ``wait``, returns once every local rank committed ``step`` (as ``wait_all``). With
    ``checkpoint_id``, the shard also carries this rank's DCP file and metadata (``_dcp``), for
    the agent to write to that directory behind training.
    """
    t0 = time.perf_counter_ns()
    ch = channel()
    tensors: list[torch.Tensor] = []
    ids: dict[int, int] = {}
    skel = pickle.dumps(_flatten(state_dict, tensors, ids), protocol=5)
    rank = int(os.environ.get("RANK", "0"))
    dcp = None
    if checkpoint_id is not None:
        from fastelastic.checkpoint import _dcp

        dcp = _dcp.plan(state_dict, tensors, ids, rank,
                        int(os.environ.get("WORLD_SIZE", "1")), os.fspath(checkpoint_id))
    # the table's length depends on the offsets in it: lay out with a bound on its size first
    entries: list[list] = [[_dtype_name(t.dtype), list(t.shape), 0, t.numel() * t.element_size()]
                           for t in tensors]
    extra = 0 if dcp is None else dcp.table_bound()
    bound = len(_format.encode_table(entries)) + 24 * len(entries) + 16 + extra
    off = _format.align(HEADER_SIZE + bound + len(skel))
    data_off = off
    for e in entries:
        e[2] = off
        off = _format.align(off + e[3])
    if dcp is not None:  # the DCP file's small pieces and the metadata, after the tensors
        off = dcp.place(off, entries)
    table = _format.encode_table(entries, None if dcp is None else dcp.table())
    assert len(table) <= bound
    total = off
    t1 = time.perf_counter_ns()
    reply, fd = ch.call(op="reserve", step=step, nbytes=total,
                        mapped=[ch.maps[i].capacity if i in ch.maps else 0 for i in (0, 1)])
    slot, gen = reply["slot"], reply["gen"]
    t2 = time.perf_counter_ns()
    m = ch.mapping(slot, reply["capacity"], fd)
    mm = m.mm
    t3 = time.perf_counter_ns()
    h = Header(step=step, generation=gen, rank=rank, local_rank=ch.local_rank,
               meta_len=len(table), skel_len=len(skel), data_off=data_off,
               data_len=total - data_off, total=total)
    mm[h.meta_off:h.meta_off + len(table)] = table
    mm[h.skel_off:h.skel_off + len(skel)] = skel
    for t, (_dtype, shape, offset, nbytes) in zip(tensors, entries, strict=True):
        if nbytes:
            _copy_tensor(m.view(offset, nbytes, t.dtype, shape), t)
    if dcp is not None:
        mm[dcp.blob_off:dcp.blob_off + len(dcp.blob)] = dcp.blob
    _format.pack_header(mm, h)  # last: the agent reads it at the commit
    t4 = time.perf_counter_ns()
    done, _fd = ch.call(op="commit", slot=slot, gen=gen, wait=wait)
    ch.last_step = step
    t5 = time.perf_counter_ns()
    last_save.update(prep_s=(t1 - t0) / 1e9, reserve_s=(t2 - t1) / 1e9, map_s=(t3 - t2) / 1e9,
                     copy_s=(t4 - t3) / 1e9, commit_s=(t5 - t4) / 1e9,
                     ranks_s=float(done.get("waited_s", 0.0)))
    return step


def wait_all(step: int) -> None:
    """Returns once every local rank's shard of ``step`` (or newer) is in the agent's memory."""
    channel().call(op="wait", step=step)


def disk_wait(step: int, timeout: Optional[float] = None) -> str:
    """Waits until the agent is done with ``step``'s disk copy: "written", "skipped" (a newer
    step was whole first) or "memory" (saved with no checkpoint_id).

    Raises:
        CheckpointError: the write failed (the message says why), or ``timeout`` ran out.
    """
    own = _Channel(channel().path, channel().local_rank)  # a wait never holds up a save
    try:
        req: dict[str, Any] = {"op": "disk", "step": int(step)}
        if timeout is not None:
            req["timeout"] = float(timeout)
        reply, _fd = own.call(**req)
    finally:
        own.sock.close()
    status = str(reply["status"])
    if status.startswith("failed"):
        raise CheckpointError(f"step {step} was not written to disk: {status[8:]}")
    return status


class SaveFuture(Future):
    """``async_save``'s Future: ``result()`` is the step once every local rank's state is in
    the agent's memory; ``wait()`` then waits for its disk copy (as ``disk_wait``)."""

    def wait(self, timeout: Optional[float] = None) -> str:
        return disk_wait(self.result(timeout), timeout)


def wait_future(step: int) -> Future:
    """A Future resolved (with ``step``) once every local rank committed ``step``."""
    fut: Future = SaveFuture()
    path = channel().path

    def run() -> None:
        try:
            own = _Channel(path, channel().local_rank)
            try:
                own.call(op="wait", step=step)
            finally:
                own.sock.close()
            fut.set_result(step)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's result()
            fut.set_exception(e)

    threading.Thread(target=run, name="fe-ckpt-wait", daemon=True).start()
    return fut


# ---------------------------------------------------------------------- load


def _fill(saved: Any, target: Any, views: list[torch.Tensor]) -> Any:
    """``saved`` resolved against ``target``: tensors copied into matching ones in place."""
    if isinstance(saved, TensorRef):
        src = views[saved.index]
        if (isinstance(target, torch.Tensor) and target.shape == src.shape
                and target.dtype == src.dtype):
            with torch.no_grad():
                target.detach().copy_(src)
            return target
        return src.clone()
    if isinstance(saved, dict):
        if isinstance(target, dict):
            for k, v in saved.items():
                target[k] = _fill(v, target.get(k), views)
            return target
        return type(saved)((k, _fill(v, None, views)) for k, v in saved.items())
    if isinstance(saved, list):
        if isinstance(target, list) and len(target) == len(saved):
            for i, v in enumerate(saved):
                target[i] = _fill(v, target[i], views)
            return target
        return [_fill(v, None, views) for v in saved]
    if isinstance(saved, tuple):
        items = target if isinstance(target, tuple) and len(target) == len(saved) else ()
        return tuple(_fill(v, items[i] if items else None, views) for i, v in enumerate(saved))
    return saved


def _adopt(early: EarlyMap) -> Optional[tuple[_Channel, dict[str, Any]]]:
    """The early map's connection, its reply to "restore" and its mapping (as this channel's),
    when this process has no channel yet: it saved nothing since that reply, so the round's
    step and buffer are as the agent said."""
    global _channel
    early.done.wait()  # bounded: its socket times out
    with _channel_lock:
        if _channel is not None or early.sock is None or early.reply is None:
            return None
        reply = early.reply
        ch = _Channel(early.path, int(os.environ.get("LOCAL_RANK", "0")), early.sock)
        early.sock = None
        if reply["step"] is not None:
            mm = early.take(reply["slot"], reply["capacity"], early.ident or (0, 0))
            if mm is None or early.ident is None:
                ch.sock.close()
                return None
            ch.maps[reply["slot"]] = _Mapping(mm, reply["capacity"], early.ident)
        _channel = ch
        return ch, reply


def restore(state_dict: dict[str, Any]) -> Optional[int]:
    """Loads this round's restore step from the agent's memory into ``state_dict``."""
    early = take_early_map()
    t0 = time.perf_counter()
    got = _adopt(early) if early is not None else None
    fd: Optional[int] = None
    if got is not None:
        ch, reply = got
    else:
        ch = channel()
        reply, fd = ch.call(op="restore")
    t1 = time.perf_counter()
    step = reply["step"]
    if step is None:
        if fd is not None:
            os.close(fd)
        return None
    m = ch.mapping(reply["slot"], reply["capacity"], fd, early)
    t2 = time.perf_counter()
    # the agent checked this shard's MAC for this round before answering: only now unpickle
    h = _format.unpack_header(m.mm, m.capacity)
    if h.step != step:
        raise CheckpointError(f"shard holds step {h.step}, the agent restores {step}")
    table = _format.decode_table(m.mm[h.meta_off:h.meta_off + h.meta_len])
    skel = pickle.loads(m.mm[h.skel_off:h.skel_off + h.skel_len])
    views = [m.view(off, nbytes, getattr(torch, dtype), shape) if nbytes
             else torch.empty(shape, dtype=getattr(torch, dtype))
             for dtype, shape, off, nbytes in table]
    if not isinstance(skel, dict):
        raise CheckpointError("the shard's state is not a dict")
    _fill(skel, state_dict, views)
    ch.last_step = step
    last_restore.update(reply_s=t1 - t0, map_s=t2 - t1, copy_s=time.perf_counter() - t2,
                        early_s=early.seconds if early is not None else 0.0,
                        early_used=float(early is not None and early.used))
    return int(step)
