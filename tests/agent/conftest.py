"""Fixtures for the agent tests (the helpers live in agent_testlib)."""

from agent_testlib import (  # noqa: F401 - pytest fixtures
    no_identical_env,
    shut_down_rendezvous,
    store_server,
)
