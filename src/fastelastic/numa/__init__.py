"""NUMA binding of workers (torch's ``torch.numa.binding``), without torch, CUDA or numactl.

``--numa-binding MODE`` (``LaunchConfig(numa_options=...)``, ``start_processes(numa_options=...)``)
binds the worker of local rank ``i`` to CPUs near GPU ``i``, choosing the same CPU set as torch
2.13 for every mode (see ``_select.py``) and finding each GPU's PCI address without CUDA (see
``_gpus.py``). The launcher chooses; the worker applies it with ``sched_setaffinity`` before
``exec`` (plain start) or before its script runs (a ``--preload`` zygote's fork), on every start
and restart.

When a worker cannot be bound (a CPU-only host, fewer cores than GPUs in ``exclusive``, any of
torch's own failures) the start fails with one line, as torch's does, unless the fallback is
asked for (``NumaOptions.should_fall_back_if_binding_fails``, or ``FASTELASTIC_NUMA_FALLBACK=1``
for fastrun): then a warning names the worker, which runs unbound.
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from fastelastic.errors import NumaBindingError
from fastelastic.numa._gpus import visible_gpu_addresses
from fastelastic.numa._select import (
    MODES,
    Topology,
    cpus_for_gpu,
    format_cpulist,
    parse_cpulist,
)

__all__ = [
    "FALLBACK_ENV",
    "MODES",
    "AffinityMode",
    "NumaBindingError",
    "NumaOptions",
    "as_numa_options",
    "bind_local_ranks",
    "describe",
    "fallback_from_env",
    "format_cpulist",
    "parse_cpulist",
]

logger = logging.getLogger(__name__)

FALLBACK_ENV = "FASTELASTIC_NUMA_FALLBACK"
# test hooks: the trees read instead of /sys and /proc (fake topologies in tests)
SYSFS_ROOT_ENV = "FASTELASTIC_SYSFS_ROOT"
PROCFS_ROOT_ENV = "FASTELASTIC_PROCFS_ROOT"


class AffinityMode(str, enum.Enum):
    """torch's ``AffinityMode``: which CPUs near its GPU a worker is bound to."""

    NODE = "node"
    SOCKET = "socket"
    EXCLUSIVE = "exclusive"
    CORE_COMPLEX = "core-complex"


@dataclass(frozen=True)
class NumaOptions:
    """torch's ``NumaOptions`` (torch's own instances are accepted too, by their attributes).

    Args:
        affinity_mode: one of :class:`AffinityMode` (or its value).
        should_fall_back_if_binding_fails: a worker that cannot be bound runs unbound, with a
            warning, instead of failing the start.
    """

    affinity_mode: AffinityMode
    should_fall_back_if_binding_fails: bool = False


def fallback_from_env(env: Mapping[str, str] | None = None) -> bool:
    """``FASTELASTIC_NUMA_FALLBACK``: 1/true/yes/on or 0/false/no/off/unset.

    Raises:
        ValueError: any other value (one line naming the variable).
    """
    raw = (os.environ if env is None else env).get(FALLBACK_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{FALLBACK_ENV}={raw!r}: expected 1 or 0")


def as_numa_options(value: Any) -> NumaOptions | None:
    """``None``, a mode name, ours or torch's ``NumaOptions`` (any object with its attributes).

    Raises:
        ValueError: an unknown mode or an object without ``affinity_mode``.
    """
    if value is None:
        return None
    if isinstance(value, NumaOptions) and isinstance(value.affinity_mode, AffinityMode):
        return value
    if isinstance(value, str):
        mode: Any = value
        fallback: Any = fallback_from_env()
    elif hasattr(value, "affinity_mode"):
        mode = value.affinity_mode
        fallback = getattr(value, "should_fall_back_if_binding_fails", False)
    else:
        raise ValueError(
            f"numa_options: expected a NumaOptions (affinity_mode=...) or a mode name, "
            f"got {type(value).__name__}"
        )
    name = getattr(mode, "value", mode)
    if name not in MODES:
        raise ValueError(f"numa_options: affinity mode {name!r} is not one of {', '.join(MODES)}")
    return NumaOptions(AffinityMode(name), bool(fallback))


def _roots(env: Mapping[str, str]) -> tuple[str, str]:
    return env.get(SYSFS_ROOT_ENV) or "/sys", env.get(PROCFS_ROOT_ENV) or "/proc"


def bind_local_ranks(
    options: Any,
    nprocs: int,
    env: Mapping[str, str] | None = None,
    allowed: Any = None,
    only: int | None = None,
) -> dict[int, frozenset[int]]:
    """The CPUs each local rank ``0..nprocs-1`` is to be bound to (``{}`` when not asked).

    A rank missing from the result runs unbound (the fallback was asked for; it was warned).

    Args:
        options: see :func:`as_numa_options`.
        nprocs: the local world size.
        env: the launcher's environment (CUDA_VISIBLE_DEVICES, CUDA_DEVICE_ORDER).
        allowed: the launcher's CPUs (default: its affinity).
        only: choose for this local rank alone.

    Raises:
        NumaBindingError: a rank cannot be bound and the fallback was not asked for.
        ValueError: bad ``options``.
    """
    opts = as_numa_options(options)
    if opts is None:
        return {}
    env = os.environ if env is None else env
    sysfs, procfs = _roots(env)
    mode = opts.affinity_mode.value
    topo = Topology(sysfs, allowed)
    out: dict[int, frozenset[int]] = {}
    try:
        addresses, _ = visible_gpu_addresses(env, sysfs, procfs)
    except NumaBindingError as e:
        _fail(mode, opts, "every local rank", str(e))
        return out
    nodes: dict[int, int] = {}

    def node_of(gpu: int) -> int:
        if gpu not in nodes:
            nodes[gpu] = topo.pci_numa_node(addresses[gpu])
        return nodes[gpu]

    for rank in range(nprocs) if only is None else (only,):
        try:
            out[rank] = frozenset(cpus_for_gpu(mode, rank, len(addresses), node_of, topo))
        except NumaBindingError as e:
            _fail(mode, opts, f"local rank {rank}", str(e))
    return out


def _fail(mode: str, opts: NumaOptions, who: str, why: str) -> None:
    if not opts.should_fall_back_if_binding_fails:
        raise NumaBindingError(f"--numa-binding {mode}: cannot bind {who}: {why}")
    logger.warning("--numa-binding %s: %s runs without binding (fallback asked for): %s",
                   mode, who, why)


def describe(mode: str, cpus: Mapping[int, frozenset[int]], nprocs: int) -> str:
    """``node: 0->0-15 1->16-31 2->unbound`` (the agent's log line and the watch field)."""
    parts = [f"{r}->{format_cpulist(cpus[r]) if r in cpus else 'unbound'}" for r in range(nprocs)]
    return f"{mode}: " + " ".join(parts)

