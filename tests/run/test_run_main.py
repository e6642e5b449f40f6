"""``fastelastic.run.main`` and ``run`` from Python behave as torch's; the command exits."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib

import pytest
from run_testlib import DUMP, REPO, base_env, run_launcher

from fastelastic.run import console_main

# Runs in a fresh interpreter: main() starts a real job, with signal handlers and workers.
PROBE = r"""
import json, sys
from argparse import Namespace
import fastelastic.run as fr
from fastelastic.multiprocessing.errors import ChildFailedError
ok, bad = sys.argv[1], sys.argv[2]
out = {}

def outcome(fn, *a):
    try:
        return ["returned", repr(fn(*a))]
    except SystemExit as e:
        return ["SystemExit", e.code]
    except ChildFailedError as e:
        rank, f = e.get_first_failure()
        return ["ChildFailedError", rank, f.exitcode]
    except Exception as e:
        return [type(e).__name__, str(e)]

common = ["--standalone", "--nproc-per-node", "2"]
out["ok"] = outcome(fr.main, [*common, ok])
out["failed"] = outcome(fr.main, [*common, bad])
out["bad_value"] = outcome(fr.main, ["--nnodes", "3:2", ok])
out["no_script"] = outcome(fr.main, [*common, ok + ".missing"])
out["bad_flag"] = outcome(fr.main, ["--no-such-flag", ok])
# a Namespace as Accelerate builds it: torch's attributes only, none of fastrun's own
torch_only = vars(fr.get_args_parser().parse_args([*common, ok]))
for name in ("exit_barrier_timeout", "events_endpoint", "preload", "hang_timeout",
             "checkpoint_drain_timeout", "checkpoint_copy_to"):
    torch_only.pop(name, None)
out["hand_ns"] = outcome(fr.run, Namespace(**torch_only))
if sys.argv[3] == "torch":
    from torch.distributed.run import get_args_parser
    out["torch_ns"] = outcome(fr.run, get_args_parser().parse_args([*common, ok]))
    out["torch_ns_failed"] = outcome(fr.run, get_args_parser().parse_args([*common, bad]))
print("RESULT " + json.dumps(out))
"""


@pytest.mark.timeout(200)
def test_main_returns_none_and_raises_like_torch(tmp_path):
    ok = tmp_path / "ok.py"
    # one write(2) per line: workers share the stdout pipe, and print() may split a line
    ok.write_text(
        "import os\nos.write(1, b'worker ' + os.environ['RANK'].encode() + b'\\n')\n"
    )
    bad = tmp_path / "bad.py"
    bad.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    try:
        import torch.distributed.run  # noqa: F401
        have_torch = "torch"
    except ImportError:  # pragma: no cover - CI installs torch
        have_torch = "none"
        print("!!! torch is not installed: run() with torch's Namespace untested")
    r = subprocess.run([sys.executable, "-c", PROBE, str(ok), str(bad), have_torch],
                       env=base_env(), cwd=str(tmp_path), capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])
    assert out["ok"] == ["returned", "None"]
    assert out["failed"] == ["ChildFailedError", 1, 3]
    assert out["bad_value"][0] == "ValueError" and "--nnodes 3:2" in out["bad_value"][1]
    assert out["no_script"][0] == "ValueError" and "not found" in out["no_script"][1]
    assert out["bad_flag"] == ["SystemExit", 2]  # argparse's, as torch's main
    assert out["hand_ns"][0] == "returned"
    if have_torch == "torch":
        assert out["torch_ns"][0] == "returned"
        assert out["torch_ns_failed"] == ["ChildFailedError", 1, 3]
    assert r.stdout.count("worker ") == 2 * (3 if have_torch == "torch" else 2)


def test_console_entry_point_exits(tmp_path):
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["fastrun"] == "fastelastic.run:console_main"
    ok = tmp_path / "ok.py"
    ok.write_text("")
    with pytest.raises(SystemExit) as ei:
        console_main(["--nnodes", "3:2", str(ok)])
    assert ei.value.code == 2


def test_main_raises_value_error_for_a_bad_pet_variable(monkeypatch, tmp_path):
    from fastelastic.run import main

    monkeypatch.setenv("PET_STANDALONE", "yes")
    with pytest.raises(ValueError, match="PET_STANDALONE='yes'"):
        main([str(tmp_path / "s.py")])
    try:
        from torch.distributed.run import main as torch_main
    except ImportError:  # pragma: no cover - CI installs torch
        pytest.skip("!!! torch is not installed: not compared with torch's main")
    with pytest.raises(ValueError):
        torch_main([str(tmp_path / "s.py")])


_GLOG = re.compile(r"^([IWE])(\d{4}) (\d\d:\d\d:\d\d\.\d{6}) (\d+) (\S+\.py):(\d+)\] (.*)$")


def _log_lines(stderr: str) -> list[re.Match[str]]:
    return [m for m in map(_GLOG.match, stderr.splitlines()) if m]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("which", ["fastrun", pytest.param("torchrun", marks=pytest.mark.torch)])
def test_loglevel_prints_the_agents_log_in_torchruns_format(tmp_path, which, request):
    """LOGLEVEL=INFO shows the agent's INFO lines; unset, only warnings; the same line format
    as torchrun (level letter, date, time, pid, file:line])."""
    if which == "torchrun":
        request.getfixturevalue("need_torch")
    args = ["--standalone", "--nproc-per-node", "2", str(DUMP)]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    info = run_launcher(which, args, base_env(DUMP_DIR=str(tmp_path / "a"), LOGLEVEL="INFO"))
    assert info.returncode == 0, info.stderr[-2000:]
    lines = _log_lines(info.stderr)
    assert any(m[1] == "I" and "Rendezvous complete" in m[7] for m in lines), info.stderr[-3000:]
    if which == "fastrun":  # (``python -m torch.distributed.run`` logs it as __main__, bare)
        omp = [m for m in lines if "Setting OMP_NUM_THREADS" in m[7]]
        assert omp and omp[0][1] == "W"
        # every line of a multi-line message carries the prefix (the OMP banner has 4)
        assert sum(1 for m in lines if m[5] == omp[0][5] and m[6] == omp[0][6]) >= 4
    quiet = run_launcher(which, args, base_env(DUMP_DIR=str(tmp_path / "b")))
    assert quiet.returncode == 0, quiet.stderr[-2000:]
    levels = {m[1] for m in _log_lines(quiet.stderr)}
    assert levels <= {"W", "E"}, quiet.stderr[-3000:]
    if which == "fastrun":
        assert levels == {"W"}, quiet.stderr[-3000:]  # the OMP banner
