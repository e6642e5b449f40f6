"""Benchmark sizes, shared store servers and workers, and the fastelastic-vs-torch results table.

Sizes: full by default; small ("smoke") when run with ``--benchmark-disable``; the environment
variable ``FE_BENCH_SIZE=full|smoke`` overrides either. ``--store-table PATH`` writes the
markdown table of the run to PATH (it is always printed in the terminal summary), and its figures
as JSON beside it (``store.md`` -> ``store.json``, read by ``plot.py``).
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _storebench as sb  # noqa: E402

SIZES = {
    "full": {
        "rt_rounds": 5000, "rt_warmup": 500,
        "tp_pairs": {16: 400, 64: 200}, "tp_rounds": 5,
        "multi_n": [10_000, 100_000], "multi_rounds": {10_000: 5, 100_000: 3},
        "multi_torch_rounds": {10_000: 3, 100_000: 1}, "multi_bound_s": 90.0,
        "storm_n": [1024, 8192, 16384], "storm_rounds": {1024: 5, 8192: 3, 16384: 3},
        "rss_conns": 10_000, "barrier_n": 19_000, "barrier_rounds": 2,
        "restart_nproc": 4, "restart_rounds": 5,
    },
    "smoke": {
        "rt_rounds": 50, "rt_warmup": 5,
        "tp_pairs": {16: 10, 64: 3}, "tp_rounds": 1,
        "multi_n": [1_000, 10_000], "multi_rounds": {1_000: 1, 10_000: 1},
        "multi_torch_rounds": {1_000: 1, 10_000: 1}, "multi_bound_s": 60.0,
        "storm_n": [1024], "storm_rounds": {1024: 1},
        "rss_conns": 1000, "barrier_n": 512, "barrier_rounds": 1,
        "restart_nproc": 2, "restart_rounds": 1,
    },
}


def pytest_addoption(parser):
    parser.addoption("--store-table", default=None,
                     help="write the store benchmark table (markdown) to this file")


def size_mode(config) -> str:
    env = os.environ.get("FE_BENCH_SIZE")
    if env:
        if env not in SIZES:
            raise pytest.UsageError(f"FE_BENCH_SIZE must be one of {sorted(SIZES)}, got {env!r}")
        return env
    return "smoke" if config.getoption("benchmark_disable", False) else "full"


@pytest.fixture(scope="session")
def sizes(request) -> dict:
    return SIZES[size_mode(request.config)]


@pytest.fixture(scope="session", autouse=True)
def _nofile():
    sb.raise_nofile()


@pytest.fixture(scope="session")
def servers():
    """One server process per implementation, shared by the benchmarks that need no fresh one."""
    started = Servers()
    try:
        for impl in ("fastelastic", "torch"):
            started[impl] = sb.ServerProc(impl)
        yield started
    finally:
        for s in started.values():
            s.stop()


class Servers(dict):
    """impl -> ServerProc; a server left busy by an abandoned request is replaced."""

    def restart(self, impl: str) -> sb.ServerProc:
        self[impl].stop()
        self[impl] = sb.ServerProc(impl)
        return self[impl]


class WorkerPool:
    """Worker processes driving store clients; killed and replaced if one must be abandoned."""

    def __init__(self) -> None:
        self.workers: list[sb.Worker] = []

    def get(self, n: int) -> list[sb.Worker]:
        self.workers = [w for w in self.workers if w.proc.poll() is None]
        while len(self.workers) < n:
            self.workers.append(sb.Worker())
        return self.workers[:n]

    def discard(self, w: sb.Worker) -> None:
        w.kill()
        self.workers.remove(w)

    def stop(self) -> None:
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="session")
def pool():
    p = WorkerPool()
    yield p
    p.stop()


# ------------------------------------------------------------------------------ results

class Results:
    """Metrics per (family, case, impl); ratios fastelastic/torch go into both extra_infos."""

    def __init__(self) -> None:
        self.data: dict[tuple[str, str], dict[str, dict]] = {}
        self.infos: dict[tuple[str, str, str], dict] = {}

    def add(self, family: str, case: str, impl: str, metrics: dict, extra_info: dict) -> None:
        extra_info.update(metrics)
        self.data.setdefault((family, case), {})[impl] = metrics
        self.infos[(family, case, impl)] = extra_info
        both = self.data[(family, case)]
        if "fastelastic" in both and "torch" in both:
            ratios = {}
            for k, v in both["fastelastic"].items():
                t = both["torch"].get(k)
                if _num(v) and _num(t) and t != 0:
                    ratios[f"ratio_{k}"] = v / t
            for i in ("fastelastic", "torch"):
                info = self.infos.get((family, case, i))
                if info is not None:
                    info.update(ratios)

    def get(self, family: str, case: str, impl: str, key: str):
        return self.data.get((family, case), {}).get(impl, {}).get(key)


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


_RESULTS = Results()


@pytest.fixture(scope="session")
def results() -> Results:
    return _RESULTS


_OPS = ("set", "get", "add", "compare_set")
# Round trips run with client and server on one CPU and on two (see bench_store.py).
_PL = ("1cpu", "2cpu")
# (family, case, metric, label, unit, scale, direction, target ratio or None)
# direction "<=": fastelastic/torch must be <= target; ">=": must be >= target.
_ROWS = [
    *[("rt_user", f"{op}@{pl}", "p50_us", f"{op} p50, own client on own server, {pl}", "µs",
       1, "<=", 0.6 if op == "get" else 0.8) for pl in _PL for op in _OPS],
    *[("rt_user", f"{op}@{pl}", "p99_us", f"{op} p99, own client on own server, {pl}", "µs",
       1, "", None) for pl in _PL for op in _OPS],
    *[("rt_server", f"{op}@{pl}", "p50_us", f"{op} p50, torch client on each server, {pl}",
       "µs", 1, "", None) for pl in _PL for op in _OPS],
    *[("rt_server", f"{op}@{pl}", "cpu_s_per_1k",
       f"{op}: server CPU per 1k ops, torch client, {pl}", "ms", 1000, "", None)
      for pl in _PL for op in _OPS],
    *[("rt_client", f"{op}@{pl}", "p50_us", f"{op} p50, each client on our server, {pl}", "µs",
       1, "", None) for pl in _PL for op in _OPS],
    *[("tp", str(n), m, f"set+get, {n} torch clients in 4 processes: {lab}", u, sc, d, t)
      for n in (16, 64) for (m, lab, u, sc, d, t) in (
          ("ops_per_s", "throughput", "ops/s", 1, ">=", 1.3),
          ("cpu_s_per_1k", "server CPU per 1k ops", "ms", 1000, "<=", 0.6),
          ("p50_us", "op latency p50", "µs", 1, "", None),
          ("p99_us", "op latency p99", "µs", 1, "", None))],
    *[("tp_user", str(n), m, f"set+get, {n} own clients on own server, 4 processes: {lab}",
       u, sc, "", None)
      for n in (16, 64) for (m, lab, u, sc) in (
          ("ops_per_s", "throughput", "ops/s", 1),
          ("cpu_s_per_1k", "server CPU per 1k ops", "ms", 1000),
          ("p50_us", "op latency p50", "µs", 1),
          ("p99_us", "op latency p99", "µs", 1))],
    *[("multi_user", str(n), "total_s", f"multi_set+multi_get {n:,} keys, own client+server",
       "ms", 1000, "<=", 0.2 if n == 10_000 else None) for n in (1_000, 10_000, 100_000)],
    *[("multi_user", str(n), "server_cpu_s", f"  same: server CPU per run, {n:,} keys", "ms",
       1000, "", None) for n in (1_000, 10_000, 100_000)],
    *[("multi_server", str(n), "total_s", f"multi_set+multi_get {n:,} keys, torch client",
       "ms", 1000, "", None) for n in (1_000, 10_000)],
    *[("multi_client", str(n), "total_s", f"multi_set+multi_get {n:,} keys, on our server",
       "ms", 1000, "", None) for n in (1_000, 10_000)],
    *[("storm", str(n), m, f"storm {n:,} light clients: {lab}", u, sc, d, t)
      for n in (1024, 8192, 16384) for (m, lab, u, sc, d, t) in (
          ("time_s", "time to all connected+handshaked+ADD", "ms", 1000, "<=",
           1 / 3 if n == 16384 else None),
          ("server_cpu_s", "server CPU", "ms", 1000, "", None),
          ("client_cpu_s", "light clients' CPU (2 cores in all)", "ms", 1000, "", None),
          ("listen_drops", "TcpExt ListenDrops, system-wide (accept queue full)", "", 1, "",
           None),
          ("errors", "refused/reset/unfinished", "", 1, "", None))],
    *[("barrier", str(n), m, f"barrier storm {n:,} clients: {lab}", u, sc, d, t)
      for n in (512, 19_000) for (m, lab, u, sc, d, t) in (
          ("time_s", "time to all connected+ADD+released", "ms", 1000, "", None),
          ("first_time_s", "the same, first storm on a fresh server", "ms", 1000, "", None),
          ("first_listen_drops", "TcpExt ListenDrops in that first storm", "", 1, "", None),
          ("add_s", "time to every ADD answered", "ms", 1000, "", None),
          ("server_cpu_us_per_conn", "server CPU per connection", "µs", 1, "<=", 0.4),
          ("rss_bytes_per_conn", "server RSS per held connection", "B", 1, "", None),
          ("client_cpu_s", "light clients' CPU", "ms", 1000, "", None),
          ("listen_drops", "TcpExt ListenDrops (accept queue full)", "", 1, "", None),
          ("done", "clients released", "", 1, "", None),
          ("errors", "refused/reset/closed/unfinished", "", 1, "", None))],
    ("rss", "idle", "rss_mib", "server RSS with idle connections", "MiB", 1, "", None),
    ("rss", "idle", "delta_mib", "server RSS growth for those connections", "MiB", 1, "", None),
]


def _fmt(v, scale) -> str:
    if v is None:
        return "–"
    if not _num(v):
        return str(v)
    x = v * scale
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def render_table(res: Results, mode: str) -> str:
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    out = [f"Store benchmarks ({mode} sizes). Ratio = fastelastic / torch (torch 2.13.0 libuv "
           "server, torch's client), same run. Latencies: p50/p99 of single operations; "
           "throughput: best round; multi-key and storm times: best run (other load on this "
           "shared 2-core machine only ever adds time; medians are in the JSON extra_info). "
           f"Load average at the end of the run: {load}.", "",
           "| benchmark | unit | fastelastic | torch | ratio | target | met |",
           "|---|---|---:|---:|---:|---|---|"]
    for fam, case, metric, label, unit, scale, direction, target in _ROWS:
        fe = res.get(fam, case, "fastelastic", metric)
        to = res.get(fam, case, "torch", metric)
        if fe is None and to is None:
            continue
        ratio = fe / to if _num(fe) and _num(to) and to else None
        tgt = met = ""
        if target is not None:
            tgt = f"{direction} {target:.2g}"
            if ratio is not None:
                ok = ratio <= target if direction == "<=" else ratio >= target
                met = "yes" if ok else "**no**"
        out.append(f"| {label} | {unit} | {_fmt(fe, scale)} | {_fmt(to, scale)} | "
                   f"{'–' if ratio is None else f'{ratio:.2f}'} | {tgt} | {met} |")
    extra = _extra_lines(res)
    if extra:
        out += [""] + extra
    return "\n".join(out) + "\n"


def _extra_lines(res: Results) -> list[str]:
    lines = []
    for metric, what in (("total_s", "time"), ("server_cpu_s", "server CPU")):
        small = res.get("multi_user", "10000", "fastelastic", metric)
        big = res.get("multi_user", "100000", "fastelastic", metric)
        if _num(small) and _num(big) and small:
            g = big / small
            lines.append(f"- multi_set+multi_get, ours: 100,000 keys take {g:.1f}x the {what} "
                         f"of 10,000 (linear = 10x; met if <= 12.5x: "
                         f"{'yes' if g <= 12.5 else 'NO'}).")
    tb = res.get("multi_user", "100000", "torch", "finished")
    if tb is False:
        lines.append(f"- torch's 100,000-key multi_set+multi_get did not finish within "
                     f"{res.get('multi_user', '100000', 'torch', 'bound_s'):g} s; "
                     "the worker was killed.")
    n16 = res.data.get(("storm", "16384"), {})
    if n16:
        errs = {i: m.get("errors") for i, m in n16.items()}
        lines.append(f"- storm 16,384: refused/reset/unfinished per implementation: {errs} "
                     "(target: none for fastelastic).")
    for n in (512, 19_000):
        cpu = res.get("barrier", str(n), "fastelastic", "server_cpu_us_per_conn")
        rpc = res.get("barrier", str(n), "fastelastic", "rss_bytes_per_conn")
        if _num(cpu) and _num(rpc):
            lines.append(f"- barrier storm {n:,}: projected to 98,304 ranks at the same cost per "
                         f"connection: server CPU {cpu * 98_304 / 1e6:.2f} s, RSS "
                         f"{rpc * 98_304 / 2**20:.0f} MiB (RSS per connection <= 2 KiB: "
                         f"{'yes' if rpc <= 2048 else 'NO'}).")
    rss = res.get("rss", "idle", "fastelastic", "rss_mib")
    if _num(rss):
        n = res.get("rss", "idle", "fastelastic", "conns")
        lines.append(f"- fastelastic server RSS with {n:,} idle connections: {rss:.1f} MiB "
                     f"(target < 64 MiB: {'yes' if rss < 64 else 'NO'}); torch's server process "
                     "RSS includes the torch import.")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _RESULTS.data:
        return
    table = render_table(_RESULTS, size_mode(config))
    terminalreporter.write_sep("-", "store benchmarks: fastelastic vs torch")
    terminalreporter.write(table)
    path = config.getoption("--store-table")
    if path:
        with open(path, "w") as f:
            f.write(table)
        terminalreporter.write_line(f"table written to {path}")
        # The same figures for benchmarks/plot.py, beside the table (store.md -> store.json).
        rows = [{"family": fam, "case": case, "impl": impl, **m}
                for (fam, case), impls in _RESULTS.data.items() for impl, m in impls.items()]
        jpath = os.path.splitext(path)[0] + ".json"
        sb.write_results_json(jpath, "store", {"size": size_mode(config), "results": rows})
        terminalreporter.write_line(f"figures written to {jpath}")
