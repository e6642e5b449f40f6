"""Data helpers for elastic training: ``CyclingIterator`` and ``ElasticDistributedSampler``.

``ElasticDistributedSampler`` subclasses torch's ``DistributedSampler``, so it is imported (with
torch) only when first used; ``CyclingIterator`` needs no torch.
"""

from typing import Any

from fastelastic.utils.data.cycling_iterator import CyclingIterator

__all__ = ["CyclingIterator", "ElasticDistributedSampler"]


def __getattr__(name: str) -> Any:
    if name == "ElasticDistributedSampler":
        from fastelastic.utils.data.elastic_distributed_sampler import ElasticDistributedSampler

        return ElasticDistributedSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
