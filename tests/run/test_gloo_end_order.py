"""What README's example relies on to end without a deadlock, checked against torch 2.13's gloo.

``examples/ddp_train.py`` keeps the handles of its collectives on Python-made tensors until the
process ends, so that no gloo thread drops such a tensor (which takes the GIL) while
``~ProcessGroupGloo`` joins those threads holding the GIL. These probes pin down the torch
behaviour that reasoning depends on; if a torch release changes it, they say so.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from run_testlib import HERE, base_env, free_port

pytestmark = [pytest.mark.torch, pytest.mark.timeout(120)]


def _probe(mode: str) -> dict:
    r = subprocess.run([sys.executable, str(HERE / "gloo_end_probe.py"), str(free_port()), mode],
                       env=base_env(), capture_output=True, text=True, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_held_handle_keeps_the_tensor_from_gloo_threads_through_the_join(need_torch):
    seen = _probe("held")
    assert seen == {
        "runloops": 2,  # ProcessGroupGloo's default worker threads
        "extra_refs_held": 1,  # the work keeps the tensor's Python object alive
        "runloops_after_destroy": 0,  # the group was freed: ~ProcessGroupGloo joined them
        "extra_refs_after_destroy": 1,  # ... and neither thread dropped the tensor
        "extra_refs_after_handle": 0,  # dropped here, by the thread holding the GIL
    }


def test_dynamo_imported_after_init_keeps_the_group_past_destroy(need_torch):
    seen = _probe("dynamo-late")
    assert seen["runloops"] == 2 and seen["runloops_after_destroy"] == 2, seen
