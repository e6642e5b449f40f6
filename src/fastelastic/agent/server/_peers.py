"""What the agent tells and asks its peer nodes: done, failed or leaving; lost members; the
exit barrier (a mixin of ``SimpleElasticAgent``)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from fastelastic.agent.server import _coord
from fastelastic.agent.server._runloop import AgentState
from fastelastic.errors import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousGracefulExitError,
    SignalException,
    StoreConnectionError,
    StoreError,
)
from fastelastic.events import EventSource

if TYPE_CHECKING:
    from fastelastic.agent.server._states import WorkerState
    from fastelastic.agent.server._workers import WorkerGroup, WorkerSpec

logger = logging.getLogger("fastelastic.agent.server.api")  # the agent's one logger name


class _AgentPeers:
    """The peer-facing half of ``SimpleElasticAgent`` (needs its attributes)."""

    _worker_group: WorkerGroup
    _store: Any
    _exit_barrier_timeout: float
    _in_exit_barrier: bool
    _agent_state: AgentState
    _store_gone: bool

    if TYPE_CHECKING:  # SimpleElasticAgent's and _AgentTelemetry's

        def _set_state(self, state: AgentState) -> None: ...

        def _enter_step(self, state: AgentState) -> None: ...

        def _record(self, state: str, source: EventSource, **kwargs: Any) -> None: ...

    def _leave(self) -> None:
        """Tells the rendezvous this node leaves for good, before its workers stop, so the
        survivors re-form without waiting for its connection to close. Not once it finished
        (the exit barrier: the peers know it is done) or ended."""
        if not self._agent_state.is_member:
            return
        self._set_state(AgentState.LEAVING)
        handler = self._worker_group.spec.rdzv_handler
        leave = getattr(handler, "leave", None)
        if leave is None:
            return
        try:
            leave()
        except (StoreError, RendezvousError, OSError) as e:  # the store may be gone already
            logger.warning("could not tell the rendezvous that this node leaves: %s", e)
        else:
            logger.info("[%s] told the rendezvous this node (group_rank=%s) leaves",
                        self._worker_group.spec.role, self._worker_group.group_rank)

    def _mark_done(self, spec: WorkerSpec) -> None:
        """Tells the peers this node finished, so its exit is not taken for a lost node."""
        mark = getattr(spec.rdzv_handler, "mark_done", None)
        if mark is None:
            return
        try:
            mark()
        except (StoreError, RendezvousError, OSError) as e:
            logger.warning("could not tell the other nodes that this one finished: %s", e)

    def _lost_members(self, spec: WorkerSpec) -> list[tuple[int, str]]:
        """Members of the running round lost since the last check (rendezvous permitting)."""
        check = getattr(spec.rdzv_handler, "lost_members", None)
        return list(check()) if check is not None else []

    def _report_lost_members(self, wg: WorkerGroup) -> bool:
        """Logs (and records as an event) every lost peer; True if the group must restart."""
        lost = self._lost_members(wg.spec)
        for rank, why in lost:
            logger.error(
                "[%s] node group_rank=%s of the running round was lost: %s; restarting the "
                "worker group (group_rank=%s)", wg.spec.role, rank, why, wg.group_rank,
            )
            self._record("NODE_LOST", EventSource.AGENT, raw_error=f"group_rank {rank}: {why}")
        return bool(lost)

    def _report_lost_members_after_failure(self, wg: WorkerGroup, state: WorkerState) -> bool:
        """``_report_lost_members`` for a group that failed. A check that cannot be made (the
        store went away with a peer, say) is logged and the failure handled as this node's
        own, so the workers' failures still reach the restart and the report."""
        try:
            return self._report_lost_members(wg)
        except RendezvousGracefulExitError:
            raise
        except (StoreError, RendezvousError, OSError) as e:
            if self._host_finished(wg, e):
                return False
            logger.warning(
                "[%s] worker group %s; could not check for lost nodes (%s): handling it as "
                "this node's failure", wg.spec.role, state.name, e,
            )
            return False

    def _host_finished(self, wg: WorkerGroup, e: BaseException) -> bool:
        """After a membership check failed with ``e``: True when the store is gone because its
        host finished its work (the rendezvous read its mark first: ``store_host_finished``).
        Then nothing is left to re-form with: this node monitors its workers to their end
        (``_store_gone``), and says so once. A lost host (no such mark) is False: the
        caller handles the failed check as it does any other.
        """
        if not isinstance(e, (StoreConnectionError, RendezvousConnectionError, ConnectionError)):
            return False
        if not getattr(wg.spec.rdzv_handler, "store_host_finished", False):
            return False
        self._store_gone = True
        logger.warning(
            "[%s] the rendezvous store's host finished its work and its store has gone (%s): "
            "nothing is left to re-form with; this node (group_rank=%s) monitors its workers "
            "and ends with their result", wg.spec.role, e, wg.group_rank)
        return True

    def _publish_failure(self) -> None:
        """Tells agents waiting in the exit barrier that this node failed, so they stop waiting."""
        if self._store is None:
            return
        try:
            _coord.publish_failure(self._store, self._worker_group.group_rank)
        except (StoreError, RendezvousError, OSError) as e:  # the store may be gone already
            logger.warning("could not publish the group failure to the store: %s", e)

    def _exit_barrier(self) -> None:
        """Keeps this agent alive until every agent finished, one failed, or the timeout.

        Waits at most ``exit_barrier_timeout`` seconds; a node whose group failed for good
        releases the barrier at once, so healthy nodes do not sit out the timeout.
        """
        self._enter_step(AgentState.EXIT_BARRIER)
        wg = self._worker_group
        logger.info(
            "Local worker group finished (%s). Waiting up to %s seconds for other agents",
            wg.state,
            self._exit_barrier_timeout,
        )
        start = time.monotonic()
        self._in_exit_barrier = True
        try:
            spec = wg.spec
            early = _coord.exit_barrier(
                self._store, wg.group_world_size or 1, self._exit_barrier_timeout,
                lost=lambda: self._lost_members(spec),
                check_every=max(spec.monitor_interval, 0.5),
            )
            if early is None:
                logger.info(
                    "Done waiting for other agents. Elapsed: %.3f s", _coord.elapsed_since(start)
                )
            else:
                logger.warning("Leaving the exit barrier early: %s", early)
        except SignalException as e:
            logger.warning("Got termination signal: %s", e.sigval)
            raise
        except (StoreConnectionError, RendezvousConnectionError, ConnectionError) as e:
            # This node's work is done; the store's host is gone (its node was lost, or the
            # job's last node left with it): nobody is left to wait for through it.
            logger.warning("Leaving the exit barrier early: its store cannot be reached (%s). "
                           "Elapsed: %.3f s", e, _coord.elapsed_since(start))
        except (StoreError, RendezvousError, OSError):
            logger.exception(
                "Error waiting on exit barrier. Elapsed: %.3f s", _coord.elapsed_since(start)
            )
        finally:
            self._in_exit_barrier = False
