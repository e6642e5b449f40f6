"""The zygote's waits are bounded and the process groups it made are signalled only while
they are provably ours (real processes throughout)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from mphelpers import wait_gone

from fastelastic.multiprocessing import DefaultLogsSpecs, _pcontext, start_processes
from fastelastic.multiprocessing._zygote import PythonCommand, Zygote, python_command

_zygote = sys.modules["fastelastic.multiprocessing._zygote"]

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent
WORKER = str(HERE / "zygote_worker.py")
PY = sys.executable


def _start_zygote(modules: tuple[str, ...], ready_timeout: float = 60) -> Zygote:
    cmd = python_command(PY, ("-u", WORKER))
    assert isinstance(cmd, PythonCommand)
    z = Zygote(modules, cmd, ready_timeout=ready_timeout)
    z.start()
    deadline = time.monotonic() + 30
    while z.pid is None and time.monotonic() < deadline:  # launched by its supervisor thread
        time.sleep(0.01)
    return z


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_a_hung_import_is_given_up_once_at_the_ready_timeout(tmp_path, monkeypatch, caplog):
    """Every rank used to wait the whole ready timeout, then again in spawn (8 ranks at the
    default 600 s: about 2.7 h). Now the first wait that reaches the deadline gives up, kills
    the zygote, and every rank starts plainly at once."""
    caplog.set_level(logging.WARNING, logger="fastelastic.multiprocessing._zygote")
    monkeypatch.syspath_prepend(str(HERE))  # hang_import_mod is found beside this file
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    z = _start_zygote(("hang_import_mod",), ready_timeout=2)
    try:
        zpid = z.pid
        assert zpid is not None
        out = tmp_path / "o"
        out.mkdir()
        t0 = time.monotonic()
        pc = start_processes("zb", PY, {r: ("-u", WORKER, "dump", str(out)) for r in range(4)},
                             {r: {"RANK": str(r)} for r in range(4)}, DefaultLogsSpecs(),
                             zygote=z)
        result = pc.wait(60)
        took = time.monotonic() - t0
        assert result is not None and not result.is_failed(), result
        # one ready timeout (2 s) and four plain starts; the old code waited 2 s per rank twice
        assert took < 2 * 4 * 2 * 0.75, took
        assert z.state == "unusable" and "ready timeout" in z.reason, z.reason
        assert wait_gone(zpid, 10), "the hung zygote was not killed"
        for r in range(4):  # started plainly: the agent is their parent
            assert json.loads((out / f"{r}.json").read_text())["ppid"] == os.getpid()
        said = [r.getMessage() for r in caplog.records if "ready timeout" in r.getMessage()]
        assert len(said) == 1 and "\n" not in said[0], said
    finally:
        z.close()


def test_close_is_bounded_when_the_supervisor_cannot_finish(monkeypatch, caplog):
    """A zygote that cannot be reaped (uninterruptible sleep) used to hang close() forever."""
    caplog.set_level(logging.WARNING, logger="fastelastic.multiprocessing._zygote")
    release = threading.Event()
    real_stop = _zygote._stop

    def stuck_stop(proc, grace=_zygote._KILL_GRACE_S):  # the supervisor's reap never returns
        release.wait(60)
        real_stop(proc, 0)

    monkeypatch.setattr(_zygote, "_stop", stuck_stop)
    monkeypatch.setattr(_zygote, "_CLOSE_JOIN_S", 0.5)
    z = _start_zygote(("json",))
    assert z.wait_ready(30)
    zpid = z.pid
    t0 = time.monotonic()
    try:
        z.close()
        took = time.monotonic() - t0
        assert took < 5, took
        assert any("did not finish" in r.getMessage() for r in caplog.records)
        assert wait_gone(zpid, 10), "close() did not SIGKILL the zygote itself"
    finally:
        release.set()


def test_an_exited_zygote_worker_stays_unreaped_until_its_group_is_swept(tmp_path):
    """Its pid (so its process group id) stays ours while the agent may still signal the group:
    the zygote used to reap a worker at its exit, after which close() SIGKILLed a group id that
    another process's group could have taken."""
    z = _start_zygote(("json",))
    try:
        out = tmp_path / "o"
        out.mkdir()
        args = {0: ("-u", WORKER, "orphan", str(out)), 1: ("-u", WORKER, "ready-wait", str(out))}
        pc = start_processes("zb", PY, args, {r: {"RANK": str(r)} for r in range(2)},
                             DefaultLogsSpecs(), zygote=z)
        deadline = time.monotonic() + 30
        while 0 not in pc.exitcodes() and time.monotonic() < deadline:
            assert pc.wait(0.05) is None  # rank 1 runs on: the context stays open
        assert pc.exitcodes().get(0) == 0
        info = json.loads((out / "0.pid").read_text())
        assert info["ppid"] == z.pid  # forked by the zygote
        assert _proc_state(info["pid"]) == "Z"  # exited, reported, not reaped
        assert _proc_state(info["grandchild"]) not in (None, "Z")
        pc.close()
        assert wait_gone(info["grandchild"], 10), "the grandchild outlived close()"
        deadline = time.monotonic() + 10
        while _proc_state(info["pid"]) is not None and time.monotonic() < deadline:
            time.sleep(0.02)  # the zygote reaps it when told (asynchronously)
        assert _proc_state(info["pid"]) is None, "the zygote did not reap it after close()"
    finally:
        z.close()


def test_a_group_whose_leader_was_reaped_is_not_signalled(monkeypatch):
    """Checked with real processes: a zombie leader proves its group ours, a reaped one does
    not, and _signal_group then signals nothing."""
    p = subprocess.Popen(["true"])
    fd = _pcontext._open_pidfd(p.pid)
    try:
        assert wait_gone(p.pid, 10)
        assert _pcontext._unreaped(fd)  # a zombie: the id is still ours
        p.wait()
        assert not _pcontext._unreaped(fd)
    finally:
        os.close(fd)
    assert not _pcontext._unreaped(-1)

    sent = []
    monkeypatch.setattr(_pcontext.os, "killpg", lambda pid, sig: sent.append((pid, sig)))
    ctx = type("Ctx", (), {"_pids": {0: p.pid}, "_leader_fds": {0: -1}, "_monitor": None})()
    _pcontext.PContext._signal_group(ctx, 0, signal.SIGKILL)  # type: ignore[arg-type]
    assert sent == []
