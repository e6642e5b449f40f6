"""``ElasticDistributedSampler``: torch's ``DistributedSampler`` that can resume mid-dataset.

This module needs torch (it subclasses ``torch.utils.data.DistributedSampler``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any, TypeVar

try:
    import torch
    from torch.utils.data.distributed import DistributedSampler
except ImportError as e:  # pragma: no cover - CI installs torch
    raise ImportError(
        "fastelastic.utils.data.ElasticDistributedSampler subclasses torch's "
        "DistributedSampler and needs torch: pip install 'torch==2.13.0'"
    ) from e

__all__ = ["ElasticDistributedSampler"]

T = TypeVar("T")


class ElasticDistributedSampler(DistributedSampler[T]):
    """Gives each of ``num_replicas`` ranks its share of the dataset, skipping the first
    ``start_index`` samples (the ones already consumed before a restart).

    Indices are shuffled per epoch (``set_epoch``) with the same generator and seed as torch's,
    so ours and torch's give every rank the same samples.

    Args:
        dataset: a sized dataset.
        num_replicas: number of ranks (default: the process group's world size).
        rank: this rank (default: the process group's rank).
        start_index: the first dataset index to sample from.

    Raises:
        TypeError: the dataset has no length.
        ValueError: ``start_index`` is not below the dataset's length.
    """

    def __init__(
        self,
        dataset: Any,
        num_replicas: int | None = None,
        rank: int | None = None,
        start_index: int = 0,
    ) -> None:
        super().__init__(dataset=dataset, num_replicas=num_replicas, rank=rank)
        if not isinstance(dataset, Sized):
            raise TypeError("Dataset must be an instance of collections.abc.Sized")
        size = len(dataset)
        if start_index >= size:
            raise ValueError(
                f"Start index {start_index} should be less than dataset size {size}"
            )
        self.start_index = start_index
        self.num_samples = math.ceil((size - start_index) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Iterator[T]:
        g = torch.Generator()
        g.manual_seed(self.epoch)
        count = len(self.dataset)  # type: ignore[arg-type]
        order = (torch.randperm(count - self.start_index, generator=g) + self.start_index).tolist()
        # pad by wrapping around so that every rank gets num_samples indices (torch wraps once
        # and fails an assertion when more ranks than samples remain; this keeps wrapping)
        while len(order) < self.total_size:
            order += order[: self.total_size - len(order)]
        mine = order[self.rank : self.total_size : self.num_replicas]
        assert len(mine) == self.num_samples
        return iter(mine)

    def __len__(self) -> int:
        return self.num_samples
