"""Fixtures for the timer tests (the helpers live in timer_testlib)."""

from timer_testlib import fifo_path, workers  # noqa: F401 - pytest fixtures
