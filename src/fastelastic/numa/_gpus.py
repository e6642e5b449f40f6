"""Owns GPU index -> PCI address without torch or CUDA: NVML when importable, else sysfs/procfs.

CUDA numbers the GPUs it sees (torch's ``cuda:i``, and torch binds local rank ``i`` to GPU
``i``) in this way, reproduced here:

* the inventory: NVML (``nvidia-ml-py``'s ``pynvml``) when it imports and initialises, else the
  PCI devices bound to the ``nvidia`` driver (``/sys/bus/pci/drivers/nvidia/``) with their
  UUID and model from ``/proc/driver/nvidia/gpus/<address>/information``;
* the order: ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` is PCI order; the default (``FASTEST_FIRST``) is
  PCI order too when every GPU is the same model. With mixed models CUDA ranks them by its own
  speed estimate, which cannot be known without CUDA: that is a binding failure (one line
  naming the models and ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` as the remedy), never a guess;
* ``CUDA_VISIBLE_DEVICES``: indices into that order, ``GPU-<uuid>`` (a unique prefix is
  enough) and ``MIG-<uuid>`` or ``MIG-GPU-<uuid>/<gi>/<ci>`` (NVML only: a MIG device is bound
  as its parent GPU, as torch reads its parent's PCI address); as CUDA,
  the list ends at its first invalid or repeated entry, and an empty value hides every GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastelastic.errors import NumaBindingError

__all__ = ["Gpu", "visible_gpu_addresses", "inventory"]

_PCI_RE = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class Gpu:
    """One physical GPU: its PCI address as torch writes it (``0000:3b:00.0``), UUID, model."""

    pci: str
    uuid: str = ""
    model: str = ""
    mig: tuple[str, ...] = field(default=())  # the UUIDs of its MIG devices (NVML only)


def torch_pci(address: str) -> str:
    """``00000000:3B:00.0`` (NVML) or ``0000:3b:00.1`` as torch formats a GPU: function 0."""
    m = _PCI_RE.match(address.strip())
    if m is None:
        raise NumaBindingError(f"{address!r} is not a PCI address")
    return f"{int(m[1], 16):04x}:{int(m[2], 16):02x}:{int(m[3], 16):02x}.0"


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _nvml_inventory() -> tuple[list[Gpu], str] | None:
    """The GPUs NVML sees, or None when ``pynvml`` is missing or NVML does not start."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: sysfs decides
        return None
    try:
        gpus = []
        for i in range(int(pynvml.nvmlDeviceGetCount())):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            migs: list[str] = []
            try:
                enabled = pynvml.nvmlDeviceGetMigMode(h)[0] == 1
            except Exception:  # noqa: BLE001 - no MIG support on this GPU
                enabled = False
            if enabled:
                for j in range(int(pynvml.nvmlDeviceGetMaxMigDeviceCount(h))):
                    try:
                        mh = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                    except Exception:  # noqa: BLE001 - an empty MIG slot
                        continue
                    migs.append(_text(pynvml.nvmlDeviceGetUUID(mh)))
            gpus.append(Gpu(
                pci=torch_pci(_text(pynvml.nvmlDeviceGetPciInfo(h).busId)),
                uuid=_text(pynvml.nvmlDeviceGetUUID(h)),
                model=_text(pynvml.nvmlDeviceGetName(h)),
                mig=tuple(migs),
            ))
        return gpus, "NVML"
    except NumaBindingError:
        raise
    except Exception as e:  # noqa: BLE001 - one line, whatever NVML raised
        raise NumaBindingError(f"NVML failed: {type(e).__name__}: {e}") from None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _info(procfs_root: str, address: str) -> dict[str, str]:
    path = os.path.join(procfs_root, "driver/nvidia/gpus", address, "information")
    out: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    out[key.strip()] = value.strip()
    except OSError:
        pass
    return out


def _sysfs_inventory(sysfs_root: str, procfs_root: str) -> tuple[list[Gpu], str]:
    driver = os.path.join(sysfs_root, "bus/pci/drivers/nvidia")
    try:
        names = [n for n in os.listdir(driver) if _PCI_RE.match(n)]
    except OSError:
        names = []
    gpus = []
    for name in names:
        info = _info(procfs_root, name)
        model = info.get("Model", "")
        if not model:  # the PCI device id tells models apart as well
            try:
                with open(os.path.join(sysfs_root, "bus/pci/devices", name, "device")) as f:
                    model = f"PCI device {f.read().strip()}"
            except OSError:
                model = ""
        gpus.append(Gpu(pci=torch_pci(name), uuid=info.get("GPU UUID", ""), model=model))
    return gpus, f"{driver}/"


def inventory(sysfs_root: str = "/sys", procfs_root: str = "/proc") -> tuple[list[Gpu], str]:
    """Every NVIDIA GPU of this host in PCI order, and where they were found.

    NVML when ``pynvml`` imports and initialises, else the nvidia driver's sysfs directory.
    """
    found = _nvml_inventory()
    if found is None:
        found = _sysfs_inventory(sysfs_root, procfs_root)
    gpus, source = found
    return sorted(gpus, key=lambda g: g.pci), source


def _cuda_order(gpus: list[Gpu], env: Mapping[str, str]) -> list[Gpu]:
    order = env.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST").strip() or "FASTEST_FIRST"
    if order == "PCI_BUS_ID":
        return gpus
    models = sorted({g.model for g in gpus})
    if len(models) > 1:
        raise NumaBindingError(
            f"GPUs of different models ({', '.join(models)}): CUDA's default FASTEST_FIRST "
            "order cannot be known without CUDA; set CUDA_DEVICE_ORDER=PCI_BUS_ID"
        )
    return gpus


def _visible(gpus: list[Gpu], env: Mapping[str, str], nvml: bool) -> list[Gpu]:
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return gpus
    chosen: list[Gpu] = []
    seen: set[str] = set()
    for item in raw.split(","):
        item = item.strip()
        gpu: Gpu | None = None
        if re.fullmatch(r"[0-9]+", item):
            index = int(item)
            gpu = gpus[index] if index < len(gpus) else None
        elif item.startswith("GPU-"):
            hits = [g for g in gpus if g.uuid and g.uuid.startswith(item)]
            gpu = hits[0] if len(hits) == 1 else None
        elif item.startswith("MIG-"):
            if not nvml:
                raise NumaBindingError(
                    f"CUDA_VISIBLE_DEVICES names MIG device {item}: finding its GPU needs "
                    "NVML (pip install nvidia-ml-py)"
                )
            if item.startswith("MIG-GPU-"):  # the older form MIG-GPU-<gpu uuid>/<gi>/<ci>
                parent = item[4:].split("/")[0]
                hits = [g for g in gpus if g.mig and g.uuid == parent]
            else:
                hits = [g for g in gpus if any(m.startswith(item) for m in g.mig)]
            gpu = hits[0] if len(hits) == 1 else None
        key = item if gpu is not None and item.startswith("MIG-") else (gpu.pci if gpu else "")
        if gpu is None or key in seen:
            break  # CUDA ignores the list from its first invalid or repeated entry on
        seen.add(key)
        chosen.append(gpu)
    return chosen


def visible_gpu_addresses(
    env: Mapping[str, str] | None = None, sysfs_root: str = "/sys", procfs_root: str = "/proc"
) -> tuple[list[str], str]:
    """The PCI address of each GPU CUDA would number 0, 1, ... in this environment.

    Returns:
        The addresses (torch's format) and where the inventory came from.

    Raises:
        NumaBindingError: no NVIDIA GPU at all, mixed models under FASTEST_FIRST, a MIG device
            without NVML, or NVML failing.
    """
    env = os.environ if env is None else env
    gpus, source = inventory(sysfs_root, procfs_root)
    if not gpus:
        where = ("NVML reports none" if source == "NVML" else
                 f"no NVML (nvidia-ml-py), and nothing is bound to the nvidia driver in {source}")
        raise NumaBindingError(f"no NVIDIA GPU found: {where}")
    visible = _visible(_cuda_order(gpus, env), env, source == "NVML")
    return [g.pci for g in visible], source
