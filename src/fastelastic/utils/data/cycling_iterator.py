"""``CyclingIterator``: runs a per-epoch iterator ``n`` times in a row."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

__all__ = ["CyclingIterator"]

_T = TypeVar("_T")


class CyclingIterator(Iterator[_T]):
    """Yields ``generator_fn(e)`` for ``e = start_epoch, ..., n - 1``, one after the other.

    Args:
        n: the number of epochs (cycles).
        generator_fn: returns the iterator of one epoch, given the epoch number.
        start_epoch: the first epoch (to resume).
    """

    def __init__(
        self, n: int, generator_fn: Callable[[int], Iterator[_T]], start_epoch: int = 0
    ) -> None:
        self._n = n
        self._epoch = start_epoch
        self._generator_fn = generator_fn
        self._iter = generator_fn(start_epoch)

    def __iter__(self) -> CyclingIterator[_T]:
        return self

    def __next__(self) -> _T:
        while True:
            try:
                return next(self._iter)
            except StopIteration:
                if self._epoch >= self._n - 1:
                    raise
                self._epoch += 1
                self._iter = self._generator_fn(self._epoch)
