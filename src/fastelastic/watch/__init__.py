"""Seeing a running job: agents publish over ZeroMQ, ``fastelastic watch`` shows them.

The watcher binds the endpoint and every agent connects to it (``fastrun --events-endpoint``),
so one endpoint serves all agents of a job. See :mod:`fastelastic.watch.publisher` for the wire
format and :mod:`fastelastic.watch.view` for the terminal view.
"""

from fastelastic.watch.publisher import EventPublisher, PublishingHandler, agent_status
from fastelastic.watch.view import JobView, watch

__all__ = ["EventPublisher", "JobView", "PublishingHandler", "agent_status", "watch"]
