"""The agent's hang check (``--hang-timeout``): progress slots in, one verdict per hang out.

Each agent reads its workers' progress slots on its monitor timer (memory loads only). A node
whose ranks all stalled (``_hang_verdict.node_stalled``) publishes a short summary of its
ranks (steps, idle time; one ``set``) under the round's store. Then, on each tick, one
``check`` asks whether every node published. A node that makes progress again before that
withdraws its summary (one ``delete_key``).

Once every node published, the job is hung: that is the verdict. Nothing is done to a rank
before it: no signal, no ptrace stop (either ends a ``sleep``, ``poll`` or ``epoll_wait`` the
rank is in, and it would train on unjudged). Only then does each agent dump its ranks' stacks
(faulthandler, by signal) and begin py-spy on those outside a collective, and publish the
ranks' frames (one ``set``). Once every node's frames are in (one ``check`` a tick), each
agent reads them (never waiting for a key a peer withdrew), names the same culprit from them
(a pure function of the same data), and one agent claims the verdict with one ``add`` on a key
named after the hung processes: it writes the report. The culprit's node restarts using one of
its restarts (as for a crash); the others restart as survivors do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import socket
import tempfile
import time
from enum import Enum
from typing import Any

from fastelastic.agent.server._hang_verdict import (
    FLOOR_SCALE_ENV,
    NO_PROGRESS_WARN_S,
    Intervals,
    RankReport,
    Verdict,
    decode_reports,
    encode_reports,
    end_bound_s,
    floor_scale,
    judge,
    node_stalled,
    rank_report,
)
from fastelastic.errors import RendezvousError, StoreError
from fastelastic.progress._launch import PROGRESS_ENV, NativeDumps, ProgressSlots

logger = logging.getLogger("fastelastic.agent.server.api")  # the agent's log

HANG_TIMEOUT_ENV = "FASTELASTIC_HANG_TIMEOUT"
SUSPEND_ALLOWANCE_S = 600.0  # the longest a save, load or evaluation suspends the verdict
_KEY = "fastelastic/hang"
FRAMES_WAIT_S = 10.0  # after the verdict, the longest a node waits for its peers' frames
# the longest a restart waits for py-spy's native frames, counted from their begin at the
# verdict (a run that ends waits for them fully): a torch process takes 0.3 s on an idle host
NATIVE_RESTART_WAIT_S = 0.4
AUTO = -1.0  # parse_hang_timeout's value for "auto"


def parse_hang_timeout(value: Any) -> float:
    """``--hang-timeout`` / ``FASTELASTIC_HANG_TIMEOUT`` in seconds; 0 (or None, '') is off;
    ``auto`` gives ``AUTO``.

    Raises:
        ValueError: neither ``auto`` nor a number of seconds >= 0.
    """
    if value is None or value == "":
        return 0.0
    if isinstance(value, str) and value.strip().lower() == "auto":
        return AUTO
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(
            f"--hang-timeout {value!r}: expected SECONDS (a number >= 0; 0 is off) or auto"
        ) from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"--hang-timeout {value!r}: expected a finite number of seconds >= 0")
    return seconds


def resolve_hang_timeout(explicit: Any) -> float:
    """The explicit value, else ``$FASTELASTIC_HANG_TIMEOUT``, else off."""
    if explicit is not None:
        return parse_hang_timeout(explicit)
    return parse_hang_timeout(os.environ.get(HANG_TIMEOUT_ENV))


class HangAction(str, Enum):
    """What a verdict asks of this node."""

    RETRY = "RETRY"  # the culprit's node: restart, using one of its restarts
    RESTART = "RESTART"  # a survivor: restart without using one
    END = "END"  # the run's end hung (a rank's program had ended): stop, no restart


class HangWatch:
    """One agent's hang check (see the module docstring). Not thread-safe: the run loop's.

    ``timeout_s`` is SECONDS, or ``AUTO``: then no verdict comes sooner than 30 s after the
    last progress (10 min before a first interval was seen), nor sooner than 5 x the longest
    interval between progress marks seen so far in the job (``_hang_verdict.Intervals``; each
    node applies its own, and a verdict needs every node, so the job's longest counts).
    """

    def __init__(self, timeout_s: float, allowance_s: float = SUSPEND_ALLOWANCE_S) -> None:
        self.auto = timeout_s == AUTO
        self.timeout_s = timeout_s
        self.scale = floor_scale(os.environ.get(FLOOR_SCALE_ENV))
        self.intervals = Intervals(self.scale)
        self._started_ns = 0  # the job's first start (the no-progress warning's origin)
        self._warned = False  # the no-progress warning was given, or progress was seen
        self._kept_dir: str | None = None  # the reports' directory when there is no log dir
        self.allowance_s = allowance_s
        self.slots = ProgressSlots()
        self.verdicts = 0
        self._pids: dict[int, int] = {}
        self._ranks: dict[int, int] = {}
        self._published = False
        self._judging_until: float | None = None  # after the verdict: frames published
        self._stacks: dict[int, str] = {}
        self._native: NativeDumps | None = None  # py-spy, begun at the verdict
        self._native_begun = 0.0  # when (time.monotonic())
        self._published_steps = 0
        self.last_verdict = ""  # the line of the last verdict (for its event)
        # this node's ranks the last verdict blamed: {local_rank: (what it hung in, the path
        # of its stacks or None)}; the failures of a run that ends on that verdict
        self.blamed: dict[int, tuple[str, str | None]] = {}
        self._host = socket.gethostname()

    def prepare(self, envs: dict[int, dict[str, str]]) -> None:
        """Fresh slots for the attempt about to start; their paths go in the workers' env."""
        for lr, path in self.slots.prepare(sorted(envs)).items():
            envs[lr][PROGRESS_ENV] = path
        self._published = False
        self._judging_until = None
        self._drop_native()
        self.intervals.reset_attempt()
        self.blamed = {}

    def started(self, pids: dict[int, int], ranks: dict[int, int]) -> None:
        """The attempt's workers: ``{local_rank: pid}`` and ``{local_rank: global_rank}``."""
        self._pids = dict(pids)
        self._ranks = dict(ranks)
        self._started_ns = self._started_ns or time.monotonic_ns()

    def progress(self) -> dict[int, dict[str, Any]]:
        """Each local rank's step count, seconds since its last progress (None before the
        first) and what suspends it now, for ``/health``."""
        now = time.monotonic_ns()
        out: dict[int, dict[str, Any]] = {}
        for lr, v in self.slots.read_all().items():
            idle = round((now - v.last_ns) / 1e9, 3) if v.steps > 0 else None
            out[lr] = {"steps": v.steps, "since_progress_s": idle,
                       "suspended": v.suspend_names()}
        return out

    @property
    def pending(self) -> bool:
        """True while this node's stall is published, or its verdict's frames awaited."""
        return self._published or self._judging_until is not None

    def close(self) -> None:
        self._drop_native()
        self.slots.close()

    def _drop_native(self) -> None:
        if self._native is not None:
            self._native.cancel()
            self._native = None

    def _dump(self, views: dict[int, Any], now: int, idle: float) -> list[RankReport]:
        """After the verdict only (the signal ends a sleep or poll the rank is in): dumps the
        ranks' stacks, begins py-spy on those outside a collective (the likely culprits), and
        returns the ranks' summaries with their frames, as of ``views``."""
        self._drop_native()
        t0 = time.monotonic()
        self._stacks = self.slots.dump_stacks(self._pids)
        logger.info("hang: no progress on ranks %s for %.1f s; their stacks dumped in %.3f s",
                    sorted(self._ranks.values()), idle, time.monotonic() - t0)
        reports = {lr: rank_report(self._ranks[lr], self._host, views[lr], now,
                                   self._stacks.get(lr, ""))
                   for lr in sorted(self._pids) if lr in views}
        self._native_begun = time.monotonic()
        self._native = NativeDumps(
            {lr: self._pids[lr] for lr, r in reports.items() if not r.collective},
            self.slots.dir)
        return list(reports.values())

    def check(self, store: Any, group_rank: int, group_world_size: int,
              log_dir: str | None, reused_store: bool = False,
              restarts_left: int = 1) -> HangAction | None:
        """One look (every monitor tick while the group is healthy); an action on a verdict.

        ``reused_store``: the rendezvous gives every round the same store (``static``): the
        keys are then also named after the verdicts seen so far (every node saw them all).
        ``restarts_left``: this node's, for what its log says the verdict leads to.
        """
        if not self._pids:
            return None
        prefix = f"{_KEY}/{self.verdicts}" if reused_store else _KEY
        frame_keys = [f"{prefix}/frames/{g}" for g in range(group_world_size)]
        try:
            if self._judging_until is not None:
                return self._judge(store, frame_keys, prefix, group_rank, log_dir,
                                   restarts_left)
        except (StoreError, RendezvousError, OSError, ValueError) as e:
            logger.warning("hang check: the store did not answer (%s); checking again", e)
            return None
        now, views, timeout = self._look()
        steps = sum(v.steps for v in views.values())
        end_s = end_bound_s(timeout, self.scale)
        if not self._warned:
            self._warn_no_progress(views, now)
        key = f"{prefix}/node/{group_rank}"
        keys = [f"{prefix}/node/{g}" for g in range(group_world_size)]
        try:
            if self._published:
                # reported: the verdict, once every node reported, holds even if a rank here
                # moved since (a peer that restarted first may unblock or break collectives)
                if not store.check(keys):
                    if steps == self._published_steps:
                        return None
                    self._published = False  # progress again before the verdict: withdraw
                    store.delete_key(key)
                    return None
                idle = (now - max(v.last_ns for v in views.values())) / 1e9 if views else 0.0
            else:
                stalled = node_stalled(views.values(), now, timeout, self.allowance_s, end_s)
                if stalled is None:
                    return None
                idle = stalled
                # the ranks as they are, untouched: no stacks before the verdict
                reports = [rank_report(self._ranks[lr], self._host, views[lr], now, "")
                           for lr in sorted(self._pids) if lr in views]
                store.set(key, encode_reports(reports))
                logger.info("hang: no progress on ranks %s for %.1f s; reported",
                            sorted(self._ranks.values()), idle)
                self._published = True
                self._published_steps = steps
                if not store.check(keys):
                    return None
            # every node reported: the job is hung. Only now are the ranks touched; the
            # summary stays (a slower peer has yet to read it; the next round's store, or
            # the next verdict's keys, start afresh)
            self._published = False
            logger.info("hang: every node reported no progress: the job is hung")
            reports = self._dump(views, now, idle)
            store.set(f"{prefix}/frames/{group_rank}", encode_reports(reports))
            self._judging_until = time.monotonic() + FRAMES_WAIT_S
            return self._judge(store, frame_keys, prefix, group_rank, log_dir, restarts_left)
        except (StoreError, RendezvousError, OSError, ValueError) as e:
            logger.warning("hang check: the store did not answer (%s); checking again", e)
            return None

    def finished(self, store: Any, group_rank: int, reused_store: bool = False) -> None:
        """This node's workers succeeded: it reports no rank, stalled or not (its summary and
        its frames, both empty), so a verdict on the nodes still running can come without it.
        Never raises: the store may be gone."""
        if not self._pids:
            return
        prefix = f"{_KEY}/{self.verdicts}" if reused_store else _KEY
        try:
            store.set(f"{prefix}/frames/{group_rank}", "[]")
            store.set(f"{prefix}/node/{group_rank}", "[]")
        except (StoreError, RendezvousError, OSError, ValueError) as e:
            logger.warning("hang check: could not say this node finished (%s)", e)

    def check_alone(self, log_dir: str | None, restarts_left: int = 0) -> HangAction | None:
        """The check of a node left alone: the store's host finished its work (its store goes
        or went with it), so no peer can report; this node's stall is the job's. One look per
        tick, as ``check``, with no store."""
        if not self._pids:
            return None
        now, views, timeout = self._look()
        idle = node_stalled(views.values(), now, timeout, self.allowance_s,
                            end_bound_s(timeout, self.scale))
        if idle is None:
            return None
        self._published = False
        self._judging_until = None
        logger.info("hang: no progress on ranks %s for %.1f s, and every other node finished: "
                    "the job is hung", sorted(self._ranks.values()), idle)
        reports = self._dump(views, now, idle)
        return self._act(judge(reports), reports, True, 0, log_dir, restarts_left)

    def _look(self) -> tuple[int, dict[Any, Any], float]:
        """(now in ns, this node's ranks' progress slots, the training timeout in force):
        ``auto`` learns its interval from the slots first."""
        now = time.monotonic_ns()
        views = self.slots.read_all()
        if self.auto and views:
            self.intervals.observe(max(v.last_ns for v in views.values()),
                                   sum(v.steps for v in views.values()))
        return now, views, self.intervals.timeout_s() if self.auto else self.timeout_s

    def _judge(self, store: Any, frame_keys: list[str], prefix: str, group_rank: int,
               log_dir: str | None, restarts_left: int) -> HangAction | None:
        """Once every node's frames are in (or ``FRAMES_WAIT_S`` passed: those present),
        names the culprit and claims the verdict. No read waits for a key."""
        assert self._judging_until is not None
        values = read_present(store, frame_keys) if store.check(frame_keys) else None
        if values is None:
            if time.monotonic() < self._judging_until:
                return None
            # a peer that never sent its frames (it withdrew, or its agent ended)
            values = []
            for k in frame_keys:
                got = read_present(store, [k])
                if got is not None:
                    values.append(got[0])
            logger.warning("hang: frames of %d of %d nodes after %.0f s; judging from those",
                           len(values), len(frame_keys), FRAMES_WAIT_S)
        reports = [r for v in values for r in decode_reports(v)]
        verdict = judge(reports)
        token = hashlib.sha1(
            ",".join(f"{r.rank}:{r.pid}" for r in sorted(reports, key=lambda r: r.rank))
            .encode()
        ).hexdigest()[:16]
        first = int(store.add(f"{prefix}/claim/{token}", 1)) == 1
        self._judging_until = None
        return self._act(verdict, reports, first, group_rank, log_dir, restarts_left)

    def _act(self, verdict: Verdict, reports: list[RankReport], first: bool, group_rank: int,
             log_dir: str | None, restarts_left: int = 1) -> HangAction:
        self.verdicts += 1
        self.last_verdict = verdict.line
        mine = set(self._ranks.values())
        culprit_here = bool(mine & set(verdict.culprits))
        at_end = any(r.ended for r in reports)
        if at_end:
            self.last_verdict = "at the end of the run (a rank's program had ended): " + (
                verdict.line)
        logger.error("hang: %s", self.last_verdict)
        blamed = culprit_here or (not verdict.culprits and first)
        # native frames (py-spy, when installed) of this node's culprits, or of all its ranks
        # when none stands out, while the processes still exist. A restart waits for them
        # NATIVE_RESTART_WAIT_S from the verdict at most (what is late is left out: the
        # restart's downtime stays the verdict's); a run that ends waits for them fully.
        restarting = not at_end and (not blamed or restarts_left > 0)
        named = {lr: pid for lr, pid in self._pids.items()
                 if not verdict.culprits or self._ranks.get(lr) in verdict.culprits}
        t0 = time.monotonic()
        begun, self._native = self._native, None
        origin = self._native_begun if begun is not None else t0
        until = origin + NATIVE_RESTART_WAIT_S if restarting else None
        late = set(named) - (begun.local_ranks if begun is not None else set())
        extra = NativeDumps({lr: named[lr] for lr in late}, self.slots.dir) if late else None
        native = begun.collect(set(named), until) if begun is not None else {}
        native.update(extra.collect(late, until) if extra is not None else {})
        if native:
            logger.info("hang: py-spy dumps of %d ranks collected in %.3f s", len(native),
                        time.monotonic() - t0)
        for lr, text in native.items():
            self._stacks[lr] = (self._stacks.get(lr) or "") + (
                "\n--- py-spy dump --native ---\n" + text)
        path = self._write(verdict, reports, first, log_dir)
        if path:
            logger.error("hang: stacks in %s", path)
        self.blamed = self._blame(verdict, reports, path) if blamed else {}
        if at_end:
            logger.error("hang: stopping the workers still running (group_rank=%s); the run "
                         "ends with the workers' result, no restart", group_rank)
            return HangAction.END
        if blamed and restarts_left <= 0:
            logger.error("hang: no restart left: the run of this node (group_rank=%s) fails",
                         group_rank)
            return HangAction.RETRY
        if blamed:
            logger.error("hang: restarting the worker group (group_rank=%s) as after a failure",
                         group_rank)
            return HangAction.RETRY
        logger.warning("hang: restarting the worker group (group_rank=%s) with the job",
                       group_rank)
        return HangAction.RESTART

    def ended_ranks(self) -> set[int]:
        """The local ranks whose program ended (their end mark is set)."""
        return {lr for lr, v in self.slots.read_all().items() if v.end_ns}

    def _warn_no_progress(self, views: dict[int, Any], now: int) -> None:
        """One warning when the job showed no progress NO_PROGRESS_WARN_S after its start:
        the check cannot judge it (it judges from the first progress on)."""
        if any(v.steps > 0 for v in views.values()):
            self._warned = True  # it can judge this job: nothing to say, ever
            return
        waited = (now - self._started_ns) / 1e9
        if not self._started_ns or waited < NO_PROGRESS_WARN_S * self.scale:
            return
        self._warned = True
        armed = any(v.pid for v in views.values())
        logger.warning(
            "hang: no rank has shown progress %.0f s after the job started, so --hang-timeout "
            "cannot judge this job%s. Progress is a torch.optim optimizer step, a "
            "torch.cuda.CUDAGraph.replay(), or a call to fastelastic.progress.step(): call "
            "`import fastelastic.progress` and `fastelastic.progress.step()` once per step of "
            "the training loop (and wrap long sections in `with "
            "fastelastic.progress.suspend():`)", waited,
            "" if armed else " (no worker loaded the marks: a worker started with python "
            "-E, -I or -S, or a non-Python entrypoint, reports none)")

    def _report_dir(self) -> str:
        """Where the reports go with no log dir: a directory of their own, kept after the
        agent ends (the slots' directory is removed then)."""
        if self._kept_dir is None:
            self._kept_dir = tempfile.mkdtemp(prefix="fastelastic-hang-")
            logger.warning("hang: no log dir: the hang reports go to %s (kept)", self._kept_dir)
        return self._kept_dir

    def _blame(self, verdict: Verdict, reports: list[RankReport],
               path: str | None) -> dict[int, tuple[str, str | None]]:
        """What each blamed rank of this node hung in, and where its stacks are: the culprits
        the verdict named, or, when no rank stands out, every rank of the claiming node."""
        by_rank = {r.rank: r for r in reports}
        out: dict[int, tuple[str, str | None]] = {}
        for lr, rank in sorted(self._ranks.items()):
            if verdict.culprits and rank not in verdict.culprits:
                continue
            r = by_rank.get(rank)
            what = (f"no progress for {r.idle_s:.1f} s, in {r.frame}" if r is not None
                    else "no progress")
            if not verdict.culprits:
                what += " (no rank stood out: this node claimed the verdict)"
            stacks = os.path.join(path, f"rank{rank}.stacks.txt") if path else None
            out[lr] = (f"hung (--hang-timeout): {what}", stacks)
        return out

    def _write(self, verdict: Verdict, reports: list[RankReport], first: bool,
               log_dir: str | None) -> str | None:
        """This node's ranks' full stacks (and, from the claimer, the report) in the logs."""
        base = log_dir or self._report_dir()
        out = os.path.join(base, f"hang_{self.verdicts}")
        try:
            os.makedirs(out, exist_ok=True)
            for lr, text in sorted(self._stacks.items()):
                rank = self._ranks.get(lr, lr)
                with open(os.path.join(out, f"rank{rank}.stacks.txt"), "w") as f:
                    f.write(text or "(no stack dump: the rank did not arm it)\n")
            if first:
                with open(os.path.join(out, "report.txt"), "w") as f:
                    f.write(verdict.line + "\n\n")
                    for frame, ranks in verdict.groups.items():
                        f.write(f"ranks {ranks}: {frame}\n")
                    f.write("\n")
                    for r in sorted(reports, key=lambda r: r.rank):
                        f.write(f"rank {r.rank} host {r.host} pid {r.pid} steps {r.steps} "
                                f"idle {r.idle_s:.1f}s in {r.frame}\n")
        except OSError as e:
            logger.warning("hang: could not write the stacks to %s: %s", out, e)
            return None
        return out


_ABSENT = "\0fastelastic:absent"  # compare_set's answer for a key that does not exist


def read_present(store: Any, keys: list[str]) -> list[bytes] | None:
    """The values of ``keys``, None as soon as one does not exist; never waits for a key.

    ``compare_set(k, A, A)`` changes nothing (a present key's value is not ``A``; an absent
    key is not created when the expected value is not empty) and answers at once, where
    ``multi_get`` would wait a whole store timeout for a summary its peer just withdrew.
    """
    out = []
    for k in keys:
        v = store.compare_set(k, _ABSENT, _ABSENT)
        if v == _ABSENT.encode() or v == _ABSENT:
            return None
        out.append(v)
    return out
