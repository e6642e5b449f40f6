"""Worker exit -> ``PContext.wait()`` returns: pidfd monitor vs torch's polling (period 0.1 s).

Each round starts ``nproc`` ``sleep`` workers with ``start_processes`` of the implementation,
blocks the main thread in ``pc.wait(timeout=5, period=0.1)``, and a helper thread SIGKILLs one
worker at a random phase of the polling period. Latency = ``wait`` returning (with the failure)
minus the ``kill`` call, both on CLOCK_MONOTONIC. With ``nproc > 1`` both implementations also
stop the survivors (SIGTERM) before ``wait`` returns, as they do inside an agent. Logs go to
a real temporary directory, not redirected (torchrun's default).

Run: ``python3 -m pytest benchmarks/bench_procmon.py --benchmark-enable -q -s``.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import threading
import time

import pytest

IMPLS = ["fastelastic", "torch"]
ROUNDS = {1: 40, 8: 20}
_RESULTS: dict[tuple[int, str], dict] = {}


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def _start(impl: str, nproc: int, log_dir: str):
    if impl == "fastelastic":
        from fastelastic.multiprocessing import DefaultLogsSpecs, start_processes
    else:
        pytest.importorskip("torch", reason="!!! torch 2.13 is not installed: no baseline")
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, start_processes
    return start_processes(
        name="bench",
        entrypoint="/bin/sleep",
        args={r: ("60",) for r in range(nproc)},
        envs={r: {} for r in range(nproc)},
        # a real directory: with os.devnull torch tails /dev/null and close() waits ~0.1 s more
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize("nproc", [1, 8])
@pytest.mark.parametrize("impl", IMPLS)
def test_exit_to_wait_return(benchmark, impl, nproc, tmp_path):
    rng = random.Random(1234 + nproc)
    latencies: list[float] = []

    def setup():
        pc = _start(impl, nproc, str(tmp_path))
        victim = pc.pids()[nproc // 2]
        about_to_wait = threading.Event()
        killed_at: list[int] = []

        def killer():
            about_to_wait.wait(10)
            # a random phase within the 0.1 s period: workload shaping, not synchronisation
            time.sleep(rng.uniform(0.005, 0.105))
            killed_at.append(time.monotonic_ns())
            os.kill(victim, signal.SIGKILL)

        t = threading.Thread(target=killer)
        t.start()
        return (pc, about_to_wait, killed_at, t), {}

    def target(pc, about_to_wait, killed_at, thread):
        about_to_wait.set()
        result = pc.wait(timeout=5, period=0.1)
        done = time.monotonic_ns()
        thread.join(5)
        assert result is not None and result.is_failed(), "the killed worker was not reported"
        latencies.append((done - killed_at[0]) / 1e6)
        pc.close()

    benchmark.pedantic(target, setup=setup, rounds=ROUNDS[nproc], iterations=1, warmup_rounds=0)
    stats = {
        "nproc": nproc,
        "n": len(latencies),
        "p50_ms": round(_pct(latencies, 50), 3),
        "p90_ms": round(_pct(latencies, 90), 3),
        "p99_ms": round(_pct(latencies, 99), 3),
        "max_ms": round(max(latencies), 3),
        "mean_ms": round(statistics.fmean(latencies), 3),
    }
    benchmark.extra_info.update(stats)
    _RESULTS[(nproc, impl)] = stats
    if (nproc, "fastelastic") in _RESULTS and (nproc, "torch") in _RESULTS:
        ours, theirs = _RESULTS[(nproc, "fastelastic")], _RESULTS[(nproc, "torch")]
        benchmark.extra_info["torch_over_fastelastic_p50"] = round(
            theirs["p50_ms"] / ours["p50_ms"], 1
        )
    print(f"\n[exit -> wait returns] {impl} nproc={nproc}: {stats}")
