"""The property test guards every move decision: change one decision of the failover's shared
operations (``failover/_hops``, ``_start``, ``_majority``, which the handler and the simulation
both run) and the property test's checks over its pinned schedules (``test_prop_failover``:
two worlds never train at once, the late node ends in the world that trains, or the outcome
is one the rules name) must fail.

Each mutation names the pinned schedules that catch it (the cheapest ones; a few seconds of
CPU each). The same schedules pass unmutated (checked first, so a case that fails anyway
proves nothing).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest
import test_prop_failover as prop

from fastelastic.rendezvous.fast.failover import _hops as hops
from fastelastic.rendezvous.fast.failover import _majority as majority
from fastelastic.rendezvous.fast.failover import _start as start

_move, _check, _probe, _prove_gone = hops.move, hops.check, hops.probe, hops.prove_gone


def _refusal_as_empty_list(*args: Any, **kwargs: Any) -> Generator[Any, Any, str]:
    """``prove_gone`` that takes a refused connection for an empty ``moving`` list that
    counts: a refusal counted as "nothing listens there"."""
    gen = _prove_gone(*args, **kwargs)
    reply = None
    try:
        for _ in range(1_000_000):
            op = gen.send(reply)
            reply = yield op
            reply = b"" if reply is None else reply
    except StopIteration as e:
        return str(e.value)
    raise AssertionError("a proof that never ends")


def _worst_first(p: Any, exclude: int,
                 quick: bool = False) -> Generator[Any, Any, tuple[list[Any], list[str]]]:
    """``probe`` that ranks, among the answering candidates of the highest epoch, the last in
    the list first: the wrong successor."""
    found, errors = yield from _probe(p, exclude, quick)
    return sorted(found, key=lambda f: (f[0], -f[1])), errors


def _never(kind: type[BaseException]) -> Callable[..., Generator[Any, Any, None]]:
    """``check`` that never raises ``kind``: a mover that never goes back, or never regroups."""
    def check(p: Any, live: Any) -> Generator[Any, Any, None]:
        try:
            yield from _check(p, live)
        except kind:
            return
    return check


def _moves_without_world(p: Any, m: Any, live: Any, why: BaseException,
                         until: float) -> Generator[Any, Any, None]:
    """``follow`` that moves instead: a node with no world moves the rendezvous."""
    yield from _move(p, m, live, why)


def _no_behind(*args: Any) -> Iterator[Any]:
    return iter(())


def _firewall(kind: str) -> Callable[[], None]:
    return lambda: prop.test_node_0_isolated_by_a_firewall_trains_one_world_and_re_forms_after_the_heal(  # noqa: E501
        kind)


_REFUSED = prop.test_a_proof_that_counted_on_a_refused_candidate_holds_when_its_host_restarts
_RESTARTED_FIRST = prop.test_a_restarted_first_host_is_not_taken_by_a_fresh_node_cut_from_the_live_store  # noqa: E501

# (name, the patches: (module, attribute, value), the pinned schedules that must catch it)
MUTATIONS: list[tuple[str, list[tuple[Any, str, Any]], list[Callable[[], None]]]] = [
    ("a proof's quorum one short", [(hops, "prover_quorum", lambda n: n // 2)], [_REFUSED]),
    ("a mover's quorum one short",
     [(hops, "mover_quorum", lambda n: n - (n // 2 + 1))],
     [prop.test_seed_41883_a_cut_member_s_late_mark_after_the_proof_at_the_thaw]),
    ("a refusal counted as proof", [(hops, "prove_gone", _refusal_as_empty_list)],
     [_firewall("refuse")]),
    ("a fence check skipped", [(hops, "fenced", lambda *a: False)],
     [prop.test_finding_g_the_proof_of_a_lost_majority_races_a_cut_member_s_move]),
    ("a mark before a fence ignored by the proof",
     [(hops, "marked_before_fence", lambda *a: False)], [_firewall("cut")]),
    ("a node with no world moves the rendezvous", [(hops, "follow", _moves_without_world)],
     [prop.test_finding_a_a_node_cut_during_its_first_join_never_forms_a_world_alone]),
    ("the wrong successor", [(hops, "probe", _worst_first)],
     [prop.test_finding_c_two_cuts_in_a_row_train_one_world]),
    ("a mover never goes back", [(hops, "check", _never(hops.GoBack))],
     [prop.test_finding_f_movers_split_across_successors_meet_again]),
    ("a mover never regroups", [(hops, "check", _never(hops.Regroup))],
     [prop.test_movers_stranded_on_two_successors_regroup_when_their_store_is_gone]),
    ("a world's majority one short", [(majority, "need", lambda world: world // 2)],
     [prop.test_two_host_freezes_in_a_row_do_not_wedge_the_job]),
    ("a restarted standby counts at once",
     [(start, "may_have_lost_state", lambda *a: False)], [_REFUSED]),
    ("a restarted standby not marked behind", [(start, "behind", _no_behind)],
     [_RESTARTED_FIRST]),
]


def _failures(cases: list[Callable[[], None]]) -> list[str]:
    out = []
    for case in cases:
        try:
            case()
        except AssertionError as e:
            out.append(str(e).splitlines()[0] if str(e) else repr(e))
    return out


@pytest.mark.parametrize("name, patches, cases", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_a_changed_move_decision_fails_the_property_test(
        monkeypatch: pytest.MonkeyPatch, name: str, patches: list[tuple[Any, str, Any]],
        cases: list[Callable[[], None]]) -> None:
    logging.disable(logging.WARNING)  # the machine's warnings: each run's own are normal
    try:
        assert cases, f"{name}: no pinned schedule named"
        assert _failures(cases) == [], f"{name}: a case fails unmutated"
        for module, attr, value in patches:
            assert hasattr(module, attr), (module, attr)
            monkeypatch.setattr(module, attr, value)
        assert _failures(cases), f"{name}: the property test did not notice"
    finally:
        logging.disable(logging.NOTSET)
