"""Agent contract (WorkerSpec, Worker, WorkerGroup, WorkerState, RunResult), SimpleElasticAgent."""

from __future__ import annotations

import abc
import logging
import signal
import time
from typing import Any

from fastelastic.agent.server import _coord
from fastelastic.agent.server._peers import _AgentPeers
from fastelastic.agent.server._runloop import AgentAction, AgentState, decide, step, transition
from fastelastic.agent.server._states import WorkerState
from fastelastic.agent.server._telemetry import _AgentTelemetry
from fastelastic.agent.server._workers import RunResult, Worker, WorkerGroup, WorkerSpec
from fastelastic.errors import (
    RendezvousError,
    RendezvousGracefulExitError,
    RendezvousMemberLostError,
    SignalException,
    StoreError,
)
from fastelastic.events import EventSource
from fastelastic.metrics import prof, put_metric

__all__ = [
    "ElasticAgent",
    "RunResult",
    "SimpleElasticAgent",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
]

_TERMINAL_STATE_SYNC_ID = _coord.TERMINAL_STATE_SYNC_ID
_MAX_REJOINS = 100  # rendezvous attempts in a row that may end with a member lost
_EXCHANGE_TIMEOUT_S = 600.0  # bound on the rank exchange with a store that has no timeout
DEFAULT_ROLE = "default"
logger = logging.getLogger(__name__)


class ElasticAgent(abc.ABC):
    """A process that manages one or more local worker processes.

    Usage::

        result = agent.run()
        if result.is_failed():
            print("worker 0 failed with exit code", result.failures[0].exitcode)
        else:
            print(result.return_values[0])
    """

    @abc.abstractmethod
    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Runs the workers, restarting the group on failure up to ``max_restarts``.

        Returns:
            The return values or failures of this agent's workers, by global rank.
        """

    @abc.abstractmethod
    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        """Returns the (mutable) ``WorkerGroup`` of ``role``."""


class SimpleElasticAgent(_AgentPeers, _AgentTelemetry, ElasticAgent):
    """An ``ElasticAgent`` managing the ``WorkerGroup`` of a single ``WorkerSpec``.

    Subclasses provide ``_start_workers``, ``_stop_workers``, ``_monitor_workers`` and
    ``_shutdown``; they may override ``_wait_for_workers`` to wake the moment a worker exits
    (the default sleeps ``monitor_interval`` as torch does).
    """

    def __init__(
        self, spec: WorkerSpec, exit_barrier_timeout: float = 300, shutdown_timeout: int = 30
    ):
        self._worker_group = WorkerGroup(spec)
        self._remaining_restarts = spec.max_restarts
        self._store: Any = None
        self._exit_barrier_timeout = exit_barrier_timeout
        self._shutdown_timeout = shutdown_timeout
        self._total_execution_time = 0
        self._in_exit_barrier = False
        self._agent_state = AgentState.INIT
        self._store_gone = False  # the store's host finished and its store went with it

    def _set_state(self, state: AgentState) -> None:
        """The one place the run loop's state changes (``_runloop.TRANSITIONS``).

        Raises:
            AssertionError: an illegal transition (a bug in the agent).
        """
        self._agent_state = transition(self._agent_state, state)
        logger.debug("[%s] agent state -> %s", self._worker_group.spec.role, state.name)

    def _enter_step(self, state: AgentState) -> None:
        """A protected step moves the agent to ``state`` (``_runloop.step``): recorded, never
        refused, so subclasses may drive the steps in their own order."""
        before = self._agent_state
        self._agent_state, in_order = step(before, state)
        if not in_order:
            logger.debug("[%s] agent state %s -> %s: a step out of the run loop's order "
                         "(recorded)", self._worker_group.spec.role, before.name, state.name)

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @abc.abstractmethod
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Starts ``local_world_size`` workers; returns ``{local_rank: worker id}``."""

    @abc.abstractmethod
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stops every worker of the group, whatever state it is in."""

    @abc.abstractmethod
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """Checks the workers (without blocking) and returns the group's new state."""

    @abc.abstractmethod
    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        """Releases everything the agent allocated; workers get ``death_sig``, then SIGKILL."""

    def _wait_for_workers(self, worker_group: WorkerGroup, timeout: float | None) -> None:
        """Blocks up to ``timeout`` seconds (None: indefinitely) or until a worker may have
        changed state. This default cannot see exits, so it sleeps ``monitor_interval`` at most.
        """
        interval = worker_group.spec.monitor_interval
        time.sleep(interval if timeout is None else min(timeout, interval))

    def _membership_check_interval(self, spec: WorkerSpec) -> float | None:
        """Seconds between ``num_nodes_waiting`` checks; None when membership cannot change.

        The ``static`` rendezvous has a fixed membership, so the agent then needs no timer at
        all and sleeps until a worker exits or a signal arrives.
        """
        return None if spec.rdzv_handler.get_backend() == "static" else spec.monitor_interval

    @prof
    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        """Runs the rendezvous, then assigns ranks and world sizes to the workers."""
        self._enter_step(AgentState.RENDEZVOUS)
        spec = worker_group.spec
        for _ in range(_MAX_REJOINS):  # a member lost before the workers start: join again
            try:
                self._rendezvous_once(worker_group)
                return
            except RendezvousMemberLostError as e:
                logger.warning("[%s] a node was lost before the workers started (%s); "
                               "re-joining", spec.role, e)
        raise RendezvousMemberLostError([(-1, f"members kept being lost {_MAX_REJOINS} times")])

    def _rendezvous_once(self, worker_group: WorkerGroup) -> None:
        spec = worker_group.spec
        with self.record_duration("RENDEZVOUS"):
            rdzv_info = spec.rdzv_handler.next_rendezvous()
        store = rdzv_info.store
        group_rank = rdzv_info.rank
        group_world_size = rdzv_info.world_size
        bootstrap = rdzv_info.bootstrap_store_info
        master_addr = spec.master_addr or (bootstrap.master_addr if bootstrap else None)
        master_port = spec.master_port or (bootstrap.master_port if bootstrap else None)
        self._store = store
        try:
            _coord.release_on_disconnect(store, group_rank)
        except (StoreError, RendezvousError, OSError) as e:  # an optimisation: still times out
            logger.warning("could not arm the exit-barrier release on disconnect: %s", e)
        with self.record_duration("ASSIGN_WORKER_RANKS"):
            workers = self._assign_worker_ranks(store, group_rank, group_world_size, spec)
        worker_group.workers = workers
        worker_group.store = store
        worker_group.group_rank = group_rank
        worker_group.group_world_size = group_world_size
        worker_group.master_addr = master_addr
        worker_group.master_port = master_port
        logger.info(
            "[%s] Rendezvous complete: restart_count=%s master=%s:%s group_rank=%s "
            "group_world_size=%s global_ranks=%s role_ranks=%s world_size=%s role_world_size=%s",
            spec.role,
            self.restart_count,
            master_addr,
            master_port,
            group_rank,
            group_world_size,
            [w.global_rank for w in workers],
            [w.role_rank for w in workers],
            workers[0].world_size,
            workers[0].role_world_size,
        )

    @prof
    def _assign_worker_ranks(
        self, store: Any, group_rank: int, group_world_size: int, spec: WorkerSpec
    ) -> list[Worker]:
        """Computes each local worker's global rank, role rank and world sizes.

        Fast path (``TORCH_ELASTIC_WORKER_IDENTICAL=1`` or ``FASTELASTIC_WORKER_IDENTICAL=1``):
        every node runs the same workers, ranks are ``group_rank * local_world_size + i``, and
        no store is used. Slow path (mixed roles or sizes): agents publish their role info,
        agent 0 computes prefix sums in group-rank order (overall and per role) and publishes
        every agent's base ranks; each agent then reads its own. Exactly torch's result.
        """
        wait_members = getattr(getattr(spec, "rdzv_handler", None), "wait_members", None)
        wait = None
        if wait_members is not None:
            limit = getattr(store, "timeout", None)  # as bounded as the store's own waits
            seconds = limit.total_seconds() if limit is not None else _EXCHANGE_TIMEOUT_S
            deadline = time.monotonic() + seconds

            def wait(keys: list[str]) -> None:
                wait_members(store, keys, deadline)

        base, world, role_base, role_world = _coord.exchange_ranks(
            store, group_rank, group_world_size, spec.role, spec.local_world_size, wait
        )
        return [
            Worker(
                local_rank=i,
                global_rank=base + i,
                role_rank=role_base + i,
                world_size=world,
                role_world_size=role_world,
            )
            for i in range(spec.local_world_size)
        ]

    @prof
    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        """Rendezvous, then start a fresh set of workers (optimistically HEALTHY)."""
        role = worker_group.spec.role
        self._enter_step(AgentState.RENDEZVOUS)
        logger.info("[%s] Rendezvous'ing worker group", role)
        self._rendezvous(worker_group)
        logger.info("[%s] Starting worker group", role)
        worker_ids = self._start_workers(worker_group)
        self._enter_step(AgentState.RUNNING)
        for local_rank, w_id in worker_ids.items():
            worker = worker_group.workers[local_rank]
            worker.id = w_id
            self._record("START", EventSource.WORKER, worker=worker)
        worker_group.state = WorkerState.HEALTHY

    @prof
    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        """Stops all local workers, then rendezvous and starts them again."""
        logger.info("[%s] Stopping worker group", worker_group.spec.role)
        self._enter_step(AgentState.STOPPING)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.STOPPED
        self._initialize_workers(worker_group)

    @prof
    def run(self, role: str = DEFAULT_ROLE) -> RunResult | None:  # type: ignore[override]
        """Runs the workers until success, final failure or a signal (see ``ElasticAgent``).

        On a death signal (``SignalException``) the agent first tells the rendezvous this
        node leaves (``rdzv_handler.leave()``, when the handler has one), so the other nodes
        re-form at once, then stops its workers (the signal, then SIGKILL after
        ``shutdown_timeout``); it never closes the rendezvous for the others.

        Returns None, as torch, when the rendezvous was closed before this node joined a
        round (``RendezvousGracefulExitError``): the job ended without it.
        """
        start = time.monotonic()
        shutdown_called = False
        try:
            result = self._invoke_run(role)
            self._total_execution_time = int(time.monotonic() - start)
            self._record_metrics(result)
            self._record_worker_events(result)
            return result
        except RendezvousGracefulExitError as e:
            logger.info("Rendezvous gracefully exited: %s", e)
            return None
        except SignalException as e:
            logger.warning("Received %s death signal, shutting down workers", e.sigval)
            try:
                self._leave()
            finally:
                self._shutdown(e.sigval, timeout=self._shutdown_timeout)  # type: ignore[arg-type]
                shutdown_called = True
            raise
        finally:
            if not self._agent_state.is_final:
                self._set_state(AgentState.ENDED)
            if not shutdown_called:
                self._shutdown(timeout=self._shutdown_timeout)
            self._total_execution_time = int(time.monotonic() - start)

    def _invoke_run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """The I/O around ``_runloop.decide``: wait, monitor, ask what it asks, act."""
        wg = self._worker_group
        spec = wg.spec
        role = spec.role
        logger.info("[%s] starting workers for entrypoint: %s", role, spec.get_entrypoint_name())
        self._initialize_workers(wg)
        interval = self._membership_check_interval(spec)
        next_check = None if interval is None else time.monotonic() + interval
        while True:
            if wg.state == WorkerState.INIT:
                raise AssertionError("worker group still in INIT after start")
            timeout = None if next_check is None else max(0.0, next_check - time.monotonic())
            self._wait_for_workers(wg, timeout)
            run_result = self._monitor_workers(wg)
            state = run_result.state
            wg.state = state
            put_metric(f"workers.{role}.remaining_restarts", self._remaining_restarts)
            put_metric(f"workers.{role}.{state.name.lower()}", 1)
            check_due = False
            if state == WorkerState.HEALTHY and interval is not None and next_check is not None:
                now = time.monotonic()
                if now >= next_check:
                    check_due = True
                    next_check = now + interval  # membership changes do not count as retries
            action = self._decide(wg, state, check_due)
            if action is AgentAction.CONTINUE:
                continue
            if action is AgentAction.SUCCEED:
                logger.info("[%s] worker group successfully finished", role)
                self._set_state(AgentState.EXIT_BARRIER)
                if not self._store_gone:  # else nobody is left to tell or wait for
                    self._mark_done(spec)
                    self._exit_barrier()
                self._set_state(AgentState.SUCCEEDED)
                return run_result
            if action is AgentAction.FAIL:
                self._stop_workers(wg)
                wg.state = WorkerState.FAILED
                self._set_state(AgentState.FAILED)
                if not self._store_gone:
                    self._publish_failure()
                return self._failed_result(wg, run_result)
            if action is AgentAction.ABORT:
                raise RuntimeError(f"[{role}] Worker group in {state.name} state")
            if action is AgentAction.RETRY:
                logger.info(
                    "[%s] Worker group %s. %s/%s attempts left; will restart worker group",
                    role,
                    state.name,
                    self._remaining_restarts,
                    spec.max_restarts,
                )
                self._remaining_restarts -= 1
            self._restart_workers(wg)  # RESTART (a peer lost or waiting) or RETRY
            if interval is not None:
                next_check = time.monotonic() + interval

    def _failed_result(self, wg: WorkerGroup, run_result: RunResult) -> RunResult:
        """The run's result when the group failed for good: FAILED, and never without a
        failure. A group the monitor found UNHEALTHY (a hang verdict, a D-state worker) exited
        no worker by itself: the agent stopped them, and ``_stopped_failures`` names them."""
        failures = run_result.failures or self._stopped_failures(wg, run_result.state)
        return RunResult(state=WorkerState.FAILED, return_values=run_result.return_values,
                         failures=failures)

    def _stopped_failures(self, wg: WorkerGroup, state: WorkerState) -> dict[int, Any]:
        """The failures of a group stopped as ``state`` with no restart left, by global rank.

        This agent knows no culprit: every local worker, its exit status unknown.
        ``LocalElasticAgent`` names the culprits and says why they were stopped.
        """
        from fastelastic.multiprocessing.errors import EXITCODE_UNKNOWN, ProcessFailure

        why = f"the worker group was {state.name} with no restart left: the agent stopped it"
        return {w.global_rank: ProcessFailure(w.local_rank, int(w.id or -1), EXITCODE_UNKNOWN,
                                              "", unknown_exit="stopped by the agent",
                                              stopped_for=why)
                for w in wg.workers}

    def _decide(self, wg: WorkerGroup, state: WorkerState, check_due: bool) -> AgentAction:
        """``decide``, asking the rendezvous what it asks for (at most once each)."""
        waiting: int | None = None
        lost: int | None = None
        for _ in range(3):  # waiting nodes, lost members, then a verdict
            if self._store_gone:  # no round can form again: no check, no restart
                return decide(state, 0, False, None, 0)
            action = decide(state, self._remaining_restarts, check_due, waiting, lost)
            if action is AgentAction.ASK_WAITING:
                try:
                    waiting = wg.spec.rdzv_handler.num_nodes_waiting()
                except (StoreError, RendezvousError, OSError) as e:
                    if not self._host_finished(wg, e):
                        raise
                    continue
                if waiting > 0:
                    logger.info(
                        "[%s] Detected %s new nodes from group_rank=%s; will restart worker group",
                        wg.spec.role,
                        waiting,
                        wg.group_rank,
                    )
            elif action is AgentAction.ASK_LOST:
                try:
                    if state == WorkerState.HEALTHY:
                        lost = int(self._report_lost_members(wg))
                    else:  # a peer lost with the workers: restart without using a retry
                        lost = int(self._report_lost_members_after_failure(wg, state))
                except (StoreError, RendezvousError, OSError) as e:
                    if not self._host_finished(wg, e):
                        raise
            else:
                return action
        raise AssertionError(f"decide kept asking: {action.name} after waiting={waiting} "
                             f"lost={lost}")
