"""The hang check's pure decisions, from tables: stalled or not, the culprit, the flag."""

from __future__ import annotations

import pytest

from fastelastic.agent.server._hang import AUTO, parse_hang_timeout
from fastelastic.agent.server._hang_verdict import (
    Intervals,
    RankReport,
    decode_reports,
    encode_reports,
    judge,
    main_stack,
    node_stalled,
    ranges,
)
from fastelastic.progress._launch import SlotView

S = 1_000_000_000  # ns


def view(steps=10, last=100, suspend=0, suspend_at=0, eval_at=0, pid=1, tid=7) -> SlotView:
    return SlotView(pid=pid, steps=steps, last_ns=last * S, suspend=suspend,
                    suspend_ns=suspend_at * S, suspend_kind=1 if suspend else 0,
                    eval_ns=eval_at * S, main_tid=tid, dump_sig=40, hooked=True)


@pytest.mark.parametrize(("views", "now", "expect"), [
    ([], 200, None),  # no workers
    ([view(steps=0, last=0)], 200, None),  # before the first progress: never
    ([view(last=100)], 104, None),  # 4 s < 5 s
    ([view(last=100)], 105, 5.0),  # 5 s: stalled
    ([view(last=100), view(last=103)], 107, None),  # the newest rank counts
    ([view(last=100), view(steps=0, last=0)], 106, 6.0),  # one rank never stepped: still
    ([view(last=100, suspend=1, suspend_at=101)], 110, None),  # a save in progress
    ([view(last=100), view(last=90, suspend=1, suspend_at=95)], 110, None),  # on any rank
    ([view(last=100, suspend=1, suspend_at=101)], 102 + 600, 602.0),  # beyond its allowance
    ([view(last=100, eval_at=101)], 130, None),  # an evaluation in progress
    ([view(last=100, eval_at=101)], 101 + 600, 601.0),  # an evaluation beyond the allowance
])
def test_node_stalled(views, now, expect) -> None:
    got = node_stalled(views, now * S, 5.0, 600.0)
    assert got == (pytest.approx(expect) if expect is not None else None)


DUMP = """Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x0000000000000007 (most recent call first):
  File "/job/train.py", line 30 in hung_in_native_call
  File "/job/train.py", line 80 in main
  File "/job/train.py", line 90 in <module>
"""


def test_main_stack_picks_the_main_thread_innermost_first() -> None:
    assert main_stack(DUMP, 7)[0] == ("/job/train.py", 30, "hung_in_native_call")
    assert main_stack(DUMP, 0x7F0000000002)[0][2] == "wait"
    assert main_stack(DUMP, 12345)[0][2] == "hung_in_native_call"  # unknown: the longest
    assert main_stack("", 7) == []


def rep(rank, func="all_reduce", steps=20, coll=None, where="distributed_c10d.py:3252"):
    coll = func == "all_reduce" if coll is None else coll
    return RankReport(rank, "h", 100 + rank, steps, 5.0, func, where, coll)


@pytest.mark.parametrize(("reports", "culprits", "words"), [
    # outside a collective while the others wait in one
    ([rep(0), rep(1), rep(2), rep(3, "hung_in_native_call", where="train.py:30")], [3],
     ["rank 3 (host h, pid 103): no progress for 5.0 s, in hung_in_native_call (train.py:30)",
      "ranks 0-2 waiting in all_reduce"]),
    ([rep(0), rep(1, "spin", where="t.py:3")], [1], ["rank 0 waiting in all_reduce"]),
    # every rank in a collective, one fell behind in steps
    ([rep(0), rep(1), rep(2, steps=19)], [2], ["fell behind: 19 steps"]),
    # no collective: a strict majority in one frame
    ([rep(0, "f", coll=False), rep(1, "f", coll=False), rep(2, "g", coll=False)], [2],
     ["rank 2 (host h"]),
    # nobody stands out: grouped
    ([rep(0), rep(1)], [], ["no rank stands out", "ranks 0-1 in all_reduce"]),
    ([rep(0, "f", coll=False), rep(1, "g", coll=False)], [], ["rank 0 in f", "rank 1 in g"]),
])
def test_judge(reports, culprits, words) -> None:
    v = judge(reports)
    assert v.culprits == culprits
    for w in words:
        assert w in v.line, v.line


def test_report_roundtrip_and_ranges() -> None:
    r = rep(3, "x", where="a.py:1")
    assert RankReport.from_json(r.to_json()) == r
    assert ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert ranges([]) == ""


def test_a_node_s_reports_are_one_store_value_that_reads_back() -> None:
    """The summary and the frames a node publishes: a JSON list of each rank's fields, in
    order (a peer of the same job reads it); a value that is not one is a ValueError."""
    reports = [rep(0, "f", where="a.py:1"), rep(1, "g", coll=False)]
    raw = encode_reports(reports)
    assert raw.startswith('[[0, "') and raw.count("], [") == 1, raw
    assert decode_reports(raw) == reports
    assert decode_reports(raw.encode()) == reports  # as the store returns it
    assert decode_reports(encode_reports([])) == []
    with pytest.raises(ValueError):
        decode_reports(b"not json")


@pytest.mark.parametrize(("value", "seconds"), [(None, 0.0), ("", 0.0), ("0", 0.0),
                                                 ("5", 5.0), (2.5, 2.5), ("auto", AUTO),
                                                 (" Auto ", AUTO)])
def test_parse_hang_timeout(value, seconds) -> None:
    assert parse_hang_timeout(value) == seconds


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "automatic"])
def test_parse_hang_timeout_rejects(value) -> None:
    with pytest.raises(ValueError, match="--hang-timeout"):
        parse_hang_timeout(value)


# (last progress s, total steps) samples, one per tick -> the longest interval counted
@pytest.mark.parametrize(("samples", "longest"), [
    ([(0, 0), (15, 1), (16, 2), (17, 3)], 1.0),  # the wait before the first step: no
    ([(10, 1), (11, 2), (23, 3), (24, 4)], 12.0),  # a 12 s pause in the script counts
    ([(10, 1), (11, 2), (46, 2), (47, 3)], 1.0),  # a 35 s save ends without a step: no
    ([(10, 1), (11, 2), (11, 2), (11, 2), (13, 3)], 2.0),  # quiet ticks change nothing
    ([(10, 4), (12, 6)], 2.0),  # several steps between ticks: never shorter than the truth
])
def test_auto_intervals(samples, longest) -> None:
    iv = Intervals()
    for t, steps in samples:
        iv.observe(t * S, steps)
    assert iv.longest_s == pytest.approx(longest)
    assert iv.timeout_s() == max(30.0, 5 * longest)


def test_auto_intervals_new_attempt() -> None:
    iv = Intervals()
    for t, steps in [(10, 1), (11, 2), (20, 3)]:
        iv.observe(t * S, steps)
    assert iv.longest_s == pytest.approx(9.0)
    iv.reset_attempt()
    for t, steps in [(60, 1), (61, 2)]:  # the new attempt's first step is no interval
        iv.observe(t * S, steps)
    assert iv.longest_s == pytest.approx(9.0)
    assert iv.timeout_s() == 45.0


def test_auto_node_stalled_uses_the_learned_timeout() -> None:
    iv = Intervals()
    for t, steps in [(10, 1), (18, 2)]:
        iv.observe(t * S, steps)
    views = [view(last=18)]
    assert node_stalled(views, (18 + 39) * S, iv.timeout_s(), 600.0) is None
    assert node_stalled(views, (18 + 40) * S, iv.timeout_s(), 600.0) == pytest.approx(40.0)
