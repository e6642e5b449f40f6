"""The worker guardian: every registered group is SIGKILLed when the agent's pipe closes."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest
from mphelpers import wait_gone

from fastelastic.multiprocessing._guardian import _Guardian

pytestmark = pytest.mark.timeout(60)


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen(["sleep", "60"], process_group=0)


def test_a_restarted_guardian_still_reaps_the_groups_registered_before():
    """A guardian that died is replaced at the next registration; the new one must also kill
    the groups registered with the old one, or they outlive the agent."""
    g = _Guardian()
    early, late = _sleeper(), _sleeper()
    try:
        g.register(early.pid)
        first = g.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_gone(first, 10)
        g.register(late.pid)  # notices the dead guardian and starts a new one
        assert g.pid not in (None, first)
        g.shutdown()  # as if the agent died: the new guardian kills what it knows
        assert late.wait(10) == -signal.SIGKILL
        # the guardian has exited (shutdown waited for it): every kill it would send is sent
        assert early.wait(5) == -signal.SIGKILL
    finally:
        for p in (early, late):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_unregistered_groups_are_not_handed_to_a_new_guardian():
    g = _Guardian()
    kept, done, third = _sleeper(), _sleeper(), _sleeper()
    try:
        g.register(kept.pid)
        g.register(done.pid)
        first = g.pid
        os.kill(first, signal.SIGKILL)
        assert wait_gone(first, 10)
        g.unregister(done.pid)  # while no guardian runs
        g.register(third.pid)  # starts a new guardian
        g.shutdown()
        assert third.wait(10) == -signal.SIGKILL
        assert kept.wait(5) == -signal.SIGKILL
        assert done.poll() is None  # forgotten: not killed
    finally:
        for p in (kept, done, third):
            if p.poll() is None:
                p.kill()
                p.wait()
