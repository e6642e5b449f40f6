"""The hang check's decisions as pure functions: is this node stalled, who is the culprit.

No I/O and no clock here (``_hang.py`` is the I/O around them), so each is tested from a table
(``tests/agent/test_hang_verdict.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastelastic.progress._launch import SlotView

_THREAD_RE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+)")
_FRAME_RE = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')
_COLLECTIVE_PATHS = (f"torch{os.sep}distributed{os.sep}",)


def node_stalled(
    slots: Iterable[SlotView], now_ns: int, timeout_s: float, allowance_s: float,
    end_s: float | None = None,
) -> float | None:
    """Seconds since this node's last progress when it counts as stalled, else None.

    Stalled: some rank made progress (an optimizer step or ``progress.step()``), no rank made
    any for ``timeout_s``, and no rank is in a save, load or evaluation begun less than
    ``allowance_s`` ago (the end of one counts as progress: its own length is no stall).
    Once a rank's program ended (the end of the run: atexit handlers, non-daemon threads,
    teardown follow) the node is judged by ``end_s`` (``allowance_s`` when None) from its
    newest progress or end instead.
    """
    views = list(slots)
    if not views or not any(v.steps > 0 for v in views):
        return None
    last = max(v.last_ns for v in views)
    ends = [v.end_ns for v in views if v.end_ns]
    if ends:
        last = max(last, *ends)
        timeout_s = allowance_s if end_s is None else end_s
    age = (now_ns - last) / 1e9
    if age < timeout_s:
        return None
    for v in views:
        if v.suspend > 0 and (now_ns - v.suspend_ns) / 1e9 < allowance_s:
            return None
        if v.eval_ns and (now_ns - v.eval_ns) / 1e9 < allowance_s:
            return None
    return age


AUTO_FLOOR_S = 30.0  # --hang-timeout auto: never sooner than this after the last progress
AUTO_FACTOR = 5.0  # ... nor sooner than this many times the longest interval seen
AUTO_FIRST_S = 600.0  # ... and before any interval was seen, not sooner than this
END_FLOOR_S = 600.0  # the end of a run: not sooner than this (nor 2 x the timeout)
END_FACTOR = 2.0
NO_PROGRESS_WARN_S = 600.0  # no progress this long after the start: a warning, once
FLOOR_SCALE_ENV = "FASTELASTIC_HANG_FLOOR_SCALE"  # scales the four above (tests run fast)


def floor_scale(value: str | None) -> float:
    """``FASTELASTIC_HANG_FLOOR_SCALE``: a factor > 0 for the floors above (1 when unset).

    Raises:
        ValueError: not a finite number > 0.
    """
    if value is None or value.strip() == "":
        return 1.0
    try:
        scale = float(value)
    except ValueError:
        scale = float("nan")
    if not 0 < scale < float("inf"):
        raise ValueError(f"{FLOOR_SCALE_ENV}={value!r}: expected a number > 0 (1 is unscaled)")
    return scale


def end_bound_s(timeout_s: float, scale: float = 1.0) -> float:
    """How long the end of a run may show no progress: 10 min, or 2 x the timeout."""
    return max(END_FLOOR_S * scale, END_FACTOR * timeout_s)


class Intervals:
    """The longest interval between progress marks seen on a node, for ``--hang-timeout auto``.

    Fed one sample per monitor tick (the newest mark of any rank and the total steps). An
    interval is counted from the previous mark to a new optimizer step; one that ends with a
    save, load or evaluation (the end of a suspend moves the mark without a step) is not, nor
    is the wait before the first progress. Samples are ticks apart, so an interval may be
    counted a tick long: never shorter than the truth.
    """

    def __init__(self, scale: float = 1.0) -> None:
        self.longest_s = 0.0
        self.seen = False  # an interval was counted (in any attempt of the job)
        self.scale = scale
        self._last_ns = 0
        self._steps = 0

    def observe(self, last_ns: int, steps: int) -> None:
        if steps <= 0 or last_ns <= self._last_ns:
            if steps < self._steps:  # a new attempt: its counts start afresh
                self._steps, self._last_ns = steps, last_ns
            return
        if self._steps > 0 and steps > self._steps:
            self.longest_s = max(self.longest_s, (last_ns - self._last_ns) / 1e9)
            self.seen = True
        self._last_ns, self._steps = last_ns, steps

    def reset_attempt(self) -> None:
        """A new attempt: its first progress is a first progress again (no interval)."""
        self._last_ns = 0
        self._steps = 0

    def timeout_s(self) -> float:
        """``auto``'s timeout now: 30 s, or 5 x the longest interval if that is longer; 10
        min before the first interval (a first step longer than 30 s is no hang)."""
        if not self.seen:
            return AUTO_FIRST_S * self.scale
        return max(AUTO_FLOOR_S * self.scale, AUTO_FACTOR * self.longest_s)


def main_stack(text: str, main_tid: int) -> list[tuple[str, int, str]]:
    """The main thread's frames, innermost first, from a faulthandler dump of every thread.

    ``main_tid`` is ``threading.get_ident()`` of the main thread; when it cannot be found the
    thread that shows the most frames is taken.
    """
    threads: dict[int, list[tuple[str, int, str]]] = {}
    current: list[tuple[str, int, str]] | None = None
    for line in text.splitlines():
        m = _THREAD_RE.match(line)
        if m:
            current = threads.setdefault(int(m.group(1), 16), [])
            continue
        f = _FRAME_RE.match(line)
        if f and current is not None:
            current.append((f.group(1), int(f.group(2)), f.group(3)))
    if main_tid in threads:
        return threads[main_tid]
    return max(threads.values(), key=len, default=[])


@dataclass
class RankReport:
    """One rank's short summary (shared with the other agents through the store)."""

    rank: int
    host: str
    pid: int
    steps: int
    idle_s: float
    func: str = "?"
    where: str = "?"  # file:line
    collective: bool = False
    ended: bool = False  # its program ended: the stall is at the end of the run

    @property
    def frame(self) -> str:
        return f"{self.func} ({self.where})"

    def to_json(self) -> list[Any]:
        return [self.rank, self.host, self.pid, self.steps, round(self.idle_s, 2), self.func,
                self.where, int(self.collective), int(self.ended)]

    @classmethod
    def from_json(cls, item: list[Any]) -> RankReport:
        r, host, pid, steps, idle, func, where, coll = item[:8]
        return cls(int(r), str(host), int(pid), int(steps), float(idle), str(func), str(where),
                   bool(coll), bool(item[8]) if len(item) > 8 else False)


def encode_reports(reports: list[RankReport]) -> str:
    """A node's summary or frames as one store value: a JSON list of
    :py:meth:`RankReport.to_json` items (read back by :func:`decode_reports`)."""
    return json.dumps([r.to_json() for r in reports])


def decode_reports(raw: str | bytes) -> list[RankReport]:
    """The reports in a value of :func:`encode_reports`.

    Raises:
        ValueError: not such a value.
    """
    return [RankReport.from_json(item) for item in json.loads(raw)]


def rank_report(rank: int, host: str, view: SlotView, now_ns: int, stacks: str) -> RankReport:
    """The summary of one rank from its slot and its stack dump."""
    rep = RankReport(rank, host, view.pid, view.steps, max(0.0, (now_ns - view.last_ns) / 1e9),
                     ended=bool(view.end_ns))
    frames = main_stack(stacks, view.main_tid)
    if frames:
        path, line, func = frames[0]
        rep.func, rep.where = func, f"{os.path.basename(path)}:{line}"
        rep.collective = any(p in path for p in _COLLECTIVE_PATHS)
    return rep


@dataclass
class Verdict:
    """Who hung (``culprits``: global ranks, possibly none) and the line that says so."""

    culprits: list[int]
    line: str
    groups: dict[str, list[int]] = field(default_factory=dict)  # frame -> ranks


def judge(reports: list[RankReport]) -> Verdict:
    """Names the culprit among the ranks of a stalled job.

    In order: the ranks outside a collective while the others wait in one; else the ranks
    that fell behind in steps; else the ranks whose innermost frame differs from that of a
    strict majority. When none stands out, says so and groups the ranks by frame.
    """
    reps = sorted(reports, key=lambda r: r.rank)
    groups: dict[str, list[int]] = {}
    for r in reps:
        groups.setdefault(r.frame, []).append(r.rank)
    culprits: list[int] = []
    why = ""
    waiting = [r for r in reps if r.collective]
    if waiting and len(waiting) < len(reps):
        culprits = [r.rank for r in reps if not r.collective]
    elif len({r.steps for r in reps}) > 1:
        low = min(r.steps for r in reps)
        culprits = [r.rank for r in reps if r.steps == low]
        why = f" (fell behind: {low} steps)"
    elif len(groups) > 1:
        top = max(groups.values(), key=len)
        if len(top) * 2 > len(reps):
            culprits = [r.rank for r in reps if r.rank not in top]
    if not culprits:
        parts = [f"{_rank_word(rs)} {ranges(rs)} in {frame}" for frame, rs in groups.items()]
        idle = max((r.idle_s for r in reps), default=0.0)
        return Verdict([], f"no progress on any rank for {idle:.1f} s and no rank stands out: "
                       + "; ".join(parts), groups)
    by_rank = {r.rank: r for r in reps}
    named = [f"rank {r} (host {by_rank[r].host}, pid {by_rank[r].pid}): no progress for "
             f"{by_rank[r].idle_s:.1f} s, in {by_rank[r].frame}{why}" for r in culprits]
    rest: dict[str, list[int]] = {}
    for r in reps:
        if r.rank not in culprits:
            verb = "waiting in" if r.collective else "in"
            rest.setdefault(f"{verb} {r.func}", []).append(r.rank)
    tail = "; ".join(f"{_rank_word(rs)} {ranges(rs)} {what}" for what, rs in rest.items())
    return Verdict(culprits, "; ".join(named) + (f"; {tail}" if tail else ""), groups)


def _rank_word(ranks: list[int]) -> str:
    return "rank" if len(ranks) == 1 else "ranks"


def ranges(ranks: Iterable[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    out: list[str] = []
    items = sorted(set(ranks))
    i = 0
    while i < len(items):
        j = i
        while j + 1 < len(items) and items[j + 1] == items[j] + 1:
            j += 1
        out.append(str(items[i]) if i == j else f"{items[i]}-{items[j]}")
        i = j + 1
    return ",".join(out)
