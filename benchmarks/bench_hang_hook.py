"""The per-step cost of the hang check's progress mark (issue 26's target: <= 1 us above an
empty global optimizer-step hook). ``impl=torch`` is torch's own dispatch of an empty global
hook; ``impl=fastelastic`` is the same dispatch of the mark, which writes the step count and
the time into a mapped slot. Both call the hook as torch does: ``hook(optimizer, args, kwargs)``.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="!!! torch is not installed: no hook to measure")


@pytest.fixture
def marked_slot():
    from fastelastic.progress import _worker as w
    from fastelastic.progress._launch import Slots

    slots = Slots()
    path = slots.prepare([0])[0]
    saved = w._slot
    w._slot = None
    w.install(path)
    yield w
    w._slot = saved  # None: the wrappers install() put on torch do nothing from now on
    if w._opt_handle is not None:
        w._opt_handle.remove()
        w._opt_handle = None
    slots.close()


@pytest.mark.parametrize("impl", ["fastelastic", "torch"])
def test_step_hook(benchmark, impl: str, marked_slot) -> None:
    torch.set_num_threads(1)
    p = torch.zeros(1, requires_grad=True)
    opt = torch.optim.SGD([p], lr=0.1)
    hook = marked_slot._on_step if impl == "fastelastic" else (lambda o, a, k: None)
    benchmark.extra_info["what"] = "one global optimizer-step hook call (torch: empty)"
    benchmark.pedantic(hook, args=(opt, (), {}), rounds=200_000, warmup_rounds=1000)
    if impl == "fastelastic":
        assert marked_slot._slot[marked_slot.F_STEPS] >= (1 if benchmark.disabled else 200_000)
