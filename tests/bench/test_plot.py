"""benchmarks/plot.py: results (JSON, or the markdown tables) in, valid PNGs out."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLOT = REPO / "benchmarks" / "plot.py"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
ALL = ["rendezvous_vs_nodes.png", "multi_key.png", "connection_storm.png", "worker_restart.png",
       "recovery_downtime.png", "hang_downtime.png"]

image = pytest.importorskip(
    "matplotlib.image", reason="!!! matplotlib missing (pip install '.[bench]'): plots untested"
)


def plot_module():
    spec = importlib.util.spec_from_file_location("bench_plot", PLOT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_plot(results: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(PLOT), "--results", str(results), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)


def check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    pixels = image.imread(path)  # decodes the whole file
    h, w = pixels.shape[:2]
    assert w >= 600 and h >= 400, (path.name, w, h)
    assert pixels.std() > 0.05, f"{path.name} is blank"


def synthetic(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / "rendezvous.json").write_text(json.dumps({"limit_s": 60, "formation": [
        *[{"impl": "fastelastic", "n": n, "p50": 0.01 * n ** 0.5, "p99": 0.012 * n ** 0.5,
           "failed": False} for n in (8, 64, 512)],
        {"impl": "torch", "n": 8, "p50": 1.3, "p99": 1.3, "failed": False},
        {"impl": "torch", "n": 512, "p50": 60, "p99": 60, "failed": True},
    ]}))
    rows = []
    for n, fe, to in ((1000, 0.0005, 0.02), (10000, 0.004, 0.2)):
        rows += [{"family": "multi_user", "case": str(n), "impl": "fastelastic", "total_s": fe},
                 {"family": "multi_user", "case": str(n), "impl": "torch", "total_s": to}]
    for n, fe, to in ((1024, 0.02, 0.02), (8192, 0.17, 1.1)):
        rows += [{"family": "storm", "case": str(n), "impl": "fastelastic", "time_s": fe,
                  "errors": 0},
                 {"family": "storm", "case": str(n), "impl": "torch", "time_s": to, "errors": 2}]
    (d / "store.json").write_text(json.dumps({"results": rows}))
    (d / "agent.json").write_text(json.dumps({"results": [
        {"op": op, "impl": impl, "p50_ms": v, "p90_ms": v * 1.2, "p99_ms": v * 1.5}
        for op, vals in (("exit->detected", (1.5, 47.0)),
                         ("exit->replacement running", (15.0, 130.0)))
        for impl, v in zip(("fastelastic", "torch"), vals, strict=True)
    ]}))
    (d / "recovery.json").write_text(json.dumps({"runs": [
        {"launcher": "fastrun", "mode": m, "scenario": "replacement", "downtime_s": 9.5,
         "recovered": True} for m in ("kill", "freeze", "cut")] + [
        {"launcher": "torchrun", "mode": m, "scenario": "replacement", "downtime_s": 300,
         "recovered": False} for m in ("kill", "freeze", "cut")]}))
    (d / "hang.json").write_text(json.dumps({"runs": [
        {"launcher": lname, "mode": m, "scenario": "", "downtime_s": v, "recovered": ok}
        for m in ("native", "sleep", "deadlock", "loop")
        for lname, v, ok in (("fastrun --preload torch", 8.5, True), ("fastrun", 20.0, True),
                             ("torchrun", 60.0, False))]}))


def test_every_plot_from_json(tmp_path):
    synthetic(tmp_path / "res")
    r = run_plot(tmp_path / "res", tmp_path / "out")
    assert r.returncode == 0, r.stderr
    for name in ALL:
        check_png(tmp_path / "out" / name)
        assert f"wrote {tmp_path / 'out' / name}" in r.stdout


def test_missing_inputs_are_skipped_with_a_message_and_bad_ones_named(tmp_path):
    res = tmp_path / "res"
    synthetic(res)
    for name in ("store.json", "agent.json", "recovery.json", "hang.json"):
        (res / name).unlink()
    (res / "agent.json").write_text("{not json")
    r = run_plot(res, tmp_path / "out")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "skip recovery_downtime.png: no recovery.json" in r.stdout
    assert "skip hang_downtime.png: no hang.json" in r.stdout
    assert "skip multi_key.png: no store.json/.md" in r.stdout
    assert "agent.json: not valid JSON" in r.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["rendezvous_vs_nodes.png"]
    check_png(tmp_path / "out" / "rendezvous_vs_nodes.png")


@pytest.mark.slow
def test_markdown_tables_are_read_when_there_is_no_json(tmp_path):
    plot = plot_module()
    (tmp_path / "rendezvous.md").write_text(
        "| N | fastelastic p50 (s) | p99 (s) | msgs | torch c10d p50 (s) | p99 (s) | msgs | x |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| 8 | 0.019 | 0.022 | 11/17 | 1.300 | 1.301 | 6/7 | 69× |\n"
        "| 512 | 0.162 | 0.196 | 11/17 | did not complete in 60 s | – | 69/116 | >370× |\n"
        "| 2048 | 0.729 | 1.162 | 11/17 | – | – | – | – |\n")
    (tmp_path / "store.md").write_text(
        "| benchmark | unit | fastelastic | torch | ratio | target | met |\n|---|---|---:|---:|\n"
        "| multi_set+multi_get 100,000 keys, own client+server | ms | 37.2 | 36,210 | 0.00 | |\n"
        "| storm 16,384 light clients: time to all connected+handshaked+ADD | ms | 344.9 | 2,167 |"
        " 0.16 | | |\n"
        "| storm 16,384 light clients: refused/reset/unfinished |  | 0 | 1 | 0.00 |  |  |\n")
    (tmp_path / "agent.md").write_text(
        "| Operation | fastelastic p50 / p90 / p99 | torch p50 / p90 / p99 | x |\n"
        "|---|---|---|---|\n"
        "| worker exit → replacement worker running | 15.7 / 18.6 / 20.4 ms | "
        "131.4 / 152.4 / 441.7 ms | 8.4× |\n")
    rdzv, src = plot.load_rendezvous(tmp_path)
    assert src == "rendezvous.md" and rdzv["limit_s"] == 60.0
    assert rdzv["series"]["fastelastic"] == [(8, 0.019, 0.022, False), (512, 0.162, 0.196, False),
                                             (2048, 0.729, 1.162, False)]
    assert rdzv["series"]["torch"] == [(8, 1.3, 1.301, False), (512, None, None, True)]
    store, _ = plot.load_store(tmp_path)
    assert store[("multi_user", "100000", "torch")]["total_s"] == pytest.approx(36.21)
    assert store[("storm", "16384", "fastelastic")]["time_s"] == pytest.approx(0.3449)
    assert store[("storm", "16384", "torch")]["errors"] == 1
    agent, _ = plot.load_agent(tmp_path)
    assert agent["exit->replacement running"]["torch"] == {
        "p50_ms": 131.4, "p90_ms": 152.4, "p99_ms": 441.7}
    r = run_plot(tmp_path, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    for name in ALL[:4]:
        check_png(tmp_path / "out" / name)


def test_the_committed_results_plot(tmp_path):
    r = run_plot(REPO / "benchmarks" / "results", tmp_path)
    assert r.returncode == 0, r.stderr
    for name in ALL[:4]:
        check_png(tmp_path / name)
