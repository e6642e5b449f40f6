"""The simulated traces of the rendezvous (``tracing``) are those of ``traces.sha256``: every
request of every scenario, pinned schedule and property schedule of ``tracing.SEEDS``, at the
same simulated time, in the same round and seat, with the same answer and error. A change
meant to keep the behaviour (a move, a rename) keeps this passing; a change of behaviour
rewrites the file (``python3 tests/rendezvous/tracing.py --write``) in its own commit, saying
why."""

from __future__ import annotations

import pytest
import tracing


def test_a_trace_is_the_same_from_one_run_to_the_next():
    runs = dict(tracing.scenarios())
    for name in ("round/00", "failover/test_finding_g_the_proof_of_a_lost_majority_races_a_cut_"
                 "member_s_move", f"seed/{tracing.SEEDS[0]}"):
        first, second = tracing.trace(runs[name]), tracing.trace(runs[name])
        assert len(first) > 100, f"{name}: {len(first)} lines: the recorder saw no requests"
        assert first == second, name


def test_a_changed_answer_changes_the_digest(monkeypatch):
    name = "round/00"
    run = dict(tracing.scenarios())[name]
    want = tracing.read_digests()[name]
    orig = tracing.simstore.Sim._apply

    def later(sim, node, op):  # one answer a little different: an Add counts one more
        kind, value = orig(sim, node, op)
        return (kind, value + 1) if op.name == "add" and op.amount == 0 else (kind, value)

    monkeypatch.setattr(tracing.simstore.Sim, "_apply", later)
    lines = tracing.trace(run)
    assert f"{len(lines)} {tracing._digest(lines)}" != want


@pytest.mark.timeout(600)
def test_the_traces_are_those_of_the_reference():
    want = tracing.read_digests()
    found = tracing.digests()
    assert found.keys() == want.keys()
    differ = [k for k in want if found[k] != want[k]]
    assert not differ, (f"{len(differ)} of {len(want)} traces differ from traces.sha256, first "
                        f"{differ[:5]} (see one: python3 tests/rendezvous/tracing.py --diff "
                        f"{differ[0]})")
