"""Fixtures for the hang-check tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def need_torch() -> None:
    try:
        import torch.distributed  # noqa: F401
    except ImportError:
        pytest.skip("!!! torch 2.13 is not installed: the hang check's jobs are untested")
