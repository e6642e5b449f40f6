"""Fixtures for the agent tests (the helpers live in agent_testlib)."""

from agent_testlib import no_identical_env, store_server  # noqa: F401 - pytest fixtures
