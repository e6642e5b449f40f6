"""A worker's end is clean every time, with the machine kept busy (issue 35).

* README's example (``examples/ddp_train.py``) to its end, 2 workers, ``--preload torch``:
  it releases DDP and the process group in an order gloo cannot deadlock on.
* torch's launcher-test function (gloo ``init_process_group``, one ``all_reduce``, return
  without destroying the group) launched with 4 spawned workers by ``elastic_launch`` with a
  static rendezvous: the worker's end skips the interpreter's teardown.
* the same end in a script started plainly (``tests/run/plain_keeps_group.py``, 4 workers,
  no ``--preload``): the runner ends it without the teardown.

Each run is bounded; a run that hangs fails the test and its job is ended with its tree. CPU
burners (one per core) run beside every run. The counts are small here; ``FASTELASTIC_FULL=1``
runs the issue's targets: 100 ends of the example and 100 launches of 4 workers, and 30
plain launches of 4 workers.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest
from jobtree import end_job, start_job
from run_testlib import HERE, REPO, base_env, free_port

# alone: the CPU burners load every core, which other tests running beside them must not share
pytestmark = [pytest.mark.torch, pytest.mark.slow, pytest.mark.alone]

FULL = os.environ.get("FASTELASTIC_FULL") == "1"
RUN_TIMEOUT = 180.0  # one run, on a busy machine; a hang is far longer
EXAMPLE_RUNS = 100 if FULL else 2
LAUNCHES = 100 if FULL else 2
PLAIN_LAUNCHES = 30 if FULL else 5


@pytest.fixture
def busy_machine():
    """One spinning process per core for the length of the test (stopped at its end)."""
    burners = [start_job([sys.executable, "-c", "while True: pass"])
               for _ in range(os.cpu_count() or 2)]
    yield
    for p in burners:
        end_job(p)


def _finish(proc, what: str) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=RUN_TIMEOUT)
    except Exception:
        end_job(proc)
        pytest.fail(f"{what} did not end within {RUN_TIMEOUT:g}s (hung); its job was ended")
    return proc.returncode, out, err


@pytest.mark.timeout(EXAMPLE_RUNS * RUN_TIMEOUT + 60)
def test_readme_example_ends_cleanly_under_load(tmp_path, need_torch, busy_machine):
    env = base_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", LOGLEVEL="WARNING")
    times = []
    for i in range(EXAMPLE_RUNS):
        out = tmp_path / f"summary{i}.json"
        t0 = time.monotonic()
        proc = start_job(
            [sys.executable, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "2",
             "--preload", "torch", str(REPO / "examples" / "ddp_train.py"), "--steps", "4",
             "--ckpt-every", "2", "--ckpt-dir", str(tmp_path / f"ckpt{i}"), "--out", str(out)],
            env=env, stdout=open(os.devnull, "w"), stderr=-1, text=True,  # noqa: SIM115
        )
        code, _, err = _finish(proc, f"run {i} of the example")
        assert code == 0, f"run {i}: exit {code}\n{err[-3000:]}"
        assert "plainly" not in err, err[-2000:]  # the zygote forked the workers
        summary = json.loads(out.read_text())
        assert summary["world_size"] == 2 and summary["steps"] == 4, summary
        times.append(time.monotonic() - t0)
        print(f"example end {i + 1}/{EXAMPLE_RUNS}: ok in {times[-1]:.1f}s", flush=True)
    print(f"{EXAMPLE_RUNS} ends of the example, 0 hangs, 0 failures; "
          f"slowest run {max(times):.1f}s")


@pytest.mark.timeout(LAUNCHES * RUN_TIMEOUT + 60)
def test_function_that_keeps_its_group_ends_cleanly_under_load(need_torch, busy_machine):
    env = base_env(OMP_NUM_THREADS="1", LOGLEVEL="WARNING")
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env["PYTHONPATH"]])
    for i in range(LAUNCHES):
        proc = start_job([sys.executable, str(HERE / "dist_sum_job.py"), "4", str(free_port())],
                         env=env, stdout=-1, stderr=-1, text=True)
        code, out, err = _finish(proc, f"launch {i}")
        assert code == 0, f"launch {i}: exit {code}\n{err[-3000:]}"
        assert json.loads(out.strip().splitlines()[-1]) == [6, 6, 6, 6], out
        print(f"launch {i + 1}/{LAUNCHES}: ok", flush=True)
    print(f"{LAUNCHES} launches of 4 workers, 0 failures")


@pytest.mark.timeout(PLAIN_LAUNCHES * RUN_TIMEOUT + 60)
def test_plain_script_that_keeps_its_group_ends_cleanly_under_load(need_torch, busy_machine):
    env = base_env(LOGLEVEL="WARNING")
    for i in range(PLAIN_LAUNCHES):
        proc = start_job(
            [sys.executable, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "4",
             str(HERE / "plain_keeps_group.py")],
            env=env, stdout=-1, stderr=-1, text=True,
        )
        code, out, err = _finish(proc, f"plain launch {i}")
        assert code == 0, f"plain launch {i}: exit {code}\n{err[-3000:]}"
        assert out.splitlines() == ["sum 6"] * 4, out
        assert "terminate called" not in err, err[-3000:]
        print(f"plain launch {i + 1}/{PLAIN_LAUNCHES}: ok", flush=True)
    print(f"{PLAIN_LAUNCHES} plain launches of 4 workers, 0 failures")
