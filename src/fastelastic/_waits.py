"""Waits cut into slices: one helper for every wait loop (the rendezvous machine's generators,
which run on an injected clock, and the I/O layer's blocking calls alike).

A wait that must notice something besides its own key (a decider that died, a member lost, the
round decided meanwhile) waits in slices and re-checks between them::

    for timeout in Slices(deadline, every=1.0):
        if store.wait(keys, timeout):        # (or ``yield`` the request, in a generator)
            break
        if something_else_happened():        # the re-check between slices
            ...
    else:
        ...                                  # the deadline passed (or the bound on passes)

:class:`Slices` owns the deadline, the slice, the bound on passes and the last look; the loop's
body owns the wait and the re-check (a generator cannot hand its ``yield`` to a callback).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator

__all__ = ["MAX_PASSES", "Slices"]

MAX_PASSES = 10_000_000  # a safety bound only: far above any deadline / slice in use


class Slices:
    """The timeouts of a wait until ``deadline`` (on ``clock``), each at most ``every`` seconds.

    Iterating yields each pass's timeout: what is left of the wait, at most ``every`` and at
    least ``floor``. It ends once the deadline passed, or after ``passes`` passes (a bound that
    a correct clock never reaches). With ``last_look``, a pass that starts after the deadline
    still comes, once (of ``floor`` seconds), and is the last: a wait that always looks before
    it gives up, and a poll that decides with what it sees then. ``final`` tells whether the
    current pass is the one that reaches the deadline.

    The deadline may be moved (``deadline = ...``) between iterations; each iteration starts
    its own count of passes.
    """

    __slots__ = ("clock", "deadline", "every", "final", "floor", "last_look", "passes")

    def __init__(self, deadline: float, every: float = math.inf, *,
                 clock: Callable[[], float] = time.monotonic, floor: float = 0.0,
                 passes: int = MAX_PASSES, last_look: bool = False) -> None:
        if not every > 0:
            raise ValueError(f"a slice must be longer than 0 s (got {every!r})")
        self.deadline = deadline
        self.every = every
        self.clock = clock
        self.floor = floor
        self.passes = passes
        self.last_look = last_look
        self.final = False

    def left(self) -> float:
        """Seconds until the deadline (negative once it passed)."""
        return self.deadline - self.clock()

    def expired(self) -> bool:
        """Whether the deadline passed."""
        return self.clock() >= self.deadline

    def __iter__(self) -> Iterator[float]:
        for _ in range(self.passes):
            left = self.deadline - self.clock()
            if left <= 0 and not self.last_look:
                return
            self.final = left <= self.every
            yield max(min(left, self.every), self.floor)
            if left <= 0:
                return
