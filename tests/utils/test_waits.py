"""The sliced-wait helper (fastelastic._waits.Slices) on a clock the test moves."""

from __future__ import annotations

import math

import pytest

from fastelastic._waits import Slices


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _run(slices: Slices, clock: Clock, spend=None) -> list[tuple[float, bool]]:
    """Each pass's (timeout, final); a pass spends its timeout (or ``spend``) on the clock."""
    seen = []
    for t in slices:
        seen.append((round(t, 6), slices.final))
        clock.now += t if spend is None else spend
    return seen


def test_slices_cut_the_wait_and_the_last_one_reaches_the_deadline():
    clock = Clock()
    seen = _run(Slices(clock() + 2.5, 1.0, clock=clock), clock)
    assert seen == [(1.0, False), (1.0, False), (0.5, True)]
    assert clock.now == pytest.approx(102.5)


def test_one_slice_without_a_slice_length():
    clock = Clock()
    assert _run(Slices(clock() + 7.0, clock=clock), clock) == [(7.0, True)]


def test_a_passed_deadline_gives_no_pass_unless_a_last_look_is_asked():
    clock = Clock()
    assert _run(Slices(clock() - 1, 1.0, clock=clock), clock) == []
    seen = _run(Slices(clock() - 1, 1.0, clock=clock, floor=0.001, last_look=True), clock)
    assert seen == [(0.001, True)]


def test_the_last_look_comes_once_after_a_slice_that_overshot():
    clock = Clock()
    # each pass takes 1.5 s of a 1 s slice: the deadline passes inside the second one
    seen = _run(Slices(clock() + 2.0, 1.0, clock=clock, floor=0.001, last_look=True), clock,
                spend=1.5)
    assert seen == [(1.0, False), (0.5, True), (0.001, True)]


def test_the_floor_is_the_shortest_timeout():
    clock = Clock()
    assert _run(Slices(clock() + 0.0004, 1.0, clock=clock, floor=0.001), clock) == [
        (0.001, True)]


def test_passes_are_bounded_even_when_the_clock_stands_still():
    clock = Clock()
    slices = Slices(math.inf, 1.0, clock=clock, passes=5)
    assert len(_run(slices, clock, spend=0.0)) == 5


def test_the_deadline_can_move_between_iterations():
    clock = Clock()
    slices = Slices(clock() + 1.0, clock=clock)
    assert _run(slices, clock) == [(1.0, True)]
    assert slices.expired() and slices.left() == 0
    slices.deadline = clock() + 3.0
    assert _run(slices, clock) == [(3.0, True)]


def test_a_slice_must_be_positive():
    with pytest.raises(ValueError, match="longer than 0"):
        Slices(1.0, 0.0)
