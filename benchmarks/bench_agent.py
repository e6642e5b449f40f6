"""Agent benchmarks, fastelastic vs torch's LocalElasticAgent in the same run.

Measured: worker exit -> agent sees it; worker exit -> replacement worker running; SIGTERM to
the agent -> every worker gone; slow-path rank assignment for 1,024 and 4,096 simulated agents;
the agent's own CPU while idle-monitoring 64 workers.

Run: ``python3 -m pytest benchmarks/bench_agent.py -q -s`` (add ``--benchmark-disable`` for a
smoke run); ``FE_AGENT_JSON=benchmarks/results/agent.json`` also writes the figures there (read
by ``plot.py``). Also runnable as ``python3 bench_agent.py --agent IMPL JSON`` (one agent process,
used by the SIGTERM and idle-CPU benchmarks).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import types

import pytest

from _storebench import cpu_seconds_precise

HERE = os.path.dirname(os.path.abspath(__file__))
IMPLS = ["fastelastic", "torch"]

# Worker used by the restart benchmark: logs its start, lives a pseudo-random 20-70 ms (so exits
# fall at random phases of torch's polling period), logs its exit, then fails; the last attempt
# succeeds.
RESTART_WORKER = r"""
import os, sys, time
log = sys.argv[1]
count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(log, "a") as f:
    f.write(f"start {count} {time.monotonic_ns()}\n")
if count >= int(os.environ["TORCHELASTIC_MAX_RESTARTS"]):
    sys.exit(0)
time.sleep(0.020 + ((count * 7919) % 50) / 1000.0)
with open(log, "a") as f:
    f.write(f"exit {count} {time.monotonic_ns()}\n")
os._exit(1)
"""

SLEEP_WORKER = r"""
import os, sys, time
path = os.path.join(sys.argv[1], "pid" + os.environ["LOCAL_RANK"])
with open(path + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(path + ".tmp", path)  # readers never see a partial file
time.sleep(float(sys.argv[2]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summary(values_ms: list[float]) -> dict:
    return {
        "n": len(values_ms),
        "p50_ms": round(pct(values_ms, 50), 3),
        "p90_ms": round(pct(values_ms, 90), 3),
        "p99_ms": round(pct(values_ms, 99), 3),
        "max_ms": round(max(values_ms), 3),
        "mean_ms": round(statistics.fmean(values_ms), 3),
    }


_RESULTS: dict[tuple[str, str], dict] = {}


@pytest.fixture(scope="module", autouse=True)
def _write_json():
    yield
    path = os.environ.get("FE_AGENT_JSON")
    if path and _RESULTS:
        from _storebench import write_results_json

        rows = [{"op": op, "impl": impl, **stats} for (op, impl), stats in _RESULTS.items()]
        write_results_json(path, "agent", {"results": rows})


def record(benchmark, op: str, impl: str, stats: dict) -> None:
    benchmark.extra_info.update({f"{op} | {k}": v for k, v in stats.items()})
    _RESULTS[(op, impl)] = stats
    if impl == "torch" and (op, "fastelastic") in _RESULTS:
        ours, theirs = _RESULTS[(op, "fastelastic")], stats
        key = "p50_ms" if "p50_ms" in ours else next(iter(ours))
        if ours.get(key):
            benchmark.extra_info[f"{op} | torch/fastelastic {key}"] = round(
                theirs[key] / ours[key], 2
            )
    print(f"\n[{op}] {impl}: {stats}")


# ----------------------------------------------------------------------------- agent factories


def make_agent(
    impl: str,
    *,
    entrypoint: str,
    args: tuple,
    nproc: int,
    max_restarts: int,
    backend: str,
    port: int,
    log_dir: str,
    on_monitor=None,
):
    """Builds a LocalElasticAgent of ``impl`` on a single-node rendezvous."""
    if impl == "fastelastic":
        from fastelastic.agent.server import WorkerSpec
        from fastelastic.agent.server.local_elastic_agent import LocalElasticAgent
        from fastelastic.multiprocessing import DefaultLogsSpecs
        from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler
    else:
        from torch.distributed.elastic.agent.server import WorkerSpec
        from torch.distributed.elastic.agent.server.local_elastic_agent import (
            LocalElasticAgent,
        )
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
        from torch.distributed.elastic.rendezvous import RendezvousParameters
        from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler
    conf = {"rank": 0} if backend == "static" else {"is_host": True, "last_call_timeout": 1}
    handler = get_rendezvous_handler(
        RendezvousParameters(
            backend=backend,
            endpoint=f"127.0.0.1:{port}",
            run_id=f"bench{port}",
            min_nodes=1,
            max_nodes=1,
            **conf,
        )
    )
    spec = WorkerSpec(
        role="bench",
        local_world_size=nproc,
        rdzv_handler=handler,
        entrypoint=entrypoint,
        args=args,
        max_restarts=max_restarts,
        monitor_interval=0.1,
    )

    class Timed(LocalElasticAgent):  # type: ignore[misc, valid-type]
        def _monitor_workers(self, worker_group):
            result = super()._monitor_workers(worker_group)
            if on_monitor is not None and result.state.value == "FAILED":
                on_monitor(time.monotonic_ns(), result.state.value)
            return result

    agent = Timed(spec, DefaultLogsSpecs(log_dir=log_dir), exit_barrier_timeout=5)
    return agent, handler


def _agent_process(impl: str, cfg: dict) -> None:
    """Body of ``--agent``: one agent with ``cfg['nproc']`` sleeping python workers."""
    agent, handler = make_agent(
        impl,
        entrypoint=cfg.get("entrypoint", sys.executable),
        args=tuple(cfg["args"]),
        nproc=cfg["nproc"],
        max_restarts=0,
        backend=cfg.get("backend", "static"),
        port=cfg["port"],
        log_dir=cfg["log_dir"],
    )
    try:
        agent.run()
    finally:
        handler.shutdown()


# ----------------------------------------------------------------------------- benchmarks


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    for name in (
        "TORCH_ELASTIC_WORKER_IDENTICAL",
        "FASTELASTIC_WORKER_IDENTICAL",
        "TORCHELASTIC_HEALTH_CHECK_PORT",
        "TORCHELASTIC_ENABLE_FILE_TIMER",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
def test_worker_exit_detection_and_replacement(benchmark, impl, tmp_path):
    """One worker failing 40 times: exit -> agent sees it, and exit -> replacement running."""
    if impl == "torch":
        pytest.importorskip("torch", reason="!!! torch 2.13 is needed for the comparison")
    restarts = 40
    log = tmp_path / "events.log"
    detected: list[int] = []
    script = tmp_path / "worker.py"
    script.write_text(RESTART_WORKER)

    def run():
        agent, handler = make_agent(
            impl,
            entrypoint=sys.executable,
            args=("-I", "-S", str(script), str(log)),
            nproc=1,
            max_restarts=restarts,
            backend="c10d",
            port=free_port(),
            log_dir=str(tmp_path / "logs"),
            on_monitor=lambda t, state: detected.append(t),
        )
        try:
            result = agent.run()
        finally:
            handler.shutdown()
        assert result.state.value == "SUCCEEDED", result

    benchmark.pedantic(run, rounds=1, iterations=1)
    starts, exits = {}, {}
    for line in log.read_text().split("\n"):
        if line:
            kind, count, t = line.split()
            (starts if kind == "start" else exits)[int(count)] = int(t)
    assert len(exits) == restarts and len(detected) == restarts
    detect = [(detected[i] - exits[i]) / 1e6 for i in range(restarts)]
    replace = [(starts[i + 1] - exits[i]) / 1e6 for i in range(restarts)]
    record(benchmark, "exit->detected", impl, summary(detect))
    record(benchmark, "exit->replacement running", impl, summary(replace))


def _pid_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def _start_agent_proc(impl: str, tmp, nproc: int, sleep_s: float, backend: str = "static"):
    piddir = tmp / f"pids{time.monotonic_ns()}"
    piddir.mkdir()
    script = tmp / "sleep_worker.py"
    script.write_text(SLEEP_WORKER)
    cfg = {
        "backend": backend,
        "port": free_port(),
        "nproc": nproc,
        "log_dir": str(tmp / "logs"),
        "args": ["-I", "-S", str(script), str(piddir), str(sleep_s)],
    }
    proc = subprocess.Popen(
        [sys.executable, __file__, "--agent", impl, json.dumps(cfg)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while len([n for n in os.listdir(piddir) if not n.endswith(".tmp")]) < nproc and (
        time.monotonic() < deadline
    ):
        time.sleep(0.01)
    pids = [int((piddir / f"pid{i}").read_text()) for i in range(nproc)]
    return proc, pids


@pytest.mark.timeout(600)
@pytest.mark.parametrize("impl", IMPLS)
def test_sigterm_to_agent_until_workers_gone(benchmark, impl, tmp_path):
    """SIGTERM to an agent running 8 workers -> the last worker is gone."""
    if impl == "torch":
        pytest.importorskip("torch", reason="!!! torch 2.13 is needed for the comparison")
    samples: list[float] = []

    def setup():
        proc, pids = _start_agent_proc(impl, tmp_path, 8, 60)
        return (proc, pids), {}

    def stop(proc, pids):
        t0 = time.monotonic_ns()
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        while not all(_pid_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.0002)
        samples.append((time.monotonic_ns() - t0) / 1e6)
        proc.wait(60)
        assert all(_pid_gone(p) for p in pids)

    benchmark.pedantic(stop, setup=setup, rounds=8, iterations=1)
    record(benchmark, "SIGTERM->workers gone", impl, summary(samples))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("backend", ["static", "c10d"])
@pytest.mark.parametrize("impl", IMPLS)
def test_idle_cpu_monitoring_64_workers(benchmark, impl, backend, tmp_path):
    """The agent process's own CPU (not its workers') over 5 s of monitoring 64 idle workers."""
    if impl == "torch":
        pytest.importorskip("torch", reason="!!! torch 2.13 is needed for the comparison")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    out = {}

    def measure():
        proc, _pids = _start_agent_proc(impl, tmp_path, 64, 60, backend)
        try:
            time.sleep(1.0)  # let start-up settle; this is the quantity measured, not a sync
            c0, t0 = cpu_seconds_precise(proc.pid), time.monotonic()
            time.sleep(10.0)
            c1, t1 = cpu_seconds_precise(proc.pid), time.monotonic()
            out["cpu_pct"] = round(100 * (c1 - c0) / (t1 - t0), 4)
            out["agent_threads"] = len(os.listdir(f"/proc/{proc.pid}/task"))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)

    benchmark.pedantic(measure, rounds=1, iterations=1)
    record(benchmark, f"idle CPU, 64 workers, {backend} rdzv (% of a core)", impl, out)


def _store_pair(impl: str):
    if impl == "torch":
        from torch.distributed import PrefixStore, TCPStore
    else:  # fastelastic, and the harness floor (on our store)
        from fastelastic.store import PrefixStore, TCPStore
    from datetime import timedelta

    server = TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    return server, TCPStore, PrefixStore


class _SetStamp:
    """Store proxy remembering when this agent's ``set`` (its join) returned."""

    def __init__(self, store):
        self._store = store
        self.set_done = 0

    def set(self, key, value):
        self._store.set(key, value)
        self.set_done = time.monotonic_ns()

    def __getattr__(self, name):
        return getattr(self._store, name)


def _harness_floor(store, i, nodes, spec):
    """The harness with no rank computation: one set each, agent 0 waits for all and releases
    everyone with one set, one get each. Same threads, connections and wake-ups as the real
    thing, so what the real runs take beyond this is the rank assignment itself."""
    store.set(f"floor/{i}", b"x")
    if i == 0:
        store.multi_get([f"floor/{k}" for k in range(nodes)])
        store.set("floor/release", b"1")
    store.get("floor/release")
    return [types.SimpleNamespace(world_size=-2)]


def _rank_sim_process(impl, port, host, hosts, count, nodes, prefix, ready, go, out):
    """One simulated host: ``count`` agents (one thread and one connection each), group ranks
    ``host, host + hosts, ...``: dealt round-robin, so that the release (agent 0's multi_set
    in rank order) wakes every host process at once instead of one process's 512 threads after
    another, each convoy queueing on that process's GIL while the other CPU idles."""
    if impl == "torch":
        from torch.distributed import PrefixStore, TCPStore
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    else:
        from fastelastic.agent.server.api import SimpleElasticAgent
        from fastelastic.store import PrefixStore, TCPStore
    from datetime import timedelta

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    threading.stack_size(256 * 1024)
    stores = [
        _SetStamp(
            PrefixStore(
                prefix,
                TCPStore(
                    "127.0.0.1",
                    port,
                    is_master=False,
                    wait_for_workers=False,
                    timeout=timedelta(seconds=120),
                ),
            )
        )
        for _ in range(count)
    ]
    results: list = [None] * count
    done_ns = [0] * count  # when each agent held its ranks (thread teardown is not timed)

    def agent(j):
        i = host + j * hosts
        spec = types.SimpleNamespace(
            role=("trainer", "ps", "eval")[i % 3], local_world_size=1 + i % 4
        )
        go.wait(120)
        if impl == "harness":
            results[j] = _harness_floor(stores[j], i, nodes, spec)
        else:
            results[j] = SimpleElasticAgent._assign_worker_ranks(None, stores[j], i, nodes, spec)
        done_ns[j] = time.monotonic_ns()

    threads = [threading.Thread(target=agent, args=(j,)) for j in range(count)]
    for t in threads:
        t.start()
    ready.release()
    for t in threads:
        t.join(120)
    ok = all(r is not None for r in results)
    last_join = max(s.set_done for s in stores)
    out.put((max(done_ns), ok, results[-1][0].world_size if ok else -1, last_join))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("nodes", [1024, 4096])
@pytest.mark.parametrize("impl", [*IMPLS, "harness"])
def test_slow_path_rank_assignment(benchmark, impl, nodes):
    """N simulated agents (8 host processes, one thread + connection per agent), mixed roles.

    ``harness``: the same simulated hosts on our store doing no rank assignment (see
    ``_harness_floor``): the floor this harness puts under both implementations' figures.
    """
    import multiprocessing as mp

    if impl == "torch":
        pytest.importorskip("torch", reason="!!! torch 2.13 is needed for the comparison")
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    server, _, _ = _store_pair(impl)
    ctx = mp.get_context("fork")
    hosts = 8
    per_host = nodes // hosts
    expected_world = -2 if impl == "harness" else sum(1 + i % 4 for i in range(nodes))
    samples: list[float] = []
    after_join: list[float] = []

    def setup():
        prefix = f"round{time.monotonic_ns()}"
        ready, go, out = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
        procs = [
            ctx.Process(
                target=_rank_sim_process,
                args=(impl, server.port, h, hosts, per_host, nodes, prefix, ready, go, out),
            )
            for h in range(hosts)
        ]
        for p in procs:
            p.start()
        for _ in procs:
            assert ready.acquire(timeout=120), "a simulated host did not start"
        return (procs, go, out), {}

    def run(procs, go, out):
        t0 = time.monotonic_ns()
        go.set()
        ends = [out.get(timeout=120) for _ in procs]
        samples.append((max(e[0] for e in ends) - t0) / 1e6)
        after_join.append((max(e[0] for e in ends) - max(e[3] for e in ends)) / 1e6)
        for p in procs:
            p.join(60)
        assert all(e[1] and e[2] == expected_world for e in ends), ends

    benchmark.pedantic(run, setup=setup, rounds=7, iterations=1)
    record(benchmark, f"slow-path ranks, {nodes} agents", impl, summary(samples))
    # The release itself wakes N threads on 2 cores; this part starts once the last agent
    # has published its role info (its ``set`` returned).
    record(benchmark, f"slow-path ranks after last join, {nodes} agents", impl, summary(after_join))


if __name__ == "__main__" and len(sys.argv) >= 4 and sys.argv[1] == "--agent":
    _agent_process(sys.argv[2], json.loads(sys.argv[3]))
