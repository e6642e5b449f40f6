"""Plots of the benchmark results, fastelastic vs torch, for BENCHMARKS.md.

Reads ``benchmarks/results/<name>.json`` (written by the benchmarks); for results measured
before the benchmarks wrote JSON it reads the markdown table of the same name instead. Writes
one PNG per plot into the output directory; a plot whose input is missing is skipped with a
message. Needs matplotlib (``pip install 'fastelastic[bench]'``).

    python3 benchmarks/plot.py [--results benchmarks/results] [--out benchmarks/results]

Plots and inputs:

* ``rendezvous_vs_nodes.png``: formation time vs nodes, log-log (``rendezvous``).
* ``multi_key.png``: multi_set+multi_get time vs keys (``store``).
* ``connection_storm.png``: time until N clients are connected and served (``store``).
* ``worker_restart.png``: worker exit -> detected / replacement running (``agent``).
* ``recovery_downtime.png``: node-loss downtime by failure mode (``recovery.json``: a list
  ``runs`` of ``{"launcher", "mode", "scenario", "downtime_s", "recovered"}``; a run that did not
  recover reports its cap as ``downtime_s`` and is drawn as a lower bound).
* ``hang_downtime.png``: a hung rank, hang -> every rank trains again, by kind of hang
  (``hang.json``, written by ``bench_hang.py``: the same ``runs`` as ``recovery.json``).

Exit status: 0 when every plot with an input was drawn, 1 when an input could not be read (its
plot is skipped, the others are still drawn), 2 when matplotlib is missing.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
IMPLS = ("fastelastic", "torch")
COLORS = {"fastelastic": "#1f77b4", "torch": "#d62728"}
LABELS = {"fastelastic": "fastelastic", "torch": "torch 2.13"}


class InputError(ValueError):
    """A results file exists but cannot be used."""


# ------------------------------------------------------------------------------ inputs


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise InputError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _md_rows(path: Path) -> list[list[str]]:
    """The cells of every markdown table row of ``path`` (separator rows excluded)."""
    rows = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("|") and not re.fullmatch(r"\|[\s:|-]+\|", line):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def _num(cell: str) -> float | None:
    m = re.match(r"^[~≈]?([\d,]*\.?\d+)", cell.strip())
    return float(m.group(1).replace(",", "")) if m else None


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise InputError(f"{path}: {what}")


def load_rendezvous(d: Path) -> tuple[dict, str] | None:
    """{impl: [(n, p50_s, p99_s or None, failed)]}, limit_s."""
    data = _read_json(d / "rendezvous.json")
    out: dict[str, list] = {i: [] for i in IMPLS}
    if data is not None:
        src = d / "rendezvous.json"
        rows = data.get("formation")
        _need(isinstance(rows, list), src, "no 'formation' list")
        for r in rows:
            _need(isinstance(r, dict) and r.get("impl") in IMPLS and "n" in r, src,
                  f"bad formation row {r!r}")
            out[r["impl"]].append((int(r["n"]), r.get("p50"), r.get("p99"), bool(r.get("failed"))))
        limit = float(data.get("limit_s", 60.0))
    else:
        src = d / "rendezvous.md"
        if not src.exists():
            return None
        limit = 60.0
        for cells in _md_rows(src):
            if len(cells) < 7 or _num(cells[0]) is None:
                continue
            n = int(_num(cells[0]) or 0)
            for impl, (a, b) in zip(IMPLS, ((1, 2), (4, 5)), strict=True):
                m = re.search(r"did not complete in ([\d.]+)", cells[a])
                if m:
                    limit = float(m.group(1))
                    out[impl].append((n, None, None, True))
                elif _num(cells[a]) is not None:
                    out[impl].append((n, _num(cells[a]), _num(cells[b]), False))
    _need(any(out.values()), src, "no rendezvous figures")
    return {"series": out, "limit_s": limit}, src.name


# store.md labels -> (family, metric); the figures there are in ms.
_STORE_LABELS = [
    (re.compile(r"^multi_set\+multi_get ([\d,]+) keys, own client\+server$"), "multi_user",
     "total_s"),
    (re.compile(r"^multi_set\+multi_get ([\d,]+) keys, torch client$"), "multi_server", "total_s"),
    (re.compile(r"^multi_set\+multi_get ([\d,]+) keys, on our server$"), "multi_client",
     "total_s"),
    (re.compile(r"^storm ([\d,]+) light clients: time to all"), "storm", "time_s"),
    (re.compile(r"^storm ([\d,]+) light clients: refused/reset/unfinished"), "storm", "errors"),
]  # fmt: skip


def load_store(d: Path) -> tuple[dict, str] | None:
    """{(family, case, impl): {metric: value}} with times in seconds."""
    data = _read_json(d / "store.json")
    res: dict[tuple[str, str, str], dict] = {}
    if data is not None:
        src = d / "store.json"
        rows = data.get("results")
        _need(isinstance(rows, list), src, "no 'results' list")
        for r in rows:
            _need(isinstance(r, dict) and {"family", "case", "impl"} <= r.keys(), src,
                  f"bad result row {r!r}")
            res[(r["family"], str(r["case"]), r["impl"])] = r
    else:
        src = d / "store.md"
        if not src.exists():
            return None
        for cells in _md_rows(src):
            if len(cells) < 4:
                continue
            for pattern, family, metric in _STORE_LABELS:
                m = pattern.match(cells[0])
                if not m:
                    continue
                case = m.group(1).replace(",", "")
                scale = 1000.0 if metric.endswith("_s") else 1.0
                for impl, cell in zip(IMPLS, cells[2:4], strict=True):
                    v = _num(cell)
                    if v is not None:
                        res.setdefault((family, case, impl), {})[metric] = v / scale
    _need(bool(res), src, "no store figures")
    return res, src.name


_AGENT_OPS = {
    "exit->detected": re.compile(r"^worker exit → agent sees it"),
    "exit->replacement running": re.compile(r"^worker exit → replacement worker running"),
}


def load_agent(d: Path) -> tuple[dict, str] | None:
    """{op: {impl: {"p50_ms", "p90_ms", "p99_ms"}}} for the worker restart figures."""
    data = _read_json(d / "agent.json")
    res: dict[str, dict[str, dict]] = {}
    if data is not None:
        src = d / "agent.json"
        rows = data.get("results")
        _need(isinstance(rows, list), src, "no 'results' list")
        for r in rows:
            if isinstance(r, dict) and r.get("op") in _AGENT_OPS and r.get("impl") in IMPLS:
                res.setdefault(r["op"], {})[r["impl"]] = r
    else:
        src = d / "agent.md"
        if not src.exists():
            return None
        for cells in _md_rows(src):
            for op, pattern in _AGENT_OPS.items():
                if len(cells) >= 3 and pattern.match(cells[0]):
                    for impl, cell in zip(IMPLS, cells[1:3], strict=True):
                        vals = [_num(x) for x in cell.replace("ms", "").split("/")]
                        if len(vals) == 3 and all(v is not None for v in vals):
                            res.setdefault(op, {})[impl] = dict(
                                zip(("p50_ms", "p90_ms", "p99_ms"), vals, strict=True)
                            )
    _need(bool(res), src, "no worker restart figures")
    return res, src.name


def load_recovery(d: Path, name: str = "recovery.json") -> tuple[dict, str] | None:
    """{(mode, scenario): {launcher: (downtime_s median, lower bound?)}}."""
    src = d / name
    data = _read_json(src)
    if data is None:
        return None
    runs = data.get("runs")
    _need(isinstance(runs, list) and bool(runs), src, "no 'runs' list")
    grouped: dict[tuple[str, str], dict[str, list]] = {}
    for r in runs:
        _need(isinstance(r, dict) and {"launcher", "mode", "downtime_s"} <= r.keys(), src,
              f"a run needs launcher, mode and downtime_s: {r!r}")
        key = (str(r["mode"]), str(r.get("scenario", "")))
        grouped.setdefault(key, {}).setdefault(str(r["launcher"]), []).append(r)
    out: dict[tuple[str, str], dict[str, tuple[float, bool]]] = {}
    for key, launchers in grouped.items():
        for launcher, rs in launchers.items():
            med = statistics.median(float(r["downtime_s"]) for r in rs)
            out.setdefault(key, {})[launcher] = (med, any(r.get("recovered") is False for r in rs))
    return out, src.name


# ------------------------------------------------------------------------------ plots


def _figure(plt: Any, title: str, size: tuple[float, float] = (7.5, 4.8)) -> tuple[Any, Any]:
    fig, ax = plt.subplots(figsize=size, dpi=110)
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="major", alpha=0.35)
    return fig, ax


def plot_rendezvous(plt: Any, data: dict, out: Path) -> None:
    fig, ax = _figure(plt, "Rendezvous formation time vs nodes (min = max = N)")
    limit = data["limit_s"]
    for impl in IMPLS:
        pts = sorted(p for p in data["series"][impl] if not p[3] and p[1])
        if pts:
            ns = [p[0] for p in pts]
            ax.plot(ns, [p[1] for p in pts], "o-", color=COLORS[impl],
                    label=f"{LABELS[impl]} p50")  # fmt: skip
            p99 = [(p[0], p[2]) for p in pts if p[2]]
            if p99:
                ax.plot(*zip(*p99, strict=True), "_", color=COLORS[impl], markersize=10,
                        label=f"{LABELS[impl]} p99")  # fmt: skip
        failed = sorted(p[0] for p in data["series"][impl] if p[3])
        if failed:
            label = f"{LABELS[impl]}: did not complete in {limit:.0f} s (lower bound)"
            ax.plot(failed, [limit] * len(failed), "^", color=COLORS[impl], markersize=9,
                    markerfacecolor="none", label=label)  # fmt: skip
    ours = {p[0]: p[1] for p in data["series"]["fastelastic"] if p[1]}
    for n, p50, _, failed in data["series"]["torch"]:
        t = limit if failed else p50
        if n in ours and t:
            ax.annotate(f"{'>' if failed else ''}{t / ours[n]:.0f}×", (n, t),
                        textcoords="offset points", xytext=(6, -12), fontsize=8,
                        color=COLORS["torch"])  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ns = sorted({p[0] for impl in IMPLS for p in data["series"][impl]})
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("nodes (N)")
    ax.set_ylabel("seconds until every node has its rank")
    ax.legend(fontsize=8, loc="upper left")
    fig.text(0.99, 0.01, "annotations: torch / fastelastic (p50)", ha="right", fontsize=7,
             color="gray")  # fmt: skip
    fig.tight_layout()
    fig.savefig(out)


def plot_multi_key(plt: Any, data: dict, out: Path) -> None:
    fig, ax = _figure(plt, "multi_set + multi_get of N keys (64-byte values)")
    drawn = False
    for family, style, what in (
        ("multi_user", "o-", "own client on own server"),
        ("multi_server", "s--", "torch's client on each server"),
    ):
        for impl in IMPLS:
            pts = sorted((int(c), m["total_s"] * 1000) for (f, c, i), m in data.items()
                         if f == family and i == impl and m.get("total_s"))  # fmt: skip
            if pts:
                ax.plot(*zip(*pts, strict=True), style, color=COLORS[impl],
                        label=f"{LABELS[impl]}: {what}",
                        alpha=1.0 if family == "multi_user" else 0.55)  # fmt: skip
                drawn = True
    if not drawn:
        raise InputError("store figures have no multi-key rows")
    for (f, c, i), m in data.items():
        t = data.get((f, c, "torch"), {}).get("total_s")
        if f == "multi_user" and i == "fastelastic" and m.get("total_s") and t:
            ax.annotate(f"{t / m['total_s']:.0f}× faster", (int(c), t * 1000),
                        textcoords="offset points", xytext=(8, -3), fontsize=8)  # fmt: skip
    ax.set_xscale("log")
    ax.set_yscale("log")
    keys = sorted({int(c) for (f, c, _) in data if f.startswith("multi")})
    ax.set_xticks(keys, [f"{k:,}" for k in keys])
    ax.minorticks_off()
    ax.set_xlim(keys[0] / 1.6, keys[-1] * 2.2)
    ax.set_xlabel("keys per call")
    ax.set_ylabel("ms (best run)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)


def _bars(
    ax: Any,
    groups: list[str],
    series: dict[str, list[float | None]],
    colors: dict[str, str],
    hatched: dict[str, list[bool]] | None = None,
) -> None:
    """Grouped bars: one group per ``groups`` entry, one bar per series; values on top."""
    width = 0.8 / max(1, len(series))
    for k, (name, vals) in enumerate(series.items()):
        labelled = False
        for g, v in enumerate(vals):
            if v is None:
                continue
            x = g + (k - (len(series) - 1) / 2) * width
            lower = bool(hatched and hatched[name][g])
            ax.bar(x, v, width * 0.95, color=colors[name], hatch="//" if lower else None,
                   edgecolor="white" if lower else None, label=None if labelled else name)
            labelled = True
            ax.annotate(("≥" if lower else "") + _short(v), (x, v), textcoords="offset points",
                        xytext=(0, 2), ha="center", fontsize=7)  # fmt: skip
    ax.set_xticks(range(len(groups)), groups)


def _short(v: float) -> str:
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def plot_storm(plt: Any, data: dict, out: Path) -> None:
    cases = sorted({int(c) for (f, c, _), m in data.items() if f == "storm" and "time_s" in m})
    if not cases:
        raise InputError("store figures have no connection storm rows")
    fig, ax = _figure(plt, "Connection storm: N clients connect, handshake and ADD at once")
    series = {LABELS[i]: [data.get(("storm", str(n), i), {}).get("time_s") for n in cases]
              for i in IMPLS}  # fmt: skip
    series = {k: [None if v is None else v * 1000 for v in vs] for k, vs in series.items()}
    _bars(ax, [f"{n:,} clients" for n in cases], series,
          {LABELS[i]: COLORS[i] for i in IMPLS})  # fmt: skip
    errs = []
    for n in cases:
        e = {i: data.get(("storm", str(n), i), {}).get("errors") for i in IMPLS}
        if any(e.values()):
            errs.append(f"{n:,}: " + ", ".join(f"{LABELS[i]} {int(v or 0)}" for i, v in e.items()))
    if errs:
        ax.text(0.01, 0.97, "refused/reset/unfinished — " + "; ".join(errs),
                transform=ax.transAxes, va="top", fontsize=7)  # fmt: skip
    ax.set_ylabel("ms until all are served (best run)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0, 0.92))
    fig.tight_layout()
    fig.savefig(out)


def plot_restart(plt: Any, data: dict, out: Path) -> None:
    ops = [op for op in _AGENT_OPS if op in data]
    fig, ax = _figure(plt, "Worker restart: one worker exits (c10d rendezvous, 40 exits)")
    names = {"exit->detected": "exit → agent sees it",
             "exit->replacement running": "exit → replacement worker running"}  # fmt: skip
    series = {LABELS[i]: [data[op].get(i, {}).get("p50_ms") for op in ops] for i in IMPLS}
    _bars(ax, [names[op] for op in ops], series, {LABELS[i]: COLORS[i] for i in IMPLS})
    width = 0.8 / len(IMPLS)
    for k, impl in enumerate(IMPLS):
        for g, op in enumerate(ops):
            s = data[op].get(impl)
            if s and s.get("p99_ms") and s.get("p50_ms"):
                # beside the bar's centre, where its value is written
                x = g + (k - (len(IMPLS) - 1) / 2) * width + width * 0.3
                ax.plot([x, x], [s["p50_ms"], s["p99_ms"]], color="black", lw=1)
                ax.plot(x, s["p99_ms"], "_", color="black", markersize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (bar: p50, whisker: p99)")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out)


def plot_recovery(plt: Any, data: dict, out: Path) -> None:
    order = {"kill": 0, "freeze": 1, "cut": 2}
    keys = sorted(data, key=lambda k: (order.get(k[0], 9), k))
    launchers = sorted({lname for k in keys for lname in data[k]},
                       key=lambda s: (not s.startswith("fast"), s))  # fmt: skip
    palette = ["#1f77b4", "#d62728", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b"]
    colors = {lname: palette[i % len(palette)] for i, lname in enumerate(launchers)}
    fig, ax = _figure(plt, "Node loss: downtime until every rank trains again",
                      size=(max(7.5, 1.4 * len(keys) + 3), 4.8))  # fmt: skip
    series = {lname: [data[k].get(lname, (None, False))[0] for k in keys] for lname in launchers}
    lower = {lname: [data[k].get(lname, (None, False))[1] for k in keys] for lname in launchers}
    _bars(ax, [f"{m}\n{s}" if s else m for m, s in keys], series, colors, lower)
    ax.set_yscale("log")
    top = max(v for vs in series.values() for v in vs if v is not None)
    ax.set_ylim(top=top * 3)
    ax.set_ylabel("seconds, log scale (hatched ≥: never recovered, its cap)")
    ax.legend(fontsize=8, loc="upper center", ncol=min(3, len(launchers)))
    fig.tight_layout()
    fig.savefig(out)


def load_hang(d: Path) -> tuple[dict, str] | None:
    """As ``load_recovery``, from ``hang.json`` (mode = the kind of hang)."""
    return load_recovery(d, "hang.json")


def plot_hang(plt: Any, data: dict, out: Path) -> None:
    order = {"native": 0, "sleep": 1, "deadlock": 2, "loop": 3, "crash": 4}
    keys = sorted(data, key=lambda k: (order.get(k[0], 9), k))
    launchers = sorted({lname for k in keys for lname in data[k]},
                       key=lambda s: (not s.startswith("fast"), "preload" not in s, -len(s)))
    colors = dict(zip(launchers, ["#1f77b4", "#17becf", "#d62728", "#ff7f0e"], strict=False))
    fig, ax = _figure(plt, "A hung rank (--hang-timeout 5): hang -> every rank trains again",
                      size=(9.0, 4.8))
    series = {lname: [data[k].get(lname, (None, False))[0] for k in keys] for lname in launchers}
    lower = {lname: [data[k].get(lname, (None, False))[1] for k in keys] for lname in launchers}
    names = {"crash": "crash\n(no hang)"}
    _bars(ax, [names.get(m, m) for m, _ in keys], series, colors, lower)
    ax.set_yscale("log")
    top = max(v for vs in series.values() for v in vs if v is not None)
    ax.set_ylim(top=top * 3)
    ax.set_ylabel("seconds, log scale (hatched ≥: not recovered, its bound)")
    ax.axhline(10, ls="--", lw=1, color="gray", label="target with --preload: 10 s")
    ax.legend(fontsize=8, loc="upper center", ncol=3)
    fig.tight_layout()
    fig.savefig(out)


PLOTS: list[tuple[str, Callable[[Path], tuple[dict, str] | None], Callable, str]] = [
    ("rendezvous_vs_nodes.png", load_rendezvous, plot_rendezvous, "rendezvous.json/.md"),
    ("multi_key.png", load_store, plot_multi_key, "store.json/.md"),
    ("connection_storm.png", load_store, plot_storm, "store.json/.md"),
    ("worker_restart.png", load_agent, plot_restart, "agent.json/.md"),
    ("recovery_downtime.png", load_recovery, plot_recovery, "recovery.json"),
    ("hang_downtime.png", load_hang, plot_hang, "hang.json"),
]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=HERE / "results",
                    help="directory of the benchmark results (default: benchmarks/results)")
    ap.add_argument("--out", type=Path, default=None,
                    help="directory for the PNGs (default: the results directory)")
    args = ap.parse_args(argv)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot.py needs matplotlib: pip install 'fastelastic[bench]'", file=sys.stderr)
        return 2
    out_dir = args.out or args.results
    out_dir.mkdir(parents=True, exist_ok=True)
    status = 0
    for png, load, draw, needs in PLOTS:
        try:
            loaded = load(args.results)
            if loaded is None:
                print(f"skip {png}: no {needs} in {args.results}")
                continue
            data, source = loaded
            draw(plt, data, out_dir / png)
        except InputError as e:
            print(f"error: {png} not drawn: {e}", file=sys.stderr)
            status = 1
            continue
        finally:
            plt.close("all")
        print(f"wrote {out_dir / png} (from {source})")
    return status


if __name__ == "__main__":
    sys.exit(main())
