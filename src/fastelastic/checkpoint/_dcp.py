"""The workers' side of the disk copy: this rank's file and metadata in torch DCP's format.

A step saved with a ``checkpoint_id`` carries, in its shard, everything the agent needs to write
that directory as ``torch.distributed.checkpoint.save`` with a ``FileSystemWriter`` would, so that
torch's own ``FileSystemReader`` reads it:

* ``__<rank>_0.distcp``: each item of DCP's plan (``DefaultSavePlanner``) in plan order, as
  ``torch.save`` writes it (a tensor's zip, a non-tensor's pickle). The file is a list of byte
  ranges of the shard: a tensor's bytes are the ones the save copied for the memory copy (never
  copied twice); ``torch.save``'s own zip records around them are kept in a small blob.
* three pickle fragments (protocol 2, the opening ``{`` and the closing ``.`` taken off): the
  rank's entries of ``Metadata.state_dict_metadata``, ``planner_data`` and ``storage_data``.
  The agent joins every rank's fragments into the one ``.metadata`` without unpickling them
  (``_disk.metadata_pickle``), so the agent never imports torch.

Plain tensors and picklable items only (DTensor and ShardedTensor are refused with one line).
"""

from __future__ import annotations

import json
import os
import pickle
from typing import Any, Optional

import torch

from fastelastic.checkpoint._owner import CheckpointError

_SMALL = 4096  # below: the data record is told from the zip's padding field by its content
_RECORDS: dict[tuple[str, tuple[int, ...]], tuple[bytes, bytes]] = {}  # see _records
_RECORDS_MAX = 4096
_DICT_HEAD = b"\x80\x02}q\x00"  # pickle.dumps({...}, protocol=2) opens with these bytes
_BIG = 1 << 45  # larger than any offset: sizes the table before the layout is known


class _Capture:
    """A file-like ``torch.save`` writes into: small writes go to the blob; the data record of
    tensor ``index`` (``nbytes`` long; below ``_SMALL``, all zeros) becomes a reference to the
    tensor."""

    def __init__(self, blob: bytearray, segs: list[list], index: int = -1,
                 nbytes: int = 0) -> None:
        self.blob, self.segs, self.index, self.nbytes = blob, segs, index, nbytes
        self.pos = 0
        self.after_name = -1  # writes since the name of the tensor's data record
        self.found = index < 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        self.pos += n
        if (not self.found and 0 <= self.after_name <= 1 and n == self.nbytes
                and (n >= _SMALL or not any(bytes(b)))):  # the padding field opens with "FB"
            self.found = True
            self.segs.append(["t", self.index, n])
            return n
        if not self.found:
            if self.after_name >= 0:
                self.after_name += 1
            elif n < 256 and bytes(b).endswith(b"/data/0"):
                self.after_name = 0
        start = len(self.blob)
        self.blob += b
        if self.segs and self.segs[-1][0] == "b" and self.segs[-1][1] + self.segs[-1][2] == start:
            self.segs[-1][2] += n
        else:
            self.segs.append(["b", start, n])
        return n

    def flush(self) -> None:
        pass


def _fragment(d: dict) -> bytes:
    raw = pickle.dumps(d, protocol=2)
    if not (raw.startswith(_DICT_HEAD) and raw.endswith(b".")):
        raise CheckpointError("this pickle module writes dicts in a way the agent cannot join")
    return raw[len(_DICT_HEAD):-1]


class Plan:
    """One rank's disk copy of one step: the file's byte ranges and the metadata fragments."""

    def __init__(self, state_dict: dict[str, Any], tensors: list[torch.Tensor],
                 ids: dict[int, int], rank: int, world: int, path: str) -> None:
        from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        from torch.distributed.checkpoint.filesystem import (
            CURRENT_DCP_VERSION,
            DEFAULT_SUFFIX,
            _StorageInfo,
        )
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.utils.serialization import config

        planner = DefaultSavePlanner()
        planner.set_up_planner(state_dict, None, True)
        local = planner.create_local_plan()
        _plans, md = planner.create_global_plan([local])
        name = f"__{rank}_0{DEFAULT_SUFFIX}"
        self.blob = bytearray()
        self.segs: list[list] = []
        storage: dict[Any, Any] = {}
        pos = 0
        crc = config.save.compute_crc32
        config.save.compute_crc32 = False  # torch.load does not need it; it costs a pass
        try:
            for item in local.items:
                obj = planner.lookup_object(item.index)
                if item.type == WriteItemType.BYTE_IO:
                    cap = _Capture(self.blob, self.segs)
                    torch.save(obj, cap)  # type: ignore[arg-type]
                    length = cap.pos
                else:
                    i = ids.get(id(obj))
                    if i is None or type(obj) is not torch.Tensor:
                        raise CheckpointError(
                            f"{item.index.fqn}: a {type(obj).__name__} cannot go to disk from "
                            "the agent yet (plain tensors and picklable items only)")
                    t = tensors[i]
                    nbytes = t.numel() * t.element_size()
                    pre, post = _records(t, item.index.fqn)
                    length = len(pre) + nbytes + len(post)
                    self.segs.append(["b", len(self.blob), len(pre)])
                    self.blob += pre
                    self.segs.append(["t", i, nbytes])
                    self.segs.append(["b", len(self.blob), len(post)])
                    self.blob += post
                storage[item.index] = _StorageInfo(name, pos, length)
                pos += length
        finally:
            config.save.compute_crc32 = crc
        frags = [_fragment(md.state_dict_metadata), _fragment(md.planner_data or {}),
                 _fragment(storage)]
        self.meta_rel: list[list[int]] = []
        for f in frags:
            self.meta_rel.append([len(self.blob), len(f)])
            self.blob += f
        self.path = os.path.abspath(path)
        self.rank, self.world, self.version = rank, world, CURRENT_DCP_VERSION
        self.blob_off = 0
        self._file: list[list[int]] = []
        self._meta: list[list[int]] = []

    def _obj(self) -> dict[str, Any]:
        return {"path": self.path, "rank": self.rank, "world": self.world,
                "version": self.version, "file": self._file, "meta": self._meta}

    def table_bound(self) -> int:
        """Bytes the table's plan takes at most, whatever the offsets."""
        obj = self._obj()
        obj["file"] = [[_BIG, _BIG]] * len(self.segs)
        obj["meta"] = [[_BIG, _BIG]] * 3
        return len(json.dumps(obj, separators=(",", ":"))) + 8

    def place(self, off: int, entries: list[list]) -> int:
        """Puts the blob at ``off`` (tensors at their table offsets); returns the end."""
        from fastelastic.checkpoint._format import align

        self.blob_off = off
        self._file = [[off + s[1], s[2]] if s[0] == "b" else [entries[s[1]][2], s[2]]
                      for s in self.segs]
        self._meta = [[off + a, n] for a, n in self.meta_rel]
        return align(off + len(self.blob))

    def table(self) -> dict[str, Any]:
        return self._obj()


def _records(t: torch.Tensor, fqn: str) -> tuple[bytes, bytes]:
    """The bytes ``torch.save`` writes before and after the data of a tensor of ``t``'s dtype
    and shape (contiguous, on the CPU, its own storage), as DCP writes each tensor.

    They depend on the dtype and the shape only (the zip's CRC fields are 0, its offsets start
    at the zip's own start), so they are made once per dtype and shape, by saving a stand-in:
    an untouched ``empty`` (its data record is never read) or, below ``_SMALL`` bytes, zeros
    (whose record is told from the padding field by its content).
    """
    key = (str(t.dtype), tuple(t.shape))
    got = _RECORDS.get(key)
    if got is not None:
        return got
    nbytes = t.numel() * t.element_size()
    blob: bytearray = bytearray()
    segs: list[list] = []
    cap = _Capture(blob, segs, 0 if nbytes else -1, nbytes)
    stand_in = (torch.empty if nbytes >= _SMALL else torch.zeros)(t.shape, dtype=t.dtype)
    torch.save(stand_in, cap)  # type: ignore[arg-type]
    if not nbytes:  # no data: all of it is records
        segs.append(["t", 0, 0])
    kinds = [s[0] for s in segs]
    if not cap.found or kinds.count("t") != 1 or len(segs) > 3:
        raise CheckpointError(f"{fqn}: torch.save wrote no data record this version of "
                              "fastelastic knows")
    k = kinds.index("t")
    pre = bytes(blob[:segs[k - 1][1] + segs[k - 1][2]]) if k else b""
    got = (pre, bytes(blob[len(pre):]))
    if len(_RECORDS) >= _RECORDS_MAX:
        _RECORDS.clear()
    _RECORDS[key] = got
    return got


def plan(state_dict: dict[str, Any], tensors: list[torch.Tensor], ids: dict[int, int],
         rank: int, world: int, path: str) -> Optional[Plan]:
    return Plan(state_dict, tensors, ids, rank, world, path)
