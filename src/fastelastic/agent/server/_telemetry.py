"""Events and metrics the agent records (torch's names and metadata), as a mixin."""

from __future__ import annotations

import functools
import json
import logging
import socket
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from fastelastic.events import Event, EventSource, get_logging_handler, record
from fastelastic.metrics import put_metric

if TYPE_CHECKING:
    from fastelastic.agent.server._workers import RunResult, Worker, WorkerGroup


@functools.lru_cache(maxsize=1)
def _get_fq_hostname() -> str:
    # Resolved once, and only when an event is actually recorded somewhere.
    return socket.getfqdn(socket.gethostname())


class _AgentTelemetry:
    """Event and metric recording of ``SimpleElasticAgent`` (needs its attributes)."""

    _worker_group: WorkerGroup
    _remaining_restarts: int
    _total_execution_time: int

    @property
    def restart_count(self) -> int:
        """How many times the worker group has been restarted after a failure."""
        return self._worker_group.spec.max_restarts - self._remaining_restarts

    def get_event_failed(self) -> Event:
        """The agent-level FAILED event (with the current exception's traceback)."""
        return self._construct_event("FAILED", EventSource.AGENT, raw_error=traceback.format_exc())

    def get_event_succeeded(self) -> Event:
        """The agent-level SUCCEEDED event."""
        return self._construct_event("SUCCEEDED", EventSource.AGENT)

    def _record(self, state: str, source: EventSource, **kwargs: Any) -> None:
        destination = self._worker_group.spec.event_log_handler
        # Building an event resolves the host name: skip it when nobody listens.
        if isinstance(get_logging_handler(destination), logging.NullHandler):
            return
        record(self._construct_event(state, source, **kwargs), destination)

    def _record_worker_events(self, result: RunResult) -> None:
        for worker in self._worker_group.workers:
            failure = result.failures.get(worker.global_rank)
            self._record(
                self._get_worker_state(worker, result),
                EventSource.WORKER,
                worker=worker,
                raw_error=json.dumps(failure.error_file_data) if failure else None,
                exit_code=failure.exitcode if failure else None,
                worker_pid=failure.pid if failure else None,
            )

    def _get_worker_state(self, worker: Worker, result: RunResult) -> str:
        failure = result.failures.get(worker.global_rank)
        if result.state.value in ("UNHEALTHY", "FAILED") and not failure:
            return "TERMINATED"  # stopped by this agent
        if failure or worker.global_rank in result.return_values:
            return result.state.value
        if result.state.value == "SUCCEEDED":
            return result.state.value  # binaries have no return values
        raise ValueError(f"Unknown worker: {worker.global_rank}")

    @contextmanager
    def record_duration(self, state: str) -> Iterator[None]:
        """Records an AGENT event named ``state`` with the block's duration in milliseconds."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self._record(state, EventSource.AGENT, duration_ms=(time.perf_counter() - start) * 1000)

    def _construct_event(
        self,
        state: str,
        source: EventSource,
        worker: Worker | None = None,
        raw_error: str | None = None,
        duration_ms: float | None = None,
        exit_code: int | None = None,
        worker_pid: int | None = None,
    ) -> Event:
        wg = self._worker_group
        spec = wg.spec
        md: dict[str, Any] = {
            "group_world_size": wg.group_world_size,
            "entry_point": spec.get_entrypoint_name(),
        }
        if worker:
            md.update(
                local_rank=(worker.local_rank,),
                role_rank=(worker.role_rank,),
                role_world_size=(worker.role_world_size,),
                exit_code=(exit_code,),
                worker_pid=(worker_pid,),
            )
        metadata: dict[str, Any] = {
            "run_id": spec.rdzv_handler.get_run_id(),
            "global_rank": worker.global_rank if worker else None,
            "group_rank": wg.group_rank,
            "worker_id": str(worker.id) if worker else None,
            "role": spec.role,
            "hostname": _get_fq_hostname(),
            "state": state,
            "total_run_time": self._total_execution_time,
            "rdzv_backend": spec.rdzv_handler.get_backend(),
            "raw_error": raw_error,
            "metadata": json.dumps(md),
            "agent_restarts": self.restart_count,
            "duration_ms": duration_ms,
        }
        return Event(f"torchelastic.worker.status.{state}", source=source, metadata=metadata)

    def _record_metrics(self, group_results: RunResult) -> None:
        is_failed = group_results.is_failed()
        spec = self._worker_group.spec
        if is_failed:
            flakiness = 100.0
        else:
            flakiness = 100.0 - 100.0 * (self._remaining_restarts + 1) / (spec.max_restarts + 1)
        put_metric(f"workers.{spec.role}.flakiness", int(flakiness))
        restarted = self._remaining_restarts != spec.max_restarts
        put_metric(f"workers.{spec.role}.run_total", 1)
        for name, cond in (
            ("run_success_with_retries", not is_failed and restarted),
            ("run_success_no_retries", not is_failed and not restarted),
            ("run_failed_with_retries", is_failed and restarted),
            ("run_failed_no_retries", is_failed and not restarted),
        ):
            put_metric(f"workers.{spec.role}.{name}", 1 if cond else 0)
