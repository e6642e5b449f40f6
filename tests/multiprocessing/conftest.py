"""Fixtures of the multiprocessing tests."""

import pytest


@pytest.fixture
def logs_dir(tmp_path):
    d = tmp_path / "logs"
    d.mkdir()
    return str(d)
