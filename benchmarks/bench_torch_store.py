"""torch code on our store: ``torch.distributed.PrefixStore`` (what ``init_process_group``
wraps a store in) over fastelastic's TCPStore, seen by torch as a ``torch.distributed.Store``
(the adapter of ``fastelastic.store._torch``), against the same over torch's own TCPStore.

Each side: a server hosted in this process and one client, wrapped in torch's PrefixStore;
rounds of 100 ``set`` or ``get`` alternate between the sides (interleaved A/B). The fastelastic
side's calls go C++ -> pybind trampoline -> our Cython client (one round trip per op).

Run: python3 -m pytest benchmarks/bench_torch_store.py --benchmark-enable -q
"""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed", reason="!!! torch is not installed")

CHUNK = 100


def _sides():
    from fastelastic.store import TCPStore

    ours_srv = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ours = TCPStore("127.0.0.1", ours_srv.port, wait_for_workers=False,
                    timeout=timedelta(seconds=30))
    theirs_srv = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    theirs = dist.TCPStore("127.0.0.1", theirs_srv.port, is_master=False,
                           wait_for_workers=False, timeout=timedelta(seconds=30))
    return {
        "fastelastic": (dist.PrefixStore("bench", ours), ours_srv, ours),
        "torch": (dist.PrefixStore("bench", theirs), theirs_srv, theirs),
    }


@pytest.mark.parametrize("op", ["set", "get"])
def test_torch_prefixstore_on_each_store(benchmark, sizes, results, op):
    sides = _sides()
    samples: dict[str, list[float]] = {impl: [] for impl in sides}
    for store, _, _ in sides.values():
        store.set("k", "v" * 64)
    order = list(sides)

    def one_round() -> None:
        for impl in order:
            store = sides[impl][0]
            fn = store.get if op == "get" else (lambda k, s=store: s.set(k, "v" * 64))
            for _ in range(CHUNK):
                t0 = time.perf_counter_ns()
                fn("k")
                samples[impl].append((time.perf_counter_ns() - t0) / 1000)
        order.reverse()

    rounds = max(1, sizes["rt_rounds"] // CHUNK)
    one_round()  # warm-up
    for s in samples.values():
        s.clear()
    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    for impl, lat in samples.items():
        lat.sort()
        metrics = {"p50_us": statistics.median(lat), "p99_us": lat[int(len(lat) * 0.99) - 1]}
        results.add("torch_store", op, impl, metrics, benchmark.extra_info.setdefault(impl, {}))
    ratio = benchmark.extra_info["fastelastic"]["ratio_p50_us"]
    print(f"\ntorch PrefixStore.{op} p50: fastelastic "
          f"{benchmark.extra_info['fastelastic']['p50_us']:.1f} µs, torch "
          f"{benchmark.extra_info['torch']['p50_us']:.1f} µs, ratio {ratio:.2f}")
    assert sides["fastelastic"][0].get("k") == b"v" * 64  # the work really reached our server
    sides["fastelastic"][1].shutdown_server()
