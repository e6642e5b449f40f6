"""The agent server: worker specs and groups, ``SimpleElasticAgent`` and ``LocalElasticAgent``.

The agent starts the workers with everything ``torch.distributed.init_process_group()`` needs,
restarts the whole group when a worker fails or the membership changes, and reports results by
global rank. Mirrors ``torch.distributed.elastic.agent.server``.
"""

from fastelastic.agent.server.api import (
    ElasticAgent,
    RunResult,
    SimpleElasticAgent,
    Worker,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)

TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_TIMER_FILE",
    "ElasticAgent",
    "RunResult",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]
