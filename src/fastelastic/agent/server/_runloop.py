"""The agent's run loop as data: its states, their one transition function, and ``decide``.

``SimpleElasticAgent._invoke_run`` is the I/O around ``decide``: it waits for the workers,
monitors them, asks the rendezvous what ``decide`` asks for, and carries out the action.
Nothing here does I/O, reads a clock or touches the agent, so every decision can be tested
alone from a table (``tests/agent/test_runloop.py``).
"""

from __future__ import annotations

from enum import Enum

from fastelastic.agent.server._states import WorkerState

__all__ = ["TRANSITIONS", "AgentAction", "AgentState", "decide", "step", "transition"]


class AgentState(str, Enum):
    """Where the agent's run loop is (the worker group's own state is ``WorkerState``).

    INIT: constructed, ``run`` not called; RENDEZVOUS: joining a round, the first or after
    stopping the workers; RUNNING: workers started and monitored; STOPPING: stopping the
    workers, to start them again or after the last failure; EXIT_BARRIER: this node's workers
    succeeded, waiting for the other nodes; LEAVING: a death signal: telling the rendezvous
    this node leaves, then stopping the workers. Final: SUCCEEDED, FAILED (no restart left),
    ENDED (without a result: a signal, an error, or a rendezvous closed before this node
    joined).
    """

    INIT = "INIT"
    RENDEZVOUS = "RENDEZVOUS"
    RUNNING = "RUNNING"
    STOPPING = "STOPPING"
    EXIT_BARRIER = "EXIT_BARRIER"
    LEAVING = "LEAVING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    ENDED = "ENDED"

    @property
    def is_final(self) -> bool:
        """True once the run has ended (no transition leaves a final state)."""
        return not TRANSITIONS[self]

    @property
    def is_member(self) -> bool:
        """True while this node holds (or is getting) a seat its peers count on: a node
        leaving from here must tell them. In the exit barrier it already said it is done."""
        return self in _MEMBER


_S = AgentState
TRANSITIONS: dict[AgentState, frozenset[AgentState]] = {
    _S.INIT: frozenset({_S.RENDEZVOUS, _S.ENDED}),
    _S.RENDEZVOUS: frozenset({_S.RUNNING, _S.LEAVING, _S.ENDED}),
    _S.RUNNING: frozenset({_S.STOPPING, _S.EXIT_BARRIER, _S.FAILED, _S.LEAVING, _S.ENDED}),
    _S.STOPPING: frozenset({_S.RENDEZVOUS, _S.FAILED, _S.LEAVING, _S.ENDED}),
    _S.EXIT_BARRIER: frozenset({_S.SUCCEEDED, _S.ENDED}),
    _S.LEAVING: frozenset({_S.ENDED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.ENDED: frozenset(),
}
_MEMBER = frozenset({_S.RENDEZVOUS, _S.RUNNING, _S.STOPPING})


def transition(current: AgentState, new: AgentState) -> AgentState:
    """Returns ``new`` if the run loop may go there from ``current``.

    Raises:
        AssertionError: the transition is not in ``TRANSITIONS`` (a bug in the agent).
    """
    if new not in TRANSITIONS[current]:
        raise AssertionError(f"agent state {current.name} -> {new.name}")
    return new


def step(current: AgentState, new: AgentState) -> tuple[AgentState, bool]:
    """The state after a protected step (``_rendezvous``, ``_initialize_workers``,
    ``_restart_workers``, ``_stop_workers``, ``_monitor_workers``, ``_exit_barrier``) that
    stands for ``new``.

    Subclasses of ``SimpleElasticAgent`` may call these steps in an order of their own (torch
    allows it; NVIDIA's ``ft_launcher`` does), so a step records where the agent is and never
    refuses. Only the run loop's own decisions go through ``transition``.

    Returns:
        ``(new, in_order)``: ``in_order`` is False when the run loop itself would not have made
        this move (the caller logs it). A step into the state the agent is in is in order.
    """
    return new, new is current or new in TRANSITIONS[current]


class AgentAction(str, Enum):
    """What the run loop does after one look at the workers (see ``decide``)."""

    CONTINUE = "CONTINUE"  # nothing to do: wait for the workers again
    ASK_WAITING = "ASK_WAITING"  # ask the rendezvous how many nodes wait to join; decide again
    ASK_LOST = "ASK_LOST"  # ask the rendezvous which members of the round were lost; again
    RESTART = "RESTART"  # membership changed: restart the group without using a retry
    RETRY = "RETRY"  # the group failed on its own: restart it, using one retry
    SUCCEED = "SUCCEED"  # every worker succeeded: tell the peers, exit barrier, return
    FAIL = "FAIL"  # the group failed and no retry is left: stop, tell the peers, return
    ABORT = "ABORT"  # a worker group state the loop cannot handle (UNKNOWN...): raise


def decide(
    state: WorkerState,
    restarts_left: int,
    check_due: bool,
    waiting: int | None = None,
    lost: int | None = None,
) -> AgentAction:
    """The run loop's decision after the workers were monitored: pure, no I/O.

    Args:
        state: the worker group's state as the monitor just reported it.
        restarts_left: retries left (``max_restarts`` minus those used).
        check_due: the periodic membership check is due (its timer expired).
        waiting: nodes waiting to join the next round; None: not asked.
        lost: how many members of the running round were lost since the last check (0:
            none); None: not asked.

    Returns:
        An ``AgentAction``; ``ASK_WAITING``/``ASK_LOST`` mean: ask, then call again with the
        answer. A membership check asks only while the group is healthy and the check is due
        (waiting nodes first; lost members only if none wait). A failed group always asks for
        lost members first: a failure caused by a lost peer is not this node's and uses no
        retry.
    """
    ws = WorkerState
    if state == ws.SUCCEEDED:
        return AgentAction.SUCCEED
    if state in (ws.UNHEALTHY, ws.FAILED):
        if lost is None:
            return AgentAction.ASK_LOST
        if lost > 0:
            return AgentAction.RESTART
        return AgentAction.RETRY if restarts_left > 0 else AgentAction.FAIL
    if state != ws.HEALTHY:
        return AgentAction.ABORT
    if not check_due:
        return AgentAction.CONTINUE
    if waiting is None:
        return AgentAction.ASK_WAITING
    if waiting > 0:
        return AgentAction.RESTART
    if lost is None:
        return AgentAction.ASK_LOST
    return AgentAction.RESTART if lost > 0 else AgentAction.CONTINUE
