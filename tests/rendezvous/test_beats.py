"""The silence rule of the fast rendezvous's keep-alive watch (``Beats``), on a simulated clock.

A node beats every ``interval``; a watcher polls its counter every ``poll`` seconds. A frozen
node must be declared silent no later than ``window`` after its last beat, and a live node, even
one whose beats arrive late by up to half an interval, never.
"""

from __future__ import annotations

import pytest

from fastelastic.rendezvous._liveness import Beats


def _simulate(interval, window, poll, freeze_at, jitter=0.0, end=60.0, phase=0.037):
    """Returns (last beat time, detection time or None)."""
    beats = Beats(window, interval / 2)
    counter, last_beat = 0, None
    next_beat = phase
    k = 0
    t = 0.0
    while t < end:
        while next_beat <= t and (freeze_at is None or next_beat < freeze_at):
            counter += 1
            last_beat = next_beat
            k += 1
            # a late beat, alternating, as a loaded machine delays its keep-alive thread
            next_beat = phase + k * interval + (jitter if k % 2 else 0.0)
        silent = beats.observe({"peer": counter}, now=t)
        if silent:
            return last_beat, t
        t = round(t + poll, 9)
    return last_beat, None


@pytest.mark.parametrize("poll", [0.1, 0.25, 0.5])
@pytest.mark.parametrize("freeze_offset", [0.0, 0.01, 0.3, 0.7, 0.99])
def test_a_frozen_node_is_dropped_within_the_window_of_its_last_beat(poll, freeze_offset):
    interval, window = 1.0, 5.0
    last, detected = _simulate(interval, window, poll, freeze_at=10.037 + freeze_offset)
    assert detected is not None
    assert detected - last <= window + 1e-9, (last, detected)
    assert detected - last >= window - 2 * poll - 1e-9  # and not much earlier


@pytest.mark.parametrize("poll", [0.1, 0.5, 1.25])
def test_a_live_node_with_late_beats_is_never_dropped(poll):
    _, detected = _simulate(1.0, 5.0, poll, freeze_at=None, jitter=0.5, end=120.0)
    assert detected is None


def test_a_long_pause_between_polls_does_not_date_a_change_back_to_the_last_poll():
    beats = Beats(5.0, 0.5)
    assert beats.observe({"p": 1}, now=0.0) == {}
    assert beats.observe({"p": 2}, now=30.0) == {}  # changed some time in the 30 s
    assert beats.observe({"p": 2}, now=30.1) == {}  # not 30 s of silence
    # dated at most one slack (0.5 s) early: silent once 4.5 s + the next gap would pass 5 s
    assert beats.observe({"p": 2}, now=33.9) == {}
    assert beats.observe({"p": 2}, now=34.4) == {"p": pytest.approx(4.9)}
