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


# the reference's scenarios in this many tests, which pytest -n runs side by side (all of them
# in one took 2-8 min of CPU)
PARTS = 4


def test_the_scenarios_are_those_of_the_reference():
    assert {name for name, _ in tracing.scenarios()} == tracing.read_digests().keys()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("part", range(PARTS))
def test_the_traces_are_those_of_the_reference(part: int):
    want = tracing.read_digests()
    found = tracing.digests(part, PARTS)
    assert len(found) >= len(want) // PARTS, (len(found), len(want))
    differ = [k for k in found if found[k] != want.get(k)]
    assert not differ, (f"{len(differ)} of {len(found)} traces differ from traces.sha256, first "
                        f"{differ[:5]} (see one: python3 tests/rendezvous/tracing.py --diff "
                        f"{differ[0]})")
