"""Rendezvous formation time for N nodes (threads in 8 processes): fastelastic vs torch c10d.

Each round: the store is hosted in this process; 8 node processes connect N clients and build
N handlers (min = max = N, last call ~0), report READY, then all start on one GO. A node's
finish time is its CLOCK_MONOTONIC stamp (system-wide on Linux, so comparable across
processes); the round's time is the last finish minus GO. Store messages per node are counted
by a proxy around each node's store (for torch: around its rendezvous backend's store).

Run: ``python -m pytest benchmarks/bench_rendezvous.py --benchmark-only -s``.
Writes the table to ``benchmarks/results/rendezvous.md``.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests" / "rendezvous"))

PROCS = 8
NS = [8, 64, 128, 256, 512, 2048, 4096]
TORCH_LIMIT_S = 60.0
TORCH_NS = {8, 64, 128, 256, 512}  # larger N: torch already fails at 512 (see the table)
ROUNDS = {8: 5, 64: 5, 128: 5, 256: 5, 512: 5, 2048: 5, 4096: 5}
_RESULTS: dict[tuple[str, int], dict] = {}


def _raise_nofile() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


# ---------------------------------------------------------------------------- node process


def _node_main(impl: str, port: int, run_id: str, total: int, local: int) -> None:
    _raise_nofile()
    from counting import CountingStore

    ends: list[float] = [0.0] * local
    errors: list[str] = []
    go = threading.Event()
    stores: list = []
    handlers: list = []
    if impl == "fastelastic":
        from fastelastic.rendezvous.fast_rendezvous import FastRendezvousHandler
        from fastelastic.rendezvous.timeouts import RendezvousTimeout
        from fastelastic.store import TCPStore

        timeout = RendezvousTimeout(join=timedelta(seconds=TORCH_LIMIT_S),
                                    last_call=timedelta(microseconds=1))
        for _ in range(local):
            s = CountingStore(TCPStore("127.0.0.1", port, timeout=timedelta(seconds=90)))
            stores.append(s)
            handlers.append(FastRendezvousHandler(run_id, s, "c10d", total, total, timeout,
                                                  keep_alive_interval=3600))
    else:
        import torch.distributed as dist
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import (
            C10dRendezvousBackend,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            DynamicRendezvousHandler,
        )
        from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
            RendezvousTimeout as TorchTimeout,
        )

        timeout = TorchTimeout(join=timedelta(seconds=TORCH_LIMIT_S),
                               last_call=timedelta(milliseconds=1))
        for _ in range(local):
            raw = dist.TCPStore("127.0.0.1", port, is_master=False,
                                timeout=timedelta(seconds=90))
            s = CountingStore(raw)
            stores.append(s)
            handlers.append(DynamicRendezvousHandler.from_backend(
                run_id, raw, C10dRendezvousBackend(s, run_id), total, total, "127.0.0.1",
                timeout))

    def node(i: int) -> None:
        go.wait()
        try:
            handlers[i].next_rendezvous()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            errors.append(type(e).__name__)
        ends[i] = time.monotonic()
        stop = getattr(handlers[i], "_stop_heartbeats", None)
        if stop is not None:
            stop()

    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(local)]
    for t in threads:
        t.start()
    print("READY", flush=True)
    sys.stdin.readline()
    go.set()
    for t in threads:
        t.join(TORCH_LIMIT_S + 30)
    print(json.dumps({"ends": ends, "msgs": [s.messages for s in stores], "errors": errors}),
          flush=True)
    os._exit(0)  # torch handlers keep daemon timers; skip their teardown


# ---------------------------------------------------------------------------- harness


def _host(impl: str):
    if impl == "fastelastic":
        from fastelastic.store import TCPStore

        return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                        multi_tenant=True, timeout=timedelta(seconds=90))
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         multi_tenant=True, timeout=timedelta(seconds=90))


def _one_round(impl: str, n: int, port: int, run_id: str) -> dict:
    per = [n // PROCS + (1 if i < n % PROCS else 0) for i in range(PROCS)]
    code = (f"import sys; sys.path.insert(0, {str(HERE)!r}); import bench_rendezvous as b; "
            "b._node_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), "
            "int(sys.argv[5]))")
    procs = [subprocess.Popen([sys.executable, "-c", code, impl, str(port), run_id, str(n),
                               str(k)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for k in per if k > 0]
    try:
        for p in procs:
            line = p.stdout.readline()
            assert line.strip() == "READY", f"node process failed to start: {line!r}"
        t0 = time.monotonic()
        for p in procs:
            p.stdin.write("GO\n")
            p.stdin.flush()
        reports = [json.loads(p.stdout.readline()) for p in procs]
    finally:
        for p in procs:
            try:
                p.wait(timeout=TORCH_LIMIT_S + 60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    ends = [e for r in reports for e in r["ends"]]
    errors = [e for r in reports for e in r["errors"]]
    msgs = [m for r in reports for m in r["msgs"]]
    return {"seconds": max(ends) - t0, "errors": errors, "msgs": msgs}


@pytest.fixture(scope="module", autouse=True)
def _write_table():
    yield
    if not _RESULTS:
        return
    lines = [
        "# Rendezvous formation time (min = max = N, last call 0)",
        "",
        (f"N nodes as threads in {PROCS} processes on this machine ({os.cpu_count()} cores), "
         "store hosted in the benchmark process. Time until every node returned from "
         "`next_rendezvous()`, p50 / p99 over rounds (one run, `benchmarks/bench_rendezvous.py`). "
         "Messages: store requests per node on the wire (p50 / max), for torch counted on "
         "its rendezvous backend's store only."),
        "",
        ("| N | fastelastic p50 (s) | p99 (s) | msgs/node p50/max | torch c10d p50 (s) "
         "| p99 (s) | msgs/node p50/max | speed-up |"),
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in sorted({k[1] for k in _RESULTS}):
        ours, theirs = _RESULTS.get(("fastelastic", n)), _RESULTS.get(("torch", n))

        def cells(r):
            if r is None:
                return ["–", "–", "–"]
            if r["failed"]:
                return [f"did not complete in {TORCH_LIMIT_S:.0f} s", "–",
                        f"{r['msgs_p50']}/{r['msgs_max']}"]
            return [f"{r['p50']:.3f}", f"{r['p99']:.3f}", f"{r['msgs_p50']}/{r['msgs_max']}"]

        ratio = "–"
        if ours and theirs and not theirs["failed"] and not ours["failed"]:
            ratio = f"{theirs['p50'] / ours['p50']:.0f}×"
        elif ours and theirs and theirs["failed"]:
            ratio = f">{TORCH_LIMIT_S / ours['p50']:.0f}×"
        lines.append(f"| {n} | " + " | ".join(cells(ours) + cells(theirs) + [ratio]) + " |")
    out = HERE / "results" / "rendezvous.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


_CASES = [("fastelastic", n) for n in NS] + [("torch", n) for n in sorted(TORCH_NS)]


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("impl", "n"), _CASES, ids=[f"{i}-{n}" for i, n in _CASES])
def test_rendezvous_formation(benchmark, impl, n):
    if impl == "torch":
        pytest.importorskip("torch", reason="!!! torch not installed: no comparison")
    _raise_nofile()
    host = _host(impl)
    times: list[float] = []
    msgs: list[int] = []
    failed = False
    counter = iter(range(1_000_000))

    def run() -> None:
        nonlocal failed
        r = _one_round(impl, n, host.port, f"bench-{impl}-{n}-{next(counter)}")
        if r["errors"]:
            failed = True
        times.append(r["seconds"])
        msgs.extend(r["msgs"])

    rounds = ROUNDS[n] if impl == "fastelastic" else (1 if n >= 256 else 3)
    benchmark.group = f"rendezvous-N{n}"
    benchmark.pedantic(run, rounds=rounds, iterations=1, warmup_rounds=0)
    ordered = sorted(times)
    res = {
        "p50": statistics.median(ordered),
        "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
        "max": ordered[-1],
        "msgs_p50": int(statistics.median(msgs)) if msgs else 0,
        "msgs_max": max(msgs) if msgs else 0,
        "failed": failed,
        "nodes": n,
        "processes": PROCS,
    }
    _RESULTS[(impl, n)] = res
    benchmark.extra_info.update(res)
    if impl == "fastelastic":
        assert not failed, f"fastelastic rendezvous of {n} nodes failed"
        torch_res = _RESULTS.get(("torch", n))
        if torch_res and not torch_res["failed"]:
            benchmark.extra_info["ratio_vs_torch"] = torch_res["p50"] / res["p50"]
