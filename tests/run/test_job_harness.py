"""The test harness ends the jobs its tests start: a test that times out leaves nothing running.

A pytest run of its own starts a real ``fastrun --preload json`` job (launcher, zygote, two
workers that block) through ``jobtree.start_job`` and times out waiting for it, under each of
pytest-timeout's methods: ``signal`` (the test fails, the teardown ends the job) and ``thread``
(pytest leaves by ``os._exit``; the launcher's parent-death signal ends it, and its zygote then
its workers). Afterwards no process of the job may be alive.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from jobtree import wait_until
from run_testlib import REPO, base_env

pytestmark = pytest.mark.timeout(120)

WORKER = REPO / "tests" / "multiprocessing" / "zygote_worker.py"

_INNER = """
import json, os, sys
import pytest
from jobtree import start_job, wait_until

@pytest.mark.timeout(20, method={method!r})
def test_waits_for_a_job_that_never_ends():
    proc = start_job(
        [sys.executable, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "2",
         "--preload", "json", {worker!r}, "ready-wait", {out!r}, "ignore-term"],
        stdout=open(os.devnull, "w"), stderr=open(os.devnull, "w"),
    )
    with open(os.path.join({out!r}, "launcher.json"), "w") as f:
        json.dump({{"pid": proc.pid}}, f)
    names = [os.path.join({out!r}, f"{{rank}}.pid") for rank in range(2)]
    assert wait_until(lambda: all(map(os.path.exists, names)), 15)
    proc.wait()  # never returns: the workers block, and the timeout ends the test
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.mark.parametrize("method", ["signal", "thread"])
def test_a_test_that_times_out_ends_the_job_it_started(tmp_path, method):
    out = tmp_path / "out"
    out.mkdir()
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(textwrap.dedent(_INNER.format(
        method=method, worker=str(WORKER), out=str(out))))
    env = base_env(PYTHONPATH=os.pathsep.join([str(REPO / "tests"), str(REPO / "src")]))
    # the repository's tests/conftest.py, loaded as a plugin, brings the autouse fixture
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "--rootdir", str(inner), "-c", os.devnull, str(inner / "test_inner.py")],
        cwd=inner, env=env, capture_output=True, text=True, timeout=90,
    )
    assert r.returncode != 0 and "Timeout" in r.stdout + r.stderr, r.stdout[-2000:]
    launcher = json.loads((out / "launcher.json").read_text())["pid"]
    workers = [json.loads((out / f"{rank}.pid").read_text()) for rank in range(2)]
    pids = {launcher, *(w["pid"] for w in workers), *(w["ppid"] for w in workers)}
    assert len(pids) == 4  # the launcher, the zygote (both workers' parent), two workers
    assert wait_until(lambda: not any(_alive(p) for p in pids), 30), [
        (p, Path(f"/proc/{p}/cmdline").read_bytes()[:200]) for p in pids if _alive(p)]
