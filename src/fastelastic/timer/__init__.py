"""Expiration timers (``torch.distributed.elastic.timer`` at ``fastelastic.timer``).

Workers wrap a step that may hang in ``expires(after=...)``; if it does not finish in time,
the timer server on the host (started by the agent when ``TORCHELASTIC_ENABLE_FILE_TIMER=1``)
kills the worker so the agent can restart the group. Usage in a worker::

    import os
    from fastelastic import timer

    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=60):
        train_step()

``FileTimerServer`` reads torch's wire format, so torch's ``FileTimerClient`` works with it (and
ours with torch's server); its loop is native and fires each timer at its deadline.
"""

from fastelastic.timer.api import (
    RequestQueue,
    TimerClient,
    TimerRequest,
    TimerServer,
    configure,
    expires,
)
from fastelastic.timer.file_based_local_timer import (
    FileTimerClient,
    FileTimerRequest,
    FileTimerServer,
    default_timer_file,
)
from fastelastic.timer.local_timer import (
    LocalTimerClient,
    LocalTimerServer,
    MultiprocessingRequestQueue,
)
from fastelastic.timer.stacks import enable_stack_dump

__all__ = [
    "FileTimerClient",
    "FileTimerRequest",
    "FileTimerServer",
    "LocalTimerClient",
    "LocalTimerServer",
    "MultiprocessingRequestQueue",
    "RequestQueue",
    "TimerClient",
    "TimerRequest",
    "TimerServer",
    "configure",
    "default_timer_file",
    "enable_stack_dump",
    "expires",
]
