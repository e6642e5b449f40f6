"""Fixtures for the checkpoint tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def need_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("!!! torch 2.13 is not installed: the checkpoint's workers are untested")
