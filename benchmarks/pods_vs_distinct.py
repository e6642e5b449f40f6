"""Issue 36: pods against distinct addresses through the same cuts, repeated and interleaved.

Runs ``tests/recovery/podlib.cut_and_heal`` (the matrix cell of ``test_pods``: 4 nodes x 2
gloo workers in network namespaces, ``--nnodes 1:4 --preload torch``, three candidates, a cut
of 25 s by iptables on both sides, then healed) ``--runs`` times per cell and per mode, the
modes interleaved (pods, distinct, distinct, pods, ...: each round swaps the order, so a drift
of the machine's load falls on both). Each run appends one JSON line to ``--out``: the cell,
the mode, the round, the load average at its start, a world of 8 after the heal (s; None: none
within 40 s), the longest two worlds at once (s), the worlds since the cut, the cut's and the
heal's wall-clock times, and the launchers' phases after the heal read from their logs (kept
under ``--workdir``). ``--table`` prints the markdown table of a finished ``--out``.

Root only (network namespaces, iptables). Not collected by pytest (no ``bench_`` prefix):

    sudo PYTHONPATH=src nice -n 10 python3 benchmarks/pods_vs_distinct.py \\
        --cells 3-1:drop,node0-isolated:reject-icmp --runs 5 --out /tmp/pods.jsonl
    python3 benchmarks/pods_vs_distinct.py --table /tmp/pods.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "recovery"))

BOUND_S = 0.05  # the bound: within max(10 %, 50 ms) of distinct addresses
_STAMP = re.compile(r"^[IWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+) ")
# the phases of a re-form after the heal, as the launchers log them (first line after the heal)
PHASES = {
    "store lost, moved": "was lost (",
    "round abandoned (majority rule)": "abandoning the round",
    "went back": "went back to it",
    "new nodes detected": "new nodes from",
    "rendezvous complete (8)": "world_size=8 role_world_size=8",
}


def _stamp(line: str, year: int) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    mmdd, hh, mi, ss = m.groups()
    day = datetime(year, int(mmdd[:2]), int(mmdd[2:]), int(hh), int(mi), tzinfo=timezone.utc)
    return day.timestamp() + float(ss)


def phases(out: Path, healed: float, until: float) -> dict[str, float]:
    """Each phase's first line after the heal (and before ``until``: the world of 8's first
    step; after it, the cluster's teardown) in any launcher's log, in seconds after it."""
    year = datetime.fromtimestamp(healed, timezone.utc).year
    got: dict[str, float] = {}
    before = "last round abandoned before the heal"  # the lone side's cadence: its last look
    for log in sorted(out.glob("node*.log")):
        for line in log.read_text(errors="replace").splitlines():
            t = _stamp(line, year)
            if t is not None and healed - 70 < t < healed and "abandoning the round" in line:
                got[before] = max(got.get(before, -99.0), round(t - healed, 3))
            if t is None or t < healed or t > until:
                continue
            for name, marker in PHASES.items():
                if marker in line and (name not in got or t - healed < got[name]):
                    got[name] = round(t - healed, 3)
    return got


def run(args: argparse.Namespace) -> None:
    from podlib import KINDS, SCENARIOS, cut_and_heal

    cells = [tuple(c.split(":")) for c in args.cells.split(",")]
    for scenario, kind in cells:
        if scenario not in SCENARIOS or kind not in KINDS:
            raise SystemExit(f"unknown cell {scenario}:{kind}: scenarios {sorted(SCENARIOS)}, "
                             f"kinds {KINDS}")
    env = dict(kv.split("=", 1) for kv in args.env)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for r in range(args.runs):
        for scenario, kind in cells:
            modes = [m == "pods" for m in args.modes.split(",")]
            for pods in (modes if r % 2 == 0 else modes[::-1]):
                mode = "pods" if pods else "addrs"
                out = work / f"{scenario}-{kind}-{mode}-{r}"
                out.mkdir(parents=True, exist_ok=False)
                load = os.getloadavg()[0]
                t0 = time.time()
                row: dict[str, Any] = {"scenario": scenario, "kind": kind, "mode": mode,
                                       "round": r, "load": round(load, 2), "dir": str(out),
                                       "cut s": args.cut_s, "last call": args.last_call,
                                       "watch s": args.watch_s}
                try:
                    res = cut_and_heal(out, kind, pods, scenario, cut_s=args.cut_s,
                                       last_call=args.last_call, watch_s=args.watch_s, **env)
                    row.update({k: v for k, v in res.items()
                                if k not in ("tail", "both", "zombies", "kind", "pods",
                                             "scenario")})
                    row["zombies"] = [sorted(z) for z in res["zombies"]]
                    took = res["world of 8 after the heal (s)"]
                    row["phases"] = phases(out, res["healed at"], res["healed at"] + (
                        took if took is not None else args.watch_s))
                except BaseException as e:  # a failed run is a row too; ^C ends the run
                    row["error"] = f"{type(e).__name__}: {e}"[:2000]
                    if isinstance(e, KeyboardInterrupt):
                        raise
                finally:
                    row["wall s"] = round(time.time() - t0, 1)
                    with open(args.out, "a") as f:
                        f.write(json.dumps(row) + "\n")
                print(json.dumps({k: row.get(k) for k in (
                    "scenario", "kind", "mode", "round", "load",
                    "world of 8 after the heal (s)", "longest two worlds at once (s)",
                    "phases", "error")}), flush=True)


def _p50(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def table(path: str) -> str:
    rows = [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
    cells: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for row in rows:
        cells.setdefault((row["scenario"], row["kind"]), {}).setdefault(row["mode"], []).append(
            row)
    out = ["| scenario | cut | runs (pods / addrs) | a world of 8 after the heal, pods: p50 "
           "(min-max) | distinct addresses | pods - distinct (p50) | bound max(10 %, 50 ms) "
           "| within | longest two worlds at once (max) | failed runs |",
           "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for (scenario, kind), modes in cells.items():
        took = {m: [r["world of 8 after the heal (s)"] for r in modes.get(m, [])
                    if r.get("world of 8 after the heal (s)") is not None]
                for m in ("pods", "addrs")}
        both = [r.get("longest two worlds at once (s)") or 0.0
                for m in modes.values() for r in m]
        failed = [f"{r['mode']} round {r['round']}: {r.get('error', 'no world of 8')[:80]}"
                  for m in modes.values() for r in m
                  if "error" in r or r.get("world of 8 after the heal (s)") is None]
        if took["pods"] and took["addrs"]:
            a, b = statistics.median(took["pods"]), statistics.median(took["addrs"])
            bound = max(0.1 * b, BOUND_S)
            diff, within = f"{a - b:+.2f} s", "yes" if abs(a - b) <= bound else "**no**"
            bound_s = f"{bound:.2f} s"
        else:
            diff = within = bound_s = "-"
        out.append(f"| {scenario} | {kind} | {len(modes.get('pods', []))} / "
                   f"{len(modes.get('addrs', []))} | {_p50(took['pods'])} | "
                   f"{_p50(took['addrs'])} | {diff} | {bound_s} | {within} | "
                   f"{max(both) if both else 0.0:.2f} s | {'; '.join(failed) or 'none'} |")
    names = ["last round abandoned before the heal", *PHASES]
    out += ["", "Phases (s after the heal, p50 over the runs that show one, (min-max) and count):",
            "", "| scenario | cut | mode | " + " | ".join(names) + " | a world of 8 |",
            "|---|---|---|" + "---:|" * (len(names) + 1)]
    for (scenario, kind), modes in cells.items():
        for mode, runs in sorted(modes.items(), reverse=True):
            cols = []
            for name in names:
                xs = [r["phases"][name] for r in runs if name in r.get("phases", {})]
                cols.append(f"{_p50(xs)} ×{len(xs)}" if xs else "-")
            took = [r["world of 8 after the heal (s)"] for r in runs
                    if r.get("world of 8 after the heal (s)") is not None]
            out.append(f"| {scenario} | {kind} | {mode} | " + " | ".join(cols)
                       + f" | {_p50(took)} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cells", default="partial:drop,2-2:drop,3-1:drop,node0-isolated:drop,"
                    "node0-isolated:reject-icmp", help="scenario:kind,... (podlib.SCENARIOS, "
                    "podlib.KINDS)")
    ap.add_argument("--runs", type=int, default=5, help="runs per cell and mode")
    ap.add_argument("--out", default="pods_vs_distinct.jsonl", help="JSON lines, appended")
    ap.add_argument("--workdir", default="/tmp/pods_vs_distinct",
                    help="each run's logs and steps (kept)")
    ap.add_argument("--cut-s", type=float, default=25.0, help="how long each cut lasts")
    ap.add_argument("--last-call", type=int, default=1, help="--rdzv-conf last_call_timeout")
    ap.add_argument("--watch-s", type=float, default=40.0,
                    help="how long after the heal a run waits for the world of 8")
    ap.add_argument("--modes", default="pods,addrs", help="pods, addrs or both (interleaved)")
    ap.add_argument("--env", action="append", default=[], metavar="K=V",
                    help="extra environment for the launchers")
    ap.add_argument("--table", metavar="JSONL", help="print the table of a finished run")
    args = ap.parse_args()
    if args.table:
        print(table(args.table))
    else:
        run(args)


if __name__ == "__main__":
    main()
