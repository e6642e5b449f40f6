"""The agent's worker types (torch's public ``WorkerSpec``, ``Worker``, ``WorkerGroup`` and
``RunResult``), in a leaf module that imports nothing of the agent, so that ``api`` (the
agent) and its halves ``_peers`` and ``_telemetry`` all import them without a circle.

They are re-exported by ``api`` under torch's path, and name it as their module.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastelastic.agent.server._states import WorkerState

if TYPE_CHECKING:
    from fastelastic.multiprocessing import ProcessFailure
    from fastelastic.rendezvous import RendezvousHandler

__all__ = ["RunResult", "Worker", "WorkerGroup", "WorkerSpec"]


@dataclass
class WorkerSpec:
    """Blueprint of one kind of worker; the same on every node running this role.

    Args:
        role: user-defined role of the workers with this spec.
        local_world_size: number of local workers to run.
        rdzv_handler: handles the rendezvous of this set of workers.
        fn: deprecated, use ``entrypoint``.
        entrypoint: worker function or command (a path to a binary).
        args: arguments passed to ``entrypoint`` (``${local_rank}`` is substituted).
        max_restarts: how many times the group may be restarted after a failure.
        monitor_interval: period of the membership check (and of the monitor in agents that
            cannot wait for worker exits); the local agent wakes at once when a worker exits.
        master_port: fixed port of the c10d store on rank 0 (else a free one).
        master_addr: fixed address of the c10d store on rank 0 (else agent 0's host).
        local_addr: this node's address, passed to the rendezvous (see
            ``fastelastic.launcher.LaunchConfig.local_addr``).
        event_log_handler: name of the events handler (see ``fastelastic.events``).
        numa_options: NUMA binding options, passed through to ``start_processes``.
        duplicate_stdout_filters: lines of stdout matching any of these are also copied to
            a separate file.
        duplicate_stderr_filters: the same for stderr.
        virtual_local_rank: every worker sees LOCAL_RANK=0 and only its own GPU
            (through CUDA_VISIBLE_DEVICES).
        preload: modules a worker zygote imports once and forks every Python worker from
            (fastelastic; ``None``: ``$FASTELASTIC_PRELOAD``, comma separated; ``()``: off).
    """

    role: str
    local_world_size: int
    rdzv_handler: RendezvousHandler
    fn: Callable[..., Any] | None = None
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any | None = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    preload: tuple[str, ...] | list[str] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.local_world_size, int) or self.local_world_size <= 0:
            raise ValueError(
                f"local_world_size must be a positive int, got {self.local_world_size!r}"
            )
        if self.monitor_interval <= 0:
            raise ValueError(f"monitor_interval must be positive, got {self.monitor_interval!r}")
        if self.max_restarts < 0:
            raise ValueError(f"max_restarts must be >= 0, got {self.max_restarts!r}")
        if self.fn:
            warnings.warn(
                "WorkerSpec.fn will be deprecated, please use WorkerSpec.entrypoint instead",
                category=DeprecationWarning,
                stacklevel=2,
            )
            self.entrypoint = self.fn
        if not self.entrypoint:
            raise ValueError("WorkerSpec needs an entrypoint (a callable or a binary path)")

    def get_entrypoint_name(self) -> str:
        """The binary's base name for a command, else the callable's ``__qualname__``."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        return getattr(self.entrypoint, "__qualname__", repr(self.entrypoint))


class Worker:
    """One worker process made from a ``WorkerSpec`` (as an object is made from a class).

    Args:
        local_rank: rank of the worker on this agent.
        global_rank: rank among all workers of all roles on all agents.
        role_rank: rank among the workers of the same role.
        world_size: number of workers (globally).
        role_world_size: number of workers with the same role.
    """

    __slots__ = ["global_rank", "id", "local_rank", "role_rank", "role_world_size", "world_size"]

    def __init__(
        self,
        local_rank: int,
        global_rank: int = -1,
        role_rank: int = -1,
        world_size: int = -1,
        role_world_size: int = -1,
    ):
        self.id: Any = None  # the pid, for the local agent
        self.local_rank = local_rank
        self.global_rank = global_rank
        self.role_rank = role_rank
        self.world_size = world_size
        self.role_world_size = role_world_size

    def __str__(self) -> str:
        return (
            f"local_rank={self.local_rank},global_rank={self.global_rank}"
            f",role_rank={self.role_rank},world_size={self.world_size}"
            f",role_world_size={self.role_world_size}"
        )

    def __repr__(self) -> str:
        return str(self)


class WorkerGroup:
    """The ``Worker`` instances of one ``WorkerSpec`` managed by an agent."""

    __slots__ = [
        "group_rank",
        "group_world_size",
        "master_addr",
        "master_port",
        "spec",
        "state",
        "store",
        "workers",
    ]

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Any = None  # the next fields are assigned by the rendezvous
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self.state = WorkerState.INIT


@dataclass
class RunResult:
    """Outcome of a run: all-or-nothing over the workers of this agent.

    ``return_values`` (callables only) and ``failures`` are keyed by GLOBAL rank and never
    share a key; workers the agent stopped itself appear in neither.
    """

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        """True if the group failed."""
        return self.state == WorkerState.FAILED


for _cls in (WorkerSpec, Worker, WorkerGroup, RunResult):
    _cls.__module__ = "fastelastic.agent.server.api"  # where torch users look for them
