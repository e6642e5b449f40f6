"""Fixtures for the fastrun tests."""

from __future__ import annotations

import pytest
from run_testlib import torch_available


@pytest.fixture(scope="session")
def need_torch() -> None:
    if not torch_available():
        pytest.skip("!!! torch 2.13 is not installed: cannot compare fastrun with torchrun")
