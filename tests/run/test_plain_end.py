"""A plainly started Python worker runs through ``_plain_boot.py`` (issue 35 item 3).

It sees its start as ``python -u SCRIPT`` / ``-m MODULE`` would give it, keeps Python's exit
status and traceback, and ends without the interpreter's teardown, so a script that keeps its
gloo process group ends cleanly. The end under load is in ``test_worker_end.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from run_testlib import HERE, base_env, free_port, launcher_cmd, start

from fastelastic.multiprocessing.api import PLAIN_RUNNER_ENV, plain_command

PROBE = HERE / "plain_probe.py"
TIMEOUT = 150.0  # one fastrun job on a busy machine


def _fastrun(args: list[str], cwd: str, nproc: int = 1, **env: str) -> tuple[int, str, str]:
    proc = start([*launcher_cmd("fastrun"), "--standalone", "--nproc-per-node", str(nproc), *args],
                 base_env(LOGLEVEL="WARNING", **env), cwd)
    try:
        out, err = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"fastrun {args} did not end within {TIMEOUT:g}s")  # jobtree ends it
    return proc.returncode, out, err


def _direct(args: list[str], cwd: str) -> tuple[int, str, str]:
    r = subprocess.run([sys.executable, "-u", *args], env=base_env(), cwd=cwd,
                       capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout, r.stderr


def _seen(out: str) -> dict:
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("SEEN "))[5:])


def _worker_exitcode(err: str) -> int:
    m = re.search(r"exitcode\s*:\s*(-?\d+)", err)
    assert m, err[-3000:]
    return int(m.group(1))


def test_python_commands_run_through_the_runner_and_others_do_not(monkeypatch):
    monkeypatch.delenv(PLAIN_RUNNER_ENV, raising=False)
    exe, script = sys.executable, str(PROBE)
    got = plain_command(exe, ("-u", script, "a", "--b"))
    assert got[0] == exe and got[1][0] == "-u" and got[1][2:] == (script, "a", "--b")
    assert got[1][1].endswith("_plain_boot.py") and os.path.isfile(got[1][1])
    mod = plain_command(exe, ("-u", "-m", "pkg.mod", "x"))
    assert mod[1][0] == "-u" and mod[1][2:] == ("-m", "pkg.mod", "x")
    # --no-python, interpreter options the runner does not know, a missing script: unchanged
    for entry, args in ((script, ("a",)), ("/bin/echo", ("-u", script)),
                        (exe, ("-X", "dev", script)), (exe, ("-u", script + ".missing"))):
        assert plain_command(entry, args) == (entry, args)
    monkeypatch.setenv(PLAIN_RUNNER_ENV, "0")
    assert plain_command(exe, ("-u", script)) == (exe, ("-u", script))


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_a_plain_worker_sees_what_python_gives_it(as_module):
    cwd = str(HERE)
    target = ["-m", "plain_probe"] if as_module else [os.path.relpath(PROBE, cwd)]
    code, out, err = _fastrun([*target, "ok"], cwd)
    assert code == 0, err[-3000:]
    seen = _seen(out)
    expected = _seen(_direct([*target, "ok"], cwd)[1])
    assert seen.pop("through_runner") and not expected.pop("through_runner")
    assert seen == expected
    assert seen["name"] == "__main__" and seen["main_is_me"] and seen["unbuffered"]
    assert seen["spec"] == ("plain_probe" if as_module else None)


@pytest.mark.parametrize(
    ("how", "worker_code"), [("exit3", 3), ("exitmsg", 1), ("raise", 1)]
)
def test_a_plain_worker_keeps_its_exit_status_and_traceback(how, worker_code):
    cwd = str(HERE)
    code, _, err = _fastrun([PROBE.name, how], cwd)
    assert code == 1, err[-3000:]
    assert _worker_exitcode(err) == worker_code
    _, _, direct_err = _direct([PROBE.name, how], cwd)
    if how == "raise":
        # the user's traceback, from the script's own first frame, as python prints it
        tb = direct_err[direct_err.index("Traceback"):]
        assert tb.splitlines()[1].startswith(f'  File "{PROBE}", line ')
        assert tb in err, err[-3000:]
        assert "_plain_boot" not in err
    if how == "exitmsg":
        assert direct_err == "a message\n" and "a message\n" in err


FORCED_RUNS = 3


def _direct_pair(script: str, cwd: str) -> list[tuple[int, str]]:
    """Ranks 0 and 1 of ``script`` started directly (``python -u script``): (code, stderr)."""
    env = base_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
                   OMP_NUM_THREADS="1")
    procs = [start([sys.executable, "-u", script], dict(env, RANK=str(r), LOCAL_RANK=str(r)),
                   cwd) for r in range(2)]
    out = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{script} started directly did not end within {TIMEOUT:g}s")
        out.append((p.returncode, err))
    return out


@pytest.mark.torch
@pytest.mark.timeout((FORCED_RUNS + 1) * TIMEOUT + 60)
def test_a_script_that_keeps_its_gloo_group_ends_cleanly(need_torch, tmp_path):
    """``plain_end_forced.py`` finalises rank 0's interpreter while its gloo thread waits for
    the GIL to drop a finished work: started directly, rank 0 dies of SIGABRT (the cause, as
    torch 2.13 and Python 3.11 have it); through the runner every run exits 0."""
    script = str(HERE / "plain_end_forced.py")
    (code0, err0), (code1, err1) = _direct_pair(script, str(tmp_path))
    assert code0 == -6 and "terminate called without an active exception" in err0, (
        code0, err0[-2000:])
    assert code1 == 0, err1[-2000:]
    for i in range(FORCED_RUNS):
        code, out, err = _fastrun([script], str(tmp_path), nproc=2, OMP_NUM_THREADS="1")
        assert code == 0, f"run {i}: exit {code}\n{err[-3000:]}"
        assert sorted(ln.split()[3] for ln in out.splitlines() if ln.startswith("end of")) == [
            "0", "1"], out
        assert "terminate called" not in err, err[-3000:]
