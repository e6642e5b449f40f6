"""Imported by a zygote in the tests: leaves ``torch.cuda.is_initialized()`` true, as an import
that created a CUDA context would (no GPU is needed: a stand-in ``torch`` module says so)."""

import sys
import types

_torch = types.ModuleType("torch")
_torch.cuda = types.SimpleNamespace(is_initialized=lambda: True)  # type: ignore[attr-defined]
sys.modules["torch"] = _torch
