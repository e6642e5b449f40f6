"""The run loop's decision and states, alone: tables in, actions and transitions out."""

from __future__ import annotations

import itertools

import pytest

from fastelastic.agent.server import WorkerState
from fastelastic.agent.server._runloop import (
    TRANSITIONS,
    AgentAction,
    AgentState,
    decide,
    transition,
)

A = AgentAction
W = WorkerState
# (worker group state, restarts left, check due, waiting nodes, lost members) -> action;
# None: the rendezvous was not asked.
TABLE = [
    # every worker succeeded: nothing else matters, nothing is asked
    (W.SUCCEEDED, 3, False, None, None, A.SUCCEED),
    (W.SUCCEEDED, 0, True, None, None, A.SUCCEED),
    # healthy, no check due: keep waiting, ask nothing
    (W.HEALTHY, 3, False, None, None, A.CONTINUE),
    (W.HEALTHY, 0, False, None, None, A.CONTINUE),
    # healthy, check due: waiting nodes first, lost members only when none wait
    (W.HEALTHY, 3, True, None, None, A.ASK_WAITING),
    (W.HEALTHY, 3, True, 2, None, A.RESTART),
    (W.HEALTHY, 0, True, 1, None, A.RESTART),  # membership restarts use no retry
    (W.HEALTHY, 3, True, 0, None, A.ASK_LOST),
    (W.HEALTHY, 3, True, 0, 0, A.CONTINUE),
    (W.HEALTHY, 3, True, 0, 1, A.RESTART),
    (W.HEALTHY, 0, True, 0, 2, A.RESTART),
    # failed or unhealthy: a lost peer first (its loss is not ours), then retries
    (W.FAILED, 3, False, None, None, A.ASK_LOST),
    (W.FAILED, 3, True, None, None, A.ASK_LOST),
    (W.UNHEALTHY, 3, False, None, None, A.ASK_LOST),
    (W.FAILED, 3, False, None, 1, A.RESTART),
    (W.FAILED, 0, False, None, 1, A.RESTART),
    (W.UNHEALTHY, 0, False, None, 1, A.RESTART),
    (W.FAILED, 3, False, None, 0, A.RETRY),
    (W.FAILED, 1, False, None, 0, A.RETRY),
    (W.UNHEALTHY, 2, False, None, 0, A.RETRY),
    (W.FAILED, 0, False, None, 0, A.FAIL),
    (W.UNHEALTHY, 0, False, None, 0, A.FAIL),
    (W.FAILED, 0, True, 3, 0, A.FAIL),  # waiting nodes do not save a failed group
    # states the loop cannot handle
    (W.UNKNOWN, 3, False, None, None, A.ABORT),
    (W.UNKNOWN, 3, True, None, None, A.ABORT),
    (W.STOPPED, 3, False, None, None, A.ABORT),
    (W.INIT, 3, False, None, None, A.ABORT),
]


@pytest.mark.parametrize("state,left,due,waiting,lost,expected", TABLE)
def test_decide_table(state, left, due, waiting, lost, expected):
    assert decide(state, left, due, waiting, lost) is expected


def _run(state: WorkerState, left: int, due: bool, waiting: int, lost: int):
    """Drives ``decide`` as the agent does; returns (action, what it asked for)."""
    asked: list[AgentAction] = []
    known_waiting = known_lost = None
    for _ in range(3):
        action = decide(state, left, due, known_waiting, known_lost)
        if action is A.ASK_WAITING:
            known_waiting = waiting
        elif action is A.ASK_LOST:
            known_lost = lost
        else:
            return action, asked
        asked.append(action)
    raise AssertionError("decide kept asking")


@pytest.mark.parametrize("state,left,due,waiting,lost", list(itertools.product(
    list(W), [0, 1, 3], [False, True], [0, 2], [0, 1])))
def test_every_input_reaches_a_verdict_asking_each_question_once(state, left, due, waiting, lost):
    action, asked = _run(state, left, due, waiting, lost)
    assert action not in (A.ASK_WAITING, A.ASK_LOST)
    assert len(asked) == len(set(asked))
    if state != W.HEALTHY or not due:  # a membership check costs requests only when due
        assert A.ASK_WAITING not in asked
    if state == W.HEALTHY and not due:
        assert asked == []
    if action is A.RETRY:  # a retry is used only when one is left and no peer was lost
        assert left > 0 and lost == 0
    if action is A.FAIL:
        assert left == 0 and lost == 0


S = AgentState
PATHS = [
    [S.INIT, S.RENDEZVOUS, S.RUNNING, S.EXIT_BARRIER, S.SUCCEEDED],
    [S.INIT, S.RENDEZVOUS, S.RUNNING, S.STOPPING, S.RENDEZVOUS, S.RUNNING, S.FAILED],
    [S.INIT, S.RENDEZVOUS, S.RUNNING, S.LEAVING, S.ENDED],
    [S.INIT, S.RENDEZVOUS, S.LEAVING, S.ENDED],
    [S.INIT, S.RENDEZVOUS, S.RUNNING, S.STOPPING, S.LEAVING, S.ENDED],
    [S.INIT, S.RENDEZVOUS, S.RUNNING, S.EXIT_BARRIER, S.ENDED],  # a signal after finishing
    [S.INIT, S.RENDEZVOUS, S.ENDED],  # the rendezvous closed before this node joined
]


@pytest.mark.parametrize("path", PATHS, ids=lambda p: "-".join(s.name for s in p))
def test_legal_paths(path):
    state = path[0]
    for nxt in path[1:]:
        state = transition(state, nxt)
    assert state.is_final


@pytest.mark.parametrize("current,new", [
    (S.INIT, S.RUNNING),  # workers start only after a rendezvous
    (S.RUNNING, S.RENDEZVOUS),  # a restart stops the workers first
    (S.EXIT_BARRIER, S.LEAVING),  # a finished node has nothing to leave
    (S.EXIT_BARRIER, S.STOPPING),
    (S.LEAVING, S.RUNNING),
    (S.SUCCEEDED, S.ENDED),
    (S.FAILED, S.RENDEZVOUS),
    (S.ENDED, S.INIT),
])
def test_illegal_transitions_raise(current, new):
    with pytest.raises(AssertionError, match=f"{current.name} -> {new.name}"):
        transition(current, new)


def test_final_and_member_states():
    assert {s for s in S if s.is_final} == {S.SUCCEEDED, S.FAILED, S.ENDED}
    # a node leaving from these must tell its peers; after them it has nothing to tell
    assert {s for s in S if s.is_member} == {S.RENDEZVOUS, S.RUNNING, S.STOPPING}
    assert set(TRANSITIONS) == set(S)
    for targets in TRANSITIONS.values():  # every non-final state can end (a signal, an error)
        assert not targets or S.ENDED in targets


@pytest.mark.parametrize("current,new", list(itertools.product(list(AgentState), repeat=2)))
def test_a_step_records_its_state_and_says_whether_the_loop_would_move_so(current, new):
    from fastelastic.agent.server._runloop import step

    state, in_order = step(current, new)
    assert state is new  # never refused, whatever the order
    assert in_order == (new is current or new in TRANSITIONS[current])


def test_no_import_circle_between_the_agent_and_its_run_loop():
    """``_runloop`` and ``api`` used to import each other; it worked only because the package
    imported ``api`` first. Each imports alone in a fresh interpreter now, and the state types
    live in a leaf module that imports nothing of the agent."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import fastelastic.agent.server._states as states

    tree = ast.parse(Path(states.__file__).read_text())
    imported = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m.startswith("fastelastic")], imported
    for first in ("_runloop", "_states", "api"):
        code = (f"import importlib; importlib.import_module('fastelastic.agent.server.{first}');"
                "from fastelastic.agent.server import api, _runloop;"
                "assert _runloop.WorkerState is api.WorkerState")
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
