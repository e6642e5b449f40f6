"""The silence rule of the fast rendezvous's keep-alive watch (``SilenceDetector``), on a
simulated clock.

A node beats every ``interval``; a watcher polls its counter every ``poll`` seconds. A frozen
node must be declared silent no later than ``window`` after its last beat, and a live node, even
one whose beats arrive late by up to half an interval, never.
"""

from __future__ import annotations

import pytest

from fastelastic.rendezvous.fast._liveness import SilenceDetector


def _simulate(interval, window, poll, freeze_at, jitter=0.0, end=60.0, phase=0.037):
    """Returns (last beat time, detection time or None)."""
    beats = SilenceDetector(window, interval / 2)
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
    beats = SilenceDetector(5.0, 0.5)
    assert beats.observe({"p": 1}, now=0.0) == {}
    assert beats.observe({"p": 2}, now=30.0) == {}  # changed some time in the 30 s
    assert beats.observe({"p": 2}, now=30.1) == {}  # not 30 s of silence
    t, silent = 30.1, {}
    while not silent and t < 60:
        t = round(t + 0.1, 9)
        silent = beats.observe({"p": 2}, now=t)
    assert 30.0 + 5.0 - 0.2 <= t <= 30.0 + 5.0, t  # a window from the poll that saw it


def test_a_starved_watcher_gives_its_peers_a_fresh_window_instead_of_a_verdict():
    """A poll 3 s after the previous one (window 5 s): this process, or the store, was starved,
    and the peer's keep-alives may have been too. No verdict then; a peer that stays silent is
    still dropped one window later."""
    beats = SilenceDetector(5.0, 0.5)
    assert beats.observe({"p": 1}, now=0.0) == {}
    assert beats.observe({"p": 1}, now=1.0) == {}
    assert beats.observe({"p": 1}, now=4.0) == {}  # starved 3 s; 4 s still would be close
    assert beats.observe({"p": 1}, now=5.5) == {}  # 5.5 s since the change, but a fresh window
    t = 5.5
    silent = {}
    while not silent and t < 20:
        t = round(t + 0.1, 9)
        silent = beats.observe({"p": 1}, now=t)
    assert silent and 4.0 + 5.0 - 0.2 <= t <= 4.0 + 5.0, t
