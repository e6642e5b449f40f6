"""Owns GPU index -> PCI address without torch or CUDA: NVML through ctypes, else sysfs/procfs.

CUDA numbers the GPUs it sees (torch's ``cuda:i``, and torch binds local rank ``i`` to GPU
``i``) in this way, reproduced here:

* the inventory: NVML, the driver's own library (``libnvidia-ml.so.1``, present wherever the
  driver is; ``FASTELASTIC_NVML_LIBRARY`` names another file) loaded with ctypes: in a
  container it lists only the GPUs the container was given, as CUDA does. Only where NVML
  cannot load or start, the PCI devices bound to the ``nvidia`` driver
  (``/sys/bus/pci/drivers/nvidia/``) with their UUID and model from
  ``/proc/driver/nvidia/gpus/<address>/information``, with a warning: that directory lists
  every GPU of the host, more than a container under the NVIDIA container runtime sees;
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

import ctypes
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fastelastic.errors import NumaBindingError

__all__ = ["Gpu", "NVML_LIBRARY_ENV", "visible_gpu_addresses", "inventory"]

logger = logging.getLogger("fastelastic.numa")

NVML_LIBRARY_ENV = "FASTELASTIC_NVML_LIBRARY"  # another file than libnvidia-ml.so.1 (tests)
NVML_LIBRARY = "libnvidia-ml.so.1"
_PCI_RE = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")
_warned: set[str] = set()  # the sysfs warnings given in this process (one per cause)


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


class _PciInfo(ctypes.Structure):
    """``nvmlPciInfo_t`` (``nvmlDeviceGetPciInfo_v3``)."""

    _fields_ = [("busIdLegacy", ctypes.c_char * 16), ("domain", ctypes.c_uint),
                ("bus", ctypes.c_uint), ("device", ctypes.c_uint),
                ("pciDeviceId", ctypes.c_uint), ("pciSubSystemId", ctypes.c_uint),
                ("busId", ctypes.c_char * 32)]


_Handle = ctypes.c_void_p  # nvmlDevice_t
_NVML_SUCCESS = 0
_NVML_DEVICE_MIG_ENABLE = 1


class _Nvml:
    """The few NVML calls the inventory needs, on a library loaded with ctypes."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def call(self, names: tuple[str, ...], *args: Any) -> int:
        """The first of ``names`` the library exports, called; its ``nvmlReturn_t``."""
        for name in names:
            fn = getattr(self.lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                return int(fn(*args))
        raise NumaBindingError(f"NVML has none of {', '.join(names)}")

    def check(self, names: tuple[str, ...], *args: Any) -> None:
        rc = self.call(names, *args)
        if rc != _NVML_SUCCESS:
            raise NumaBindingError(f"NVML failed: {names[0]} returned {self.error(rc)}")

    def error(self, rc: int) -> str:
        fn = getattr(self.lib, "nvmlErrorString", None)
        if fn is None:
            return f"error {rc}"
        fn.restype = ctypes.c_char_p
        text = fn(ctypes.c_int(rc))
        return f"{_text(text)} ({rc})" if text else f"error {rc}"

    def text(self, names: tuple[str, ...], h: Any, size: int) -> str:
        buf = ctypes.create_string_buffer(size)
        self.check(names, h, buf, ctypes.c_uint(size))
        return _text(buf.value)

    def gpu(self, h: Any) -> Gpu:
        pci = _PciInfo()
        self.check(("nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetPciInfo_v2"), h, ctypes.byref(pci))
        migs: list[str] = []
        current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
        if (self.call(("nvmlDeviceGetMigMode",), h, ctypes.byref(current), ctypes.byref(pending))
                == _NVML_SUCCESS and current.value == _NVML_DEVICE_MIG_ENABLE):
            count = ctypes.c_uint(0)
            self.check(("nvmlDeviceGetMaxMigDeviceCount",), h, ctypes.byref(count))
            for j in range(count.value):
                mh = _Handle()
                if self.call(("nvmlDeviceGetMigDeviceHandleByIndex",), h, ctypes.c_uint(j),
                             ctypes.byref(mh)) != _NVML_SUCCESS:
                    continue  # an empty MIG slot
                migs.append(self.text(("nvmlDeviceGetUUID",), mh, 96))
        return Gpu(pci=torch_pci(_text(pci.busId)), uuid=self.text(("nvmlDeviceGetUUID",), h, 96),
                   model=self.text(("nvmlDeviceGetName",), h, 96), mig=tuple(migs))


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _nvml_inventory(library: str) -> tuple[list[Gpu], str] | str:
    """The GPUs NVML sees, or why NVML cannot be used (the library does not load or NVML
    does not start: no driver). Raises ``NumaBindingError`` when NVML fails once started."""
    try:
        lib = ctypes.CDLL(library)
    except OSError as e:  # dlopen's message names the file
        return str(e)
    nvml = _Nvml(lib)
    try:
        rc = nvml.call(("nvmlInit_v2", "nvmlInit"))
    except NumaBindingError as e:
        return f"{library}: {e}"
    if rc != _NVML_SUCCESS:
        return f"{library}: nvmlInit_v2 returned {nvml.error(rc)}"
    try:
        count = ctypes.c_uint(0)
        nvml.check(("nvmlDeviceGetCount_v2", "nvmlDeviceGetCount"), ctypes.byref(count))
        gpus = []
        for i in range(count.value):
            h = _Handle()
            nvml.check(("nvmlDeviceGetHandleByIndex_v2", "nvmlDeviceGetHandleByIndex"),
                       ctypes.c_uint(i), ctypes.byref(h))
            gpus.append(nvml.gpu(h))
        return gpus, f"NVML ({library})"
    finally:
        try:
            nvml.call(("nvmlShutdown",))
        except NumaBindingError:
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


def inventory(sysfs_root: str = "/sys", procfs_root: str = "/proc",
              nvml_library: str | None = None) -> tuple[list[Gpu], str]:
    """Every NVIDIA GPU this process can use, in PCI order, and where they were found.

    NVML (``nvml_library``, default ``libnvidia-ml.so.1``) when it loads and starts, else the
    nvidia driver's sysfs directory, with a warning when that lists any GPU.
    """
    library = nvml_library or NVML_LIBRARY
    found = _nvml_inventory(library)
    if isinstance(found, str):
        gpus, source = _sysfs_inventory(sysfs_root, procfs_root)
        if not gpus:
            return [], f"no NVML ({found}), and nothing is bound to the nvidia driver in {source}"
        if found not in _warned:
            _warned.add(found)
            logger.warning(
                "NUMA binding: no NVML (%s); the GPUs are listed from %s, which shows every "
                "GPU of the host: in a container given only some of them (the NVIDIA container "
                "runtime) the local ranks may be bound near other GPUs than their own", found,
                source)
        found = gpus, source
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
                    f"NVML ({NVML_LIBRARY}), which did not load"
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
    gpus, source = inventory(sysfs_root, procfs_root, env.get(NVML_LIBRARY_ENV) or None)
    nvml = source.startswith("NVML")
    if not gpus:
        raise NumaBindingError(f"no NVIDIA GPU found: {source}" + (" reports none" if nvml else ""))
    visible = _visible(_cuda_order(gpus, env), env, nvml)
    return [g.pci for g in visible], source
