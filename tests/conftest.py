"""Fixtures for every test directory."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence

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
