"""Store benchmarks: fastelastic's server and client against torch 2.13's, in the same run.

Every server runs in its own process, so its CPU (``/proc/PID/stat``; the ns-resolution
schedstat sum where a phase is too short for 10 ms ticks) and RSS can be read. Families:

* ``rt_user``: one client, one op at a time: our client on our server vs torch's client on
  torch's server (what a user sees; the issue's latency targets).
* ``rt_server``: torch's client on each server (same client, servers compared; server CPU).
* ``rt_client``: each client on our server (same server, clients compared).

  The three ``rt_*`` families are interleaved A/B runs: both sides' clients and servers are
  alive at once and rounds of 100 operations alternate between them, so a change in the VM's
  CPU idle states or other load hits both sides alike; p50/p99 are over each side's pooled
  samples. Each runs in two placements, every thread of the client and of both servers pinned:
  ``1cpu`` (client and server share CPU 0) and ``2cpu`` (client on CPU 0, server on CPU 1).
  Left to the scheduler, a pair lands in one or the other at random, and a round trip here
  costs ~15 µs in the first and ~57 µs in the second (waking an idle vCPU), which swamped
  every difference between the implementations.
* ``tp``: set+get throughput of 16 and 64 torch clients in 4 processes, on each server.
* ``tp_user``: the same with each implementation's own client on its own server.
* ``multi_*``: multi_set then multi_get of 10,000 and 100,000 keys with 64-byte values.
* ``storm``: N light raw clients (``stormclient.c``, in 1-2 processes) connect, handshake and
  ADD at once.
* ``rss``: server RSS holding 10,000 idle connections (a fresh server per implementation).
* ``barrier``: 19,000 light clients (the most one process can hold here: RLIMIT_NOFILE's hard
  limit is 20,000) connect at once with no pacing, handshake, ADD, then WAIT on one barrier key
  that the last arrival sets (a fresh server per implementation); server CPU and RSS per
  connection, for the projection to 98,304 ranks in BENCHMARKS.md.

Run: ``python -m pytest benchmarks/bench_store.py --benchmark-only -q`` (about 5 minutes);
smoke: ``python -m pytest benchmarks/bench_store.py --benchmark-disable -q`` (small sizes).
"""

from __future__ import annotations

import contextlib
import os
import statistics
import time

import pytest

import _storebench as sb

IMPLS = ["fastelastic", "torch"]
OPS = ["set", "get", "add", "compare_set"]
TP_PROCS = 4

pytest.importorskip("torch", reason="!!! torch 2.13 is needed: every benchmark here compares "
                                    "fastelastic against torch's TCPStore")


def _make_op(client, op: str):
    key = f"rt/{op}"
    if op == "set":
        return lambda: client.set(key, sb.VALUE64)
    if op == "get":
        client.set(key, sb.VALUE64)
        return lambda: client.get(key)
    if op == "add":
        return lambda: client.add(key, 1)
    client.set(key, "a")
    return lambda: client.compare_set(key, "a", "a")


def _check_op(client, op: str, calls: int) -> None:
    """The benchmarked operation really did its work (read back through the same client)."""
    key = f"rt/{op}"
    if op in ("set", "get"):
        assert bytes(client.get(key)) == sb.VALUE64.encode()
    elif op == "add":
        assert client.add(key, 0) >= calls  # the key is shared by the runs in one session
    else:
        assert bytes(client.compare_set(key, "a", "a")) == b"a"


def _lat_metrics(lat_ns: list[int]) -> dict:
    return {"p50_us": sb.pct(lat_ns, 50) / 1e3, "p99_us": sb.pct(lat_ns, 99) / 1e3,
            "mean_us": statistics.fmean(lat_ns) / 1e3, "samples": len(lat_ns)}


RT_CHUNK = 100  # operations per side per interleaved round


class _Side:
    """One side of an interleaved round-trip comparison: a client on a server, its samples."""

    def __init__(self, server: sb.ServerProc, client_kind: str, op: str) -> None:
        self.server = server
        self.client = sb.make_client(client_kind, server.port)
        self.op = op
        self.fn = _make_op(self.client, op)
        self.lat: list[int] = []
        self.cpu = self.cpu_stat = 0.0
        self.calls = 0

    def chunk(self, n: int, keep: bool) -> None:
        """n timed operations; with keep, their latencies and the server's CPU are recorded."""
        fn, clock = self.fn, time.perf_counter_ns
        lat = [0] * n
        cpu0, cpus0 = self.server.cpu_precise(), self.server.cpu()
        for i in range(n):
            t = clock()
            fn()
            lat[i] = clock() - t
        if self.op == "set":
            # fire-and-forget: let the server catch up, so neither its CPU nor its backlog
            # spills into the other side's next chunk (one extra round trip per chunk)
            self.client.add("rt/sync", 1)
        self.calls += n
        if keep:
            self.lat.extend(lat)
            self.cpu += self.server.cpu_precise() - cpu0
            self.cpu_stat += self.server.cpu() - cpus0

    def metrics(self) -> dict:
        _check_op(self.client, self.op, self.calls)
        ops = len(self.lat)
        return {**_lat_metrics(self.lat), "cpu_s_per_1k": self.cpu / ops * 1000,
                "cpu_stat_s": self.cpu_stat, "cpu_precise_s": self.cpu, "ops": ops,
                "interleaved_chunk": RT_CHUNK}


PLACEMENTS = ["1cpu", "2cpu"]


def _pin(pid: int, cpus: set[int]) -> None:
    """Pins every thread of pid (a store server's loop runs in a thread of its own)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass  # a thread that just ended


@contextlib.contextmanager
def _placed(placement: str, server_pids: list[int]):
    """This process (the clients) on CPU 0; the servers on CPU 0 (1cpu) or CPU 1 (2cpu)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip(f"placement {placement} needs 2 CPUs, this process may use {cpus}")
    client, server = {cpus[0]}, {cpus[0] if placement == "1cpu" else cpus[1]}
    _pin(os.getpid(), client)
    for pid in server_pids:
        _pin(pid, server)
    try:
        yield
    finally:
        for pid in [os.getpid(), *server_pids]:
            _pin(pid, set(cpus))


def _roundtrip(benchmark, sizes, setups: dict, op: str, family: str, results,
               placement: str) -> None:
    """Interleaved A/B: both clients and servers alive at once; rounds of RT_CHUNK operations
    alternate between the two sides (the side going first alternates too), so both see the same
    machine state (CPU idle states, other load); p50/p99 over each side's pooled samples."""
    pids = sorted({server.pid for server, _ in setups.values()})
    with _placed(placement, pids):
        _roundtrip_placed(benchmark, sizes, setups, op, f"{op}@{placement}", family, results)


def _roundtrip_placed(benchmark, sizes, setups: dict, op: str, case: str, family: str,
                      results) -> None:
    sides = {impl: _Side(server, kind, op) for impl, (server, kind) in setups.items()}
    chunk = min(RT_CHUNK, sizes["rt_rounds"])
    order = [list(IMPLS)]
    state = {"keep": False}

    def one_round() -> None:
        for impl in order[0]:
            sides[impl].chunk(chunk, state["keep"])
        order[0].reverse()

    for _ in range(max(1, sizes["rt_warmup"] // chunk)):
        one_round()
    state["keep"] = True
    benchmark.pedantic(one_round, rounds=max(1, sizes["rt_rounds"] // chunk), iterations=1)
    for impl, side in sides.items():
        info = benchmark.extra_info.setdefault(impl, {})
        results.add(family, case, impl, side.metrics(), info)


# family -> ((server, client) of the fastelastic side, (server, client) of the torch side)
RT_FAMILIES = {
    # own client on own server: the latency a user of each store sees
    "rt_user": (("fastelastic", "fastelastic"), ("torch", "torch")),
    # torch's client on each server: the servers compared, with the server's CPU per op
    "rt_server": (("fastelastic", "torch"), ("torch", "torch")),
    # each client on our server: the clients compared (ours gets in one round trip)
    "rt_client": (("fastelastic", "fastelastic"), ("fastelastic", "torch")),
}


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("family", list(RT_FAMILIES))
def test_rt(benchmark, sizes, servers, results, family, op, placement):
    """One op at a time, interleaved A/B, in one placement (see the module docstring)."""
    setups = {impl: (servers[server], client)
              for impl, (server, client) in zip(IMPLS, RT_FAMILIES[family], strict=True)}
    _roundtrip(benchmark, sizes, setups, op, family, results, placement)


# ------------------------------------------------------------------------------ throughput

@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clients", [16, 64])
def test_tp(benchmark, sizes, servers, pool, results, clients, impl):
    """Aggregate set+get throughput of torch clients spread over 4 processes, per server."""
    _throughput(benchmark, sizes, servers[impl], pool, results, clients, "torch", "tp", impl)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("clients", [16, 64])
def test_tp_user(benchmark, sizes, servers, pool, results, clients, impl):
    """The same with each implementation's own client (ours gets in one round trip)."""
    _throughput(benchmark, sizes, servers[impl], pool, results, clients, impl, "tp_user", impl)


def _throughput(benchmark, sizes, server, pool, results, clients, client_kind, family, impl):
    workers = pool.get(TP_PROCS)
    for i, w in enumerate(workers):
        w.send({"op": "tp_connect", "port": server.port, "threads": clients // TP_PROCS,
                "client": client_kind, "prefix": f"{family}{clients}/{i}"})
    for w in workers:
        w.recv(300)
    pairs = sizes["tp_pairs"][clients]
    rounds: list[tuple[float, list[int]]] = []

    def one_round() -> None:
        for w in workers:
            w.send({"op": "tp_run", "pairs": pairs})
        replies = [w.recv(300) for w in workers]
        wall = max(r["t1"] for r in replies) - min(r["t0"] for r in replies)
        rounds.append((wall, [x for r in replies for x in r["lat_ns"]]))

    try:
        one_round()  # warm-up: connections, server maps
        rounds.clear()
        cpu0, cpus0 = server.cpu_precise(), server.cpu()
        benchmark.pedantic(one_round, rounds=sizes["tp_rounds"], iterations=1)
        cpu, cpus = server.cpu_precise() - cpu0, server.cpu() - cpus0
    finally:
        for w in workers:
            w.send({"op": "tp_close"})
        for w in workers:
            w.recv(60)
    ops = 2 * pairs * clients * len(rounds)
    lat = [x for _, l in rounds for x in l]
    m = {**_lat_metrics(lat),
         # best round: the machine is shared, and other load only ever slows a round down
         "ops_per_s": max(2 * pairs * clients / w for w, _ in rounds),
         "ops_per_s_median": statistics.median(2 * pairs * clients / w for w, _ in rounds),
         "cpu_s_per_1k": cpu / ops * 1000, "cpu_stat_s_per_1k": cpus / ops * 1000,
         "clients": clients, "processes": TP_PROCS, "ops": ops}
    results.add(family, str(clients), impl, m, benchmark.extra_info)


# ------------------------------------------------------------------------------ multi-key

def _multi(benchmark, sizes, pool, servers, server_impl, client_kind, n, rounds, family, impl,
           results):
    server = servers[server_impl]
    bound = sizes["multi_bound_s"]
    out: list[dict] = []
    state = {"finished": True}

    def one_round() -> None:
        if not state["finished"]:
            return
        w = pool.get(1)[0]
        try:
            out.append(w.call({"op": "multi", "port": server.port, "client": client_kind,
                               "n": n, "rounds": 1, "prefix": f"{family}"}, bound))
        except TimeoutError:
            pool.discard(w)  # it is stuck inside the store call; ending it is the only bound
            state["finished"] = False
            state["cpu"] = server.cpu_precise() - cpu0

    cpu0 = server.cpu_precise()
    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    cpu = state.get("cpu", server.cpu_precise() - cpu0)
    if not state["finished"]:
        # The server may go on working on the abandoned request for minutes, which would slow
        # every later benchmark (of both implementations) down: replace it.
        servers.restart(server_impl)
    if not out:
        m = {"finished": False, "bound_s": bound, "total_s": None, "keys": n}
    else:
        sets = [s for r in out for s in r["set_s"]]
        gets = [g for r in out for g in r["get_s"]]
        tot = [s + g for s, g in zip(sets, gets, strict=True)]
        best = min(range(len(tot)), key=tot.__getitem__)
        m = {"total_s": tot[best], "total_median_s": statistics.median(tot),
             "total_max_s": max(tot), "set_s": sets[best], "get_s": gets[best],
             "finished": state["finished"], "bound_s": bound, "keys": n, "runs": len(tot),
             "server_cpu_s": cpu / (len(tot) + (0 if state["finished"] else 1))}
    results.add(family, str(n), impl, m, benchmark.extra_info)
    return m


@pytest.mark.timeout(900)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", ["small", "large"])
def test_multi_user(benchmark, sizes, servers, pool, results, n, impl):
    """multi_set then multi_get, own client on own server (torch's run bounded in time)."""
    keys = sizes["multi_n"][0 if n == "small" else 1]
    rounds = (sizes["multi_rounds"] if impl == "fastelastic" else sizes["multi_torch_rounds"])
    _multi(benchmark, sizes, pool, servers, impl, impl, keys, rounds[keys], "multi_user", impl,
           results)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
def test_multi_server(benchmark, sizes, servers, pool, results, impl):
    """multi_set then multi_get with torch's client on each server."""
    keys = sizes["multi_n"][0]
    _multi(benchmark, sizes, pool, servers, impl, "torch", keys,
           sizes["multi_torch_rounds"][keys], "multi_server", impl, results)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
def test_multi_client(benchmark, sizes, servers, pool, results, impl):
    """multi_set then multi_get with each client on our server."""
    keys = sizes["multi_n"][0]
    _multi(benchmark, sizes, pool, servers, "fastelastic", impl, keys,
           sizes["multi_torch_rounds"][keys], "multi_client", impl, results)


# ------------------------------------------------------------------------------ storm

def _storm_procs(n: int) -> int:
    return 1 if n <= 1024 else 2


# how a storm client's connection can fail (each is counted; with "done" they add up to all)
_FAILURES = ("refused", "reset", "closed", "bad_reply", "other", "unfinished")


def _storm_round(server: sb.ServerProc, live: list[sb.StormClient]) -> tuple[dict, list[dict]]:
    """Lets the storm clients go and waits for all their replies.

    Returns the round's figures (wall time from the first client's start to the last one's end,
    server and client CPU, listen drops, ``done`` and each of ``_FAILURES`` summed over the
    clients) and the clients' own replies.
    """
    drops = sb.listen_drops()
    cpu0 = server.cpu_precise()
    ccpu0 = sum(sb.cpu_seconds_precise(c.proc.pid) for c in live)
    for c in live:
        c.tell("go")
    rs = [c.line(300) for c in live]
    # All replies are in, so the server has done all the work of this storm.
    cpu = server.cpu_precise() - cpu0
    ccpu = sum(sb.cpu_seconds_precise(c.proc.pid) for c in live) - ccpu0
    run = {"time_s": max(r["t1"] for r in rs) - min(r["t0"] for r in rs),
           "server_cpu_s": cpu, "client_cpu_s": ccpu,
           "listen_drops": sb.listen_drops() - drops,
           **{k: sum(r[k] for r in rs) for k in ("done", *_FAILURES)}}
    return run, rs


def _errors(runs: list[dict]) -> int:
    return sum(r[k] for r in runs for k in _FAILURES)


def _assert_all_counted(runs: list[dict], clients: int) -> None:
    for r in runs:  # every client is accounted for: done, or failed in a counted way
        assert r["done"] + _errors([r]) == clients, r


@pytest.mark.timeout(900)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("n", [1024, 8192, 16384])
def test_storm(benchmark, sizes, servers, results, n, impl):
    """Time until n light clients have connected, handshaked and done one ADD."""
    if n not in sizes["storm_n"]:
        pytest.skip(f"storm of {n} clients runs only with full sizes (FE_BENCH_SIZE=full)")
    server = servers[impl]
    base_fds = server.nfds()
    procs = _storm_procs(n)
    live: list[sb.StormClient] = []
    runs: list[dict] = []

    def finish_live() -> None:
        for c in live:
            c.finish()
        live.clear()
        left = server.wait_fds_at_most(base_fds + 2, 60)
        assert left <= base_fds + 2, f"{impl} server still holds {left - base_fds} connections"

    def setup():
        finish_live()
        live.extend(sb.StormClient(server.port, n // procs, f"/storm{n}") for _ in range(procs))
        for c in live:
            c.line(120)

    def storm() -> None:
        runs.append(_storm_round(server, live)[0])

    try:
        benchmark.pedantic(storm, setup=setup, rounds=sizes["storm_rounds"][n], iterations=1)
    finally:
        finish_live()
    errors = _errors(runs)
    m = {"time_s": min(r["time_s"] for r in runs),
         "time_median_s": statistics.median(r["time_s"] for r in runs),
         "time_max_s": max(r["time_s"] for r in runs),
         "server_cpu_s": statistics.median(r["server_cpu_s"] for r in runs),
         "client_cpu_s": statistics.median(r["client_cpu_s"] for r in runs),
         "errors": errors, "refused": sum(r["refused"] for r in runs),
         "reset": sum(r["reset"] for r in runs),
         "unfinished": sum(r["unfinished"] for r in runs),
         "listen_drops": sum(r["listen_drops"] for r in runs),
         "clients": n, "client_processes": procs, "runs": len(runs)}
    results.add("storm", str(n), impl, m, benchmark.extra_info)
    _assert_all_counted(runs, n // procs * procs)


# ------------------------------------------------------------------------------ memory

@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
def test_rss_idle(benchmark, sizes, results, impl):
    """RSS of a fresh server process while it holds 10,000 idle (handshaked) connections."""
    n = sizes["rss_conns"]
    server = sb.ServerProc(impl)
    live: list[sb.StormClient] = []
    state: dict = {}
    try:
        base_rss, base_fds = server.rss(), server.nfds()

        def setup():
            live.extend(sb.StormClient(server.port, n // 2, "/rss") for _ in range(2))
            for c in live:
                c.line(120)

        def hold() -> None:
            for c in live:
                c.tell("go")
            rs = [c.line(300) for c in live]
            state["done"] = sum(r["done"] for r in rs)
            state["fds"] = server.nfds() - base_fds
            state["rss"] = server.rss()

        benchmark.pedantic(hold, setup=setup, rounds=1, iterations=1)
    finally:
        for c in live:
            c.finish()
        server.stop()
    assert state["done"] == n, f"only {state['done']} of {n} connections completed"
    m = {"rss_mib": state["rss"] / 2**20, "delta_mib": (state["rss"] - base_rss) / 2**20,
         "base_rss_mib": base_rss / 2**20, "bytes_per_conn": (state["rss"] - base_rss) / n,
         "conns": n, "server_fds_held": state["fds"]}
    results.add("rss", "idle", impl, m, benchmark.extra_info)


# ------------------------------------------------------------------------------ barrier storm

@pytest.mark.timeout(900)
@pytest.mark.parametrize("impl", IMPLS)
def test_storm_barrier(benchmark, sizes, results, impl):
    """n clients at once: connect, handshake, ADD, WAIT on one barrier key, all released."""
    n, procs = sizes["barrier_n"], 2
    server = sb.ServerProc(impl)
    live: list[sb.StormClient] = []
    runs: list[dict] = []
    state = {"round": 0}
    os.environ["STORM_LIMIT_S"] = "60"   # torch's server may never release the barrier
    try:
        base_rss, base_fds = server.rss(), server.nfds()

        def setup():
            for c in live:
                c.finish()
            live.clear()
            server.wait_fds_at_most(base_fds + 2, 60)
            state["round"] += 1
            r = state["round"]
            live.extend(sb.StormClient(server.port, n // procs, f"/arrive{r}",
                                       (f"/barrier{r}", n // procs * procs))
                        for _ in range(procs))
            for c in live:
                c.line(120)

        def storm() -> None:
            run, rs = _storm_round(server, live)
            rss = server.rss()   # every connection is still open, each waited once
            t0 = min(r["t0"] for r in rs)
            runs.append({**run, "add_s": max(r["t_add"] for r in rs) - t0,
                         "rss_per_conn": (rss - base_rss) / n})

        benchmark.pedantic(storm, setup=setup, rounds=sizes["barrier_rounds"], iterations=1)
    finally:
        os.environ.pop("STORM_LIMIT_S", None)
        for c in live:
            c.finish()
        server.stop()
    best = min(runs, key=lambda r: r["time_s"])
    m = {"time_s": best["time_s"], "add_s": best["add_s"],
         # a job's store is fresh when its ranks first connect: the storm that matters most
         "first_time_s": runs[0]["time_s"], "first_listen_drops": runs[0]["listen_drops"],
         "time_median_s": statistics.median(r["time_s"] for r in runs),
         "server_cpu_s": statistics.median(r["server_cpu_s"] for r in runs),
         "server_cpu_us_per_conn": statistics.median(r["server_cpu_s"] for r in runs) / n * 1e6,
         "client_cpu_s": statistics.median(r["client_cpu_s"] for r in runs),
         "rss_bytes_per_conn": statistics.median(r["rss_per_conn"] for r in runs),
         "done": min(r["done"] for r in runs),
         "errors": _errors(runs),
         "listen_drops": sum(r["listen_drops"] for r in runs), "clients": n, "runs": len(runs)}
    results.add("barrier", str(n), impl, m, benchmark.extra_info)
    _assert_all_counted(runs, n // procs * procs)
    if impl == "fastelastic":
        assert m["errors"] == 0 and m["done"] == n, m
