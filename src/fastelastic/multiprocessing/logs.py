"""Owns where worker output goes: Std, to_map, LogsDest, LogsSpecs and DefaultLogsSpecs."""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import IntFlag

__all__ = ["DefaultLogsSpecs", "LogsDest", "LogsSpecs", "Std", "to_map"]

logger = logging.getLogger(__name__)

_VALUE_RE = re.compile(r"^[0123]$")
_MAPPING_RE = re.compile(r"^(\d:[0123],)*(\d:[0123])$")


class Std(IntFlag):
    """Which standard streams to redirect or tee: a bit mask."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = OUT | ERR

    @classmethod
    def from_str(cls, vm: str) -> Std | dict[int, Std]:
        """Parses ``"3"`` into ``Std.ALL`` and ``"0:3,1:0"`` into ``{0: Std.ALL, 1: Std.NONE}``.

        Raises:
            ValueError: ``vm`` is neither a single digit 0-3 nor a ``rank:digit`` list.
        """
        if _VALUE_RE.match(vm):
            return cls(int(vm))
        if _MAPPING_RE.match(vm):
            out: dict[int, Std] = {}
            for item in vm.split(","):
                rank, value = item.split(":")
                out[int(rank)] = cls(int(value))
            return out
        raise ValueError(f"{vm} does not match: <{_VALUE_RE.pattern}> or <{_MAPPING_RE.pattern}>")


def to_map(val_or_map: Std | dict[int, Std], local_world_size: int) -> dict[int, Std]:
    """Expands one ``Std`` (for all ranks) or a partial map into a value for every local rank.

    Ranks missing from a map get ``Std.NONE``.
    """
    if isinstance(val_or_map, Std):
        return dict.fromkeys(range(local_world_size), val_or_map)
    return {rank: val_or_map.get(rank, Std.NONE) for rank in range(local_world_size)}


@dataclass
class LogsDest:
    """Per local rank file paths for each kind of log ("" for stdouts/stderrs = the console)."""

    stdouts: dict[int, str] = field(default_factory=dict)
    stderrs: dict[int, str] = field(default_factory=dict)
    tee_stdouts: dict[int, str] = field(default_factory=dict)
    tee_stderrs: dict[int, str] = field(default_factory=dict)
    error_files: dict[int, str] = field(default_factory=dict)
    filtered_stdout: str = field(default_factory=str)
    filtered_stderr: str = field(default_factory=str)


class LogsSpecs(ABC):
    """Defines how each worker's output is logged.

    Args:
        log_dir: base directory of the log files.
        redirects: streams to write to files instead of the console (one ``Std`` for every
            worker or a map by local rank).
        tee: streams to write to files and also to the console.
        local_ranks_filter: if set, only these local ranks' output reaches the console.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @abstractmethod
    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """Builds the log destinations of every local rank from the workers' environments.

        May add ``TORCHELASTIC_ERROR_FILE`` to each ``envs[local_rank]``.
        """

    @property
    @abstractmethod
    def root_log_dir(self) -> str:
        """The base log directory."""


class DefaultLogsSpecs(LogsSpecs):
    """Logs under ``<log_dir>/<run_id>_<random>/attempt_<restart_count>/<local_rank>/``.

    ``log_dir`` is created when missing (a temporary directory when None); ``os.devnull``
    discards every file. Each rank's directory holds ``stdout.log``, ``stderr.log`` (when
    redirected or tee'd) and ``error.json``; the attempt directory holds the filtered logs.

    Raises:
        NotADirectoryError: ``log_dir`` exists and is a file.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        if log_dir != os.devnull:
            if not log_dir:
                log_dir = tempfile.mkdtemp(prefix="torchelastic_")
            elif os.path.isfile(log_dir):
                raise NotADirectoryError(f"log_dir: {log_dir} is a file")
            else:
                os.makedirs(log_dir, exist_ok=True)
        super().__init__(log_dir, redirects, tee, local_ranks_filter)
        self._run_log_dir: str | None = None

    @property
    def root_log_dir(self) -> str:
        return str(self._root_log_dir)

    def _make_log_dir(self, log_dir: str | None, rdzv_run_id: str) -> str:
        base = log_dir or tempfile.mkdtemp(prefix="torchelastic_")
        os.makedirs(base, exist_ok=True)
        path = tempfile.mkdtemp(prefix=f"{rdzv_run_id}_", dir=base)
        logger.info("log directory set to: %s", path)
        return path

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        nprocs = len(envs)
        first = envs[0] if nprocs else {}
        run_id = first.get("TORCHELASTIC_RUN_ID", "test_run_id")
        restart_count = first.get("TORCHELASTIC_RESTART_COUNT", "0")
        devnull = self._root_log_dir == os.devnull
        attempt_dir = os.devnull
        if not devnull:
            if not self._run_log_dir:
                self._run_log_dir = self._make_log_dir(self._root_log_dir, run_id)
            attempt_dir = os.path.join(self._run_log_dir, f"attempt_{restart_count}")
            shutil.rmtree(attempt_dir, ignore_errors=True)
            os.makedirs(attempt_dir)

        redirects = to_map(self._redirects, nprocs)
        tees = to_map(self._tee, nprocs)
        dest = LogsDest(
            stdouts=dict.fromkeys(range(nprocs), ""),
            stderrs=dict.fromkeys(range(nprocs), ""),
            filtered_stdout=os.path.join(attempt_dir, "filtered_stdout.log"),
            filtered_stderr=os.path.join(attempt_dir, "filtered_stderr.log"),
        )
        for rank in range(nprocs):
            if devnull:
                dest.tee_stdouts[rank] = os.devnull
                dest.tee_stderrs[rank] = os.devnull
                dest.error_files[rank] = os.devnull
                envs[rank]["TORCHELASTIC_ERROR_FILE"] = ""
                continue
            rank_dir = os.path.join(attempt_dir, str(rank))
            os.mkdir(rank_dir)
            # tee is a redirect into the file plus a copy of it on the console
            to_file = redirects[rank] | tees[rank]
            if to_file & Std.OUT:
                dest.stdouts[rank] = os.path.join(rank_dir, "stdout.log")
            if to_file & Std.ERR:
                dest.stderrs[rank] = os.path.join(rank_dir, "stderr.log")
            if tees[rank] & Std.OUT:
                dest.tee_stdouts[rank] = dest.stdouts[rank]
            if tees[rank] & Std.ERR:
                dest.tee_stderrs[rank] = dest.stderrs[rank]
            if self._local_ranks_filter and rank not in self._local_ranks_filter:
                dest.tee_stdouts.pop(rank, None)
                dest.tee_stderrs.pop(rank, None)
                if dest.stdouts[rank] == "":
                    dest.stdouts[rank] = os.devnull
                if dest.stderrs[rank] == "":
                    dest.stderrs[rank] = os.devnull
            error_file = os.path.join(rank_dir, "error.json")
            dest.error_files[rank] = error_file
            envs[rank]["TORCHELASTIC_ERROR_FILE"] = error_file
        return dest

    def __repr__(self) -> str:
        return (
            f"DefaultLogsSpecs(root_log_dir={self._root_log_dir}, redirects={self._redirects}, "
            f"tee={self._tee}, local_ranks_filter={self._local_ranks_filter})"
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DefaultLogsSpecs):
            return False
        return (
            self._root_log_dir == other._root_log_dir
            and self._redirects == other._redirects
            and self._tee == other._tee
            and self._local_ranks_filter == other._local_ranks_filter
        )

    __hash__ = None  # type: ignore[assignment]
