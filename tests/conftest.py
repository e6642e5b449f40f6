"""Fixtures for every test directory."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence

import jobtree
import pytest


def _outputs_of(procs: Sequence[subprocess.Popen], timeout: float) -> list[str]:
    """Waits for each of ``procs`` (at most ``timeout`` seconds each) and returns their stdout.

    Each must exit 0 (the assertion shows the end of its stderr). Any still running when this
    returns or raises is killed.
    """
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            assert p.returncode == 0, err[-3000:]
            outs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return outs


@pytest.fixture
def outputs_of() -> Callable[[Sequence[subprocess.Popen], float], list[str]]:
    """:func:`_outputs_of`: the stdout of subprocesses started with text pipes, each exiting 0."""
    return _outputs_of


@pytest.fixture(autouse=True)
def _end_started_jobs():
    """Ends the jobs a test started (``jobtree.start_job``) that still run when it is over,
    however it ended (passed, failed, timed out), with every process they started."""
    yield
    ended = jobtree.end_started_jobs()
    if ended:
        print(f"ended {len(ended)} job(s) still running after the test: {ended}", file=sys.stderr)


# --- tests that must have the machine to themselves under pytest-xdist ------------------------
#
# ``@pytest.mark.alone``: the test runs while no other test of the run does (it loads every
# core on purpose). Each test of an xdist run holds the run's ``alone`` lock shared, an ``alone``
# test holds it exclusively. A test takes the ``gate`` lock exclusively before it takes
# ``alone`` and releases ``gate`` after, and an ``alone`` test keeps ``gate`` for its whole
# length: a waiting ``alone`` test stops new tests at the gate, so the running ones drain and
# it is never starved by overlapping shared holders. Both are flock(2) locks on files in the
# run's base temporary directory (one per run, shared by its workers): a worker that dies
# releases them. The locks wrap the whole test (setup, call, teardown) from outside
# pytest-timeout's timer: a test's time waiting for its turn is not counted against its timeout.


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)  # one process runs the tests one at a time: every test is alone
    alone = item.get_closest_marker("alone") is not None
    factory: pytest.TempPathFactory = item.config._tmp_path_factory  # type: ignore[attr-defined]
    run_dir = factory.getbasetemp().parent  # the base of the run; each worker's dir is in it
    gate, lock = (os.open(run_dir / f"fastelastic-{name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
                  for name in ("gate", "alone"))
    try:
        fcntl.flock(gate, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)
    finally:
        os.close(lock)  # closing a file's only descriptor releases its flock
        os.close(gate)
