"""The preloaded worker zygote: its workers are indistinguishable from plain ``python`` workers.

Real processes and signals throughout: each test runs a plain worker and a zygote-forked one
(or a real ``fastrun --preload``) and compares what they see and how their ends are reported.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from jobtree import start_job
from mphelpers import is_alive, wait_gone

from fastelastic.multiprocessing import DefaultLogsSpecs, Std, start_processes
from fastelastic.multiprocessing._zygote import (
    PythonCommand,
    Zygote,
    ZygoteContext,
    parse_preload,
    python_command,
)

pytestmark = pytest.mark.timeout(90)

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORKER = str(HERE / "zygote_worker.py")
PY = sys.executable


def _args(n: int, *extra: str, module: bool = False) -> dict[int, tuple]:
    target = ("-m", "zygote_worker") if module else (WORKER,)
    return {r: ("-u", *target, *extra) for r in range(n)}


def _envs(n: int, **extra: str) -> dict[int, dict[str, str]]:
    return {r: {"RANK": str(r), "LOCAL_RANK": str(r), **extra} for r in range(n)}


def _wait_file(path: Path, timeout: float = 30) -> dict:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} not written within {timeout}s")
        time.sleep(0.02)
    return json.loads(path.read_text())


def _start_waiting(zygote, out: Path, n: int, *mode: str):
    """Starts ``n`` ``ready-wait`` workers writing to ``out``; returns the context and their pids
    once each has written its pid file."""
    out.mkdir()
    pc = start_processes("zt", PY, _args(n, "ready-wait", str(out), *mode), _envs(n),
                         DefaultLogsSpecs(), zygote=zygote)
    return pc, [_wait_file(out / f"{r}.pid")["pid"] for r in range(n)]


@pytest.fixture
def zygote_factory():
    made: list[Zygote] = []

    def make(modules=("json",), module: bool = False) -> Zygote:
        cmd = python_command(PY, _args(1, "x", "y", module=module)[0])
        assert isinstance(cmd, PythonCommand), cmd
        z = Zygote(tuple(modules), cmd, ready_timeout=60)
        z.start()
        made.append(z)
        return z

    yield make
    for z in made:
        z.close()
        assert z.pid is None


def _run(zygote, args, envs, logs, **kw):
    pc = start_processes("zt", PY, args, envs, logs, zygote=zygote, **kw)
    return pc, pc.wait(60)


# ---------------------------------------------------------------- identical start


@pytest.mark.parametrize("module", [False, True], ids=["script", "module"])
def test_env_argv_main_signals_identical_to_plain(tmp_path, monkeypatch, zygote_factory, module):
    monkeypatch.chdir(HERE)  # -m zygote_worker is found in the cwd, as with plain python -m
    monkeypatch.setenv("FE_ZYGOTE_TEST", "agent-value")
    z = zygote_factory(module=module)
    dumps = {}
    for kind, zyg in (("plain", None), ("zygote", z)):
        out = tmp_path / kind
        out.mkdir()
        logs = DefaultLogsSpecs(log_dir=str(tmp_path / f"l{kind}"))
        pc, result = _run(zyg, _args(2, "dump", str(out), module=module),
                          _envs(2, EXTRA="x y"), logs)
        assert result is not None and not result.is_failed(), result
        assert isinstance(pc, ZygoteContext) == (zyg is not None)
        dumps[kind] = {r: json.loads((out / f"{r}.json").read_text()) for r in range(2)}
    for r in range(2):
        plain, forked = dumps["plain"][r], dumps["zygote"][r]
        assert forked["ppid"] == z.pid != plain["ppid"] == os.getpid()  # really forked by it
        for key in ("pid", "ppid"):
            plain.pop(key), forked.pop(key)
        for d in (plain, forked):  # each context has its own (random) run log directory
            assert d["env"].pop("TORCHELASTIC_ERROR_FILE").endswith(f"/{r}/error.json")
        # the output dirs differ only in the argument naming them
        forked_text = json.dumps(forked).replace(str(tmp_path / "zygote"), str(tmp_path / "plain"))
        forked = json.loads(forked_text)
        env_diff = {k for k in set(forked["env"]) | set(plain["env"])
                    if forked["env"].get(k) != plain["env"].get(k)}
        assert env_diff == set(), {k: (plain["env"].get(k), forked["env"].get(k)) for k in env_diff}
        assert forked == plain
        assert plain["env"]["FE_ZYGOTE_TEST"] == "agent-value" and plain["env"]["RANK"] == str(r)


def test_python_command_parsing(tmp_path):
    cmd = python_command(PY, ("-u", WORKER, "a"))
    assert isinstance(cmd, PythonCommand) and cmd.args == ("a",) and not cmd.module
    assert cmd.path0() == str(HERE)
    mod = python_command(PY, ("-u", "-m", "pkg.mod", "--x"))
    assert isinstance(mod, PythonCommand) and mod.module and mod.target == "pkg.mod"
    assert "not a Python interpreter" in python_command("/bin/sh", ("-c", "true"))
    assert "not supported" in python_command(PY, ("-O", WORKER))
    assert "function" in python_command(print, ())
    assert "regular script" in python_command(PY, ("-u", str(tmp_path)))
    assert parse_preload(" torch, numpy.random ,") == ("torch", "numpy.random")
    assert parse_preload(None) == () and parse_preload("") == ()
    with pytest.raises(ValueError, match="not a module name"):
        parse_preload("torch;rm -rf")


# ---------------------------------------------------------------- ends, signals, stopping


@pytest.mark.parametrize("how", ["exit3", "sigkill", "sigint"])
def test_exit_codes_and_signals_reported_exactly(tmp_path, zygote_factory, how):
    z = zygote_factory()
    codes = {}
    for kind, zyg in (("plain", None), ("zygote", z)):
        out = tmp_path / kind
        out.mkdir()
        mode = ("exit", str(out), "3") if how == "exit3" else ("ready-wait", str(out))
        pc = start_processes("zt", PY, _args(1, *mode), _envs(1), DefaultLogsSpecs(), zygote=zyg)
        if how != "exit3":
            pid = _wait_file(out / "0.pid")["pid"]
            os.kill(pid, signal.SIGKILL if how == "sigkill" else signal.SIGINT)
        result = pc.wait(30)
        assert result is not None and result.is_failed()
        codes[kind] = result.failures[0].exitcode
    expected = {"exit3": 3, "sigkill": -signal.SIGKILL, "sigint": -signal.SIGINT}[how]
    assert codes == {"plain": expected, "zygote": expected}


def test_close_delivers_sigterm_and_sigint(tmp_path, zygote_factory):
    z = zygote_factory()
    out = tmp_path / "o"
    pc, _ = _start_waiting(z, out, 2, "term")
    assert isinstance(pc, ZygoteContext)
    t0 = time.monotonic()
    pc.close(signal.SIGTERM, timeout=20)
    assert time.monotonic() - t0 < 10  # the handler ran: no wait for the SIGKILL deadline
    for r in range(2):
        assert _wait_file(out / f"{r}.sig") == {"signal": signal.SIGTERM}
    assert pc.exitcodes() == {0: 0, 1: 0}
    pc, _ = _start_waiting(z, tmp_path / "o2", 1)
    pc.close(signal.SIGINT, timeout=20)  # default handler: KeyboardInterrupt, then SIGINT death
    assert pc.exitcodes() == {0: -signal.SIGINT}


def test_worker_ignoring_sigterm_dies_at_the_shutdown_timeout(tmp_path, zygote_factory):
    z = zygote_factory()
    pc, (pid,) = _start_waiting(z, tmp_path / "o", 1, "ignore-term")
    t0 = time.monotonic()
    pc.close(signal.SIGTERM, timeout=1)
    elapsed = time.monotonic() - t0
    assert 0.9 <= elapsed < 8, elapsed
    assert pc.exitcodes() == {0: -signal.SIGKILL}
    assert wait_gone(pid, 5)


def test_fastrun_forwards_sigterm_to_zygote_workers(tmp_path):
    env = _fastrun_env()
    proc = start_job(
        [PY, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "2", "--preload",
         "json", WORKER, "ready-wait", str(tmp_path), "term"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        pids = [_wait_file(tmp_path / f"{r}.pid")["pid"] for r in range(2)]
        ppids = {_wait_file(tmp_path / f"{r}.pid")["ppid"] for r in range(2)}
        assert len(ppids) == 1 and proc.pid not in ppids  # forked by the zygote
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode != 0, err
        for r in range(2):
            assert _wait_file(tmp_path / f"{r}.sig") == {"signal": signal.SIGTERM}
        assert all(wait_gone(p, 5) for p in pids)
        assert wait_gone(ppids.pop(), 5)  # the zygote too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------- output


def test_tee_redirects_and_log_files_like_plain(tmp_path, zygote_factory, capfd):
    z = zygote_factory()
    text = {}
    for kind, zyg in (("plain", None), ("zygote", z)):
        logs = DefaultLogsSpecs(log_dir=str(tmp_path / kind), redirects=Std.ALL, tee=Std.OUT)
        pc, result = _run(zyg, _args(2, "exit", str(tmp_path), "0"), _envs(2), logs,
                          log_line_prefixes={0: "[a0]:", 1: "[a1]:"})
        assert not result.is_failed()
        pc2, result2 = _run(zyg, _args(1, "fail", str(tmp_path)), _envs(1), DefaultLogsSpecs(
            log_dir=str(tmp_path / f"{kind}-f"), redirects=Std.ERR, tee=Std.ERR))
        assert result2.is_failed()
        captured = capfd.readouterr()
        text[kind] = (
            Path(result2.stderrs[0]).read_text(),
            [ln for ln in captured.err.splitlines() if ln.startswith("[zt0]:")],
            sorted(os.path.basename(p) for p in result.stdouts.values()),
        )
    assert text["plain"] == text["zygote"]
    stderr_file, tee_lines, _ = text["zygote"]
    assert "RuntimeError: boom from rank 0" in stderr_file and "<string>" not in stderr_file
    assert any("RuntimeError: boom from rank 0" in ln for ln in tee_lines)


def test_stdout_of_worker_reaches_its_log_file_with_prefix(tmp_path, zygote_factory, capfd):
    z = zygote_factory()
    script = tmp_path / "hello.py"
    script.write_text("import os\nprint('hello', os.environ['RANK'])\n")
    cmd = python_command(PY, ("-u", str(script)))
    assert isinstance(cmd, PythonCommand)
    z2 = Zygote(("json",), cmd, ready_timeout=60)
    z2.start()
    try:
        logs = DefaultLogsSpecs(log_dir=str(tmp_path / "l"), tee=Std.OUT)
        pc, result = _run(z2, {0: ("-u", str(script)), 1: ("-u", str(script))}, _envs(2), logs,
                          log_line_prefixes={0: "[p0]:", 1: "[p1]:"})
        assert isinstance(pc, ZygoteContext) and not result.is_failed()
        assert Path(result.stdouts[1]).read_text() == "hello 1\n"
        out = capfd.readouterr().out.splitlines()
        assert "[p0]:hello 0" in out and "[p1]:hello 1" in out
    finally:
        z2.close()
    # the first zygote, never used, is unaffected by the second's close (its start was not
    # awaited: under load its imports can outlast the test's body)
    assert z.wait_ready(60) and z.state == "ready"


# ---------------------------------------------------------------- failure reports


@pytest.mark.parametrize("mode", ["fail", "fail-record"])
def test_failure_report_with_and_without_record(tmp_path, zygote_factory, mode):
    z = zygote_factory()
    reports = {}
    for kind, zyg in (("plain", None), ("zygote", z)):
        pc, result = _run(zyg, _args(1, mode, str(tmp_path)), _envs(1),
                          DefaultLogsSpecs(log_dir=str(tmp_path / kind)))
        failure = result.failures[0]
        assert failure.exitcode == 1
        has_file = os.path.isfile(failure.error_file)
        assert has_file == (mode == "fail-record")
        msg = failure.message if isinstance(failure.message, str) else failure.message["message"]
        reports[kind] = (has_file, re.sub(r"\d{6,}", "N", msg))
    assert reports["plain"] == reports["zygote"]
    assert "boom from rank 0" in reports["zygote"][1]


def _plain_and_zygote(tmp_path, z, mode):
    """Runs one worker of ``mode`` plainly and from zygote ``z``: ``{kind: (result, out dir)}``."""
    runs = {}
    for kind, zyg in (("plain", None), ("zygote", z)):
        out = tmp_path / kind
        out.mkdir()
        logs = DefaultLogsSpecs(log_dir=str(out / "logs"), redirects=Std.ALL)
        pc, result = _run(zyg, _args(1, mode, str(out)), _envs(1), logs)
        assert isinstance(pc, ZygoteContext) == (kind == "zygote")
        runs[kind] = (result, out)
    return runs


def test_a_failed_worker_ends_as_python_would_without_the_teardown(tmp_path, zygote_factory):
    """An uncaught exception: the zygote worker waits for its non-daemon threads, runs its
    atexit handlers and flushes stdout, as plain Python does, then exits 1 (skipping only the
    interpreter's teardown, which costs 0.7 s with torch loaded)."""
    seen = {}
    for kind, (result, out) in _plain_and_zygote(tmp_path, zygote_factory(), "fail-late").items():
        failure = result.failures[0]
        stdout = Path(result.stdouts[0]).read_text()
        stderr = Path(result.stderrs[0]).read_text()
        seen[kind] = (
            failure.exitcode,
            json.loads((out / "0.atexit").read_text()),
            sorted(stdout.splitlines()),
            stderr.strip().splitlines()[-1],
        )
    assert seen["plain"] == seen["zygote"]
    code, atexit_saw, stdout_lines, last_err = seen["zygote"]
    assert code == 1 and atexit_saw == {"thread_done": True}
    assert stdout_lines == ["thread of rank 0 finished", "unflushed output of rank 0"]
    assert last_err == "RuntimeError: late boom from rank 0"


@pytest.mark.parametrize("mode", ["end-late", "exit-late"])
def test_a_worker_that_ends_ends_as_python_would_without_the_teardown(tmp_path, zygote_factory,
                                                                      mode):
    """The end of the script, or ``sys.exit(message)``: the zygote worker waits for its
    non-daemon threads, runs its atexit handlers, flushes stdout and the files it left open
    and exits with Python's status (0; 1 with the message on stderr), as plain Python does,
    without the interpreter's teardown (where a gloo thread can abort or deadlock it)."""
    seen = {}
    for kind, (result, out) in _plain_and_zygote(tmp_path, zygote_factory(), mode).items():
        code = result.failures[0].exitcode if result.is_failed() else 0
        seen[kind] = (
            code,
            json.loads((out / "0.atexit").read_text()),
            sorted(Path(result.stdouts[0]).read_text().splitlines()),
            Path(result.stderrs[0]).read_text().strip().splitlines()[-1:],
            (out / "0.left_open").read_text(),
        )
    assert seen["plain"] == seen["zygote"]
    code, atexit_saw, stdout_lines, last_err, left_open = seen["zygote"]
    assert atexit_saw == {"thread_done": True}
    assert stdout_lines == ["thread of rank 0 finished", "unflushed output of rank 0"]
    assert left_open == "never flushed nor closed by rank 0\n"
    if mode == "end-late":
        assert code == 0 and last_err == []
    else:
        assert code == 1 and last_err == ["goodbye from rank 0"]


# ---------------------------------------------------------------- RNG, fallback, zygote death


def test_numpy_and_random_streams_differ_per_worker(tmp_path, monkeypatch, zygote_factory):
    pytest.importorskip("numpy", reason="!!! numpy is not installed: the reseed is untested")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # numpy's BLAS pool would be a thread
    z = zygote_factory(("numpy",))
    pc, result = _run(z, _args(4, "rng", str(tmp_path)), _envs(4), DefaultLogsSpecs())
    assert isinstance(pc, ZygoteContext) and not result.is_failed(), z.reason
    draws = [json.loads((tmp_path / f"{r}.rng").read_text()) for r in range(4)]
    assert {d["ppid"] for d in draws} == {z.pid}
    assert len({d["numpy"] for d in draws}) == 4
    assert len({d["random"] for d in draws}) == 4


@pytest.mark.parametrize("module,reason", [
    ("zygote_threaded_mod", ("2 threads", "preload-thread")),  # a fork copies one thread
    ("zygote_cuda_mod", ("initialised CUDA",)),  # a CUDA context is unusable after a fork
], ids=["thread", "cuda"])
def test_unfit_zygote_falls_back_with_its_one_line_reason(tmp_path, zygote_factory, caplog,
                                                          module, reason):
    caplog.set_level(logging.WARNING, logger="fastelastic.multiprocessing._zygote")
    z = zygote_factory((module,))
    out = tmp_path / "o"
    out.mkdir()
    pc, result = _run(z, _args(2, "dump", str(out)), _envs(2), DefaultLogsSpecs())
    assert not result.is_failed()
    assert z.state == "unusable" and all(x in z.reason for x in reason), z.reason
    for r in range(2):  # started plainly, and they ran
        assert json.loads((out / f"{r}.json").read_text())["ppid"] == os.getpid()
    lines = [r.getMessage() for r in caplog.records if reason[0] in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert wait_gone(z._proc.pid, 10)  # type: ignore[union-attr]


def test_failed_import_falls_back(tmp_path, zygote_factory):
    z = zygote_factory(("no_such_module_zygote_test",))
    pc, result = _run(z, _args(1, "exit", str(tmp_path), "0"), _envs(1), DefaultLogsSpecs())
    assert not result.is_failed()
    assert z.state == "unusable" and "ModuleNotFoundError" in z.reason


def test_killing_the_zygote_mid_job(tmp_path, zygote_factory, caplog):
    caplog.set_level(logging.WARNING, logger="fastelastic.multiprocessing._zygote")
    z = zygote_factory()
    pc, pids = _start_waiting(z, tmp_path / "o", 2)
    first = z.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    result = pc.wait(30)  # its workers die with it (parent-death signal) and are reported
    assert result is not None and result.is_failed()
    assert {f.exitcode for f in result.failures.values()} == {-signal.SIGKILL}
    assert all(wait_gone(p, 5) for p in pids)
    # a new zygote serves the next attempt
    out2 = tmp_path / "o2"
    out2.mkdir()
    pc2, result2 = _run(z, _args(2, "dump", str(out2)), _envs(2), DefaultLogsSpecs())
    assert isinstance(pc2, ZygoteContext) and not result2.is_failed()
    second = z.pid
    assert second is not None and second != first
    assert {json.loads((out2 / f"{r}.json").read_text())["ppid"] for r in range(2)} == {second}
    assert any("died" in r.getMessage() for r in caplog.records)


def test_worker_with_other_python_startup_env_starts_plainly(tmp_path, zygote_factory, caplog):
    caplog.set_level(logging.WARNING, logger="fastelastic.multiprocessing._zygote")
    z = zygote_factory()
    out = tmp_path / "o"
    out.mkdir()
    envs = _envs(2)
    envs[1]["PYTHONHASHSEED"] = "7"  # read at interpreter startup: a fork cannot give it
    pc, result = _run(z, _args(2, "dump", str(out)), envs, DefaultLogsSpecs())
    assert not result.is_failed()
    parents = [json.loads((out / f"{r}.json").read_text())["ppid"] for r in range(2)]
    assert parents == [z.pid, os.getpid()]
    assert any("PYTHONHASHSEED" in r.getMessage() for r in caplog.records)
    assert z.state == "ready"  # only that worker started plainly


def test_worker_states_and_signals_reach_zygote_workers(tmp_path, zygote_factory):
    """What the health check and the D-state check read works for zygote workers."""
    z = zygote_factory()
    pc, pids = _start_waiting(z, tmp_path / "o", 2)
    assert pc.pids() == {0: pids[0], 1: pids[1]}
    states = pc.worker_states()
    assert set(states) == {0, 1} and set(states.values()) <= {"sleeping", "running"}
    os.kill(pids[1], signal.SIGUSR1)  # what the watchdog does: signal the pid it was given
    assert pc.wait_any(30)
    result = pc.wait(30)
    assert result is not None and result.failures[1].exitcode == -signal.SIGUSR1
    assert pc.exitcodes()[1] == -signal.SIGUSR1


# ---------------------------------------------------------------- the agent's death


def _fastrun_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env["LOGLEVEL"] = "WARNING"
    env.update(extra)
    return env


def test_sigkill_of_the_agent_leaves_nothing_behind(tmp_path):
    proc = start_job(
        [PY, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "2", WORKER,
         "grandchild", str(tmp_path)],
        env=_fastrun_env(FASTELASTIC_PRELOAD="json"), stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        infos = [_wait_file(tmp_path / f"{r}.pid") for r in range(2)]
        zygotes = {i["ppid"] for i in infos}
        assert len(zygotes) == 1 and proc.pid not in zygotes  # FASTELASTIC_PRELOAD applied
        pids = [*zygotes, *(i["pid"] for i in infos), *(i["grandchild"] for i in infos)]
        assert all(is_alive(p) for p in pids)
        proc.kill()
        assert proc.wait(10) == -signal.SIGKILL
        survivors = [p for p in pids if not wait_gone(p, 10)]
        assert survivors == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_fastrun_restarts_the_group_from_a_new_zygote_when_it_is_killed(tmp_path):
    proc = start_job(
        [PY, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", "--preload", "json", WORKER, "wait-first", str(tmp_path)],
        env=_fastrun_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        first = [_wait_file(tmp_path / f"{r}.0.pid") for r in range(2)]
        zygotes = {i["ppid"] for i in first}
        assert len(zygotes) == 1 and proc.pid not in zygotes
        old = zygotes.pop()
        os.kill(old, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        second = [_wait_file(tmp_path / f"{r}.1.pid") for r in range(2)]
        parents = {i["ppid"] for i in second}
        assert len(parents) == 1 and parents.isdisjoint({old, proc.pid})  # a new zygote
        assert all(wait_gone(i["pid"], 5) for i in first)
        assert "died" in err and "starting a new one" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bad_preload_flag_is_one_line_exit_2():
    r = subprocess.run([PY, "-m", "fastelastic.run", "--preload", "torch;x", WORKER],
                       env=_fastrun_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "not a module name" in lines[0], r.stderr


def test_no_python_keeps_the_plain_path(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    r = subprocess.run(
        [PY, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "1", "--preload",
         "json", "--no-python", "sh", "-c", "echo ppid=$PPID"],
        env=_fastrun_env(), capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 0, r.stderr
    assert "--preload json ignored: the entrypoint 'sh' is not a Python interpreter" in r.stderr


# ---------------------------------------------------------------- torch


@pytest.mark.slow
@pytest.mark.torch
def test_ddp_example_restarts_from_the_torch_zygote(tmp_path):
    pytest.importorskip("torch", reason="!!! torch 2.13 is not installed: --preload torch untested")
    out, progress = tmp_path / "summary.json", tmp_path / "progress.jsonl"
    proc = start_job(  # ended with its zygote and workers if the test times out
        [PY, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", "--preload", "torch", str(REPO / "examples" / "ddp_train.py"), "--steps", "6",
         "--ckpt-every", "1", "--fail-at", "3", "--ckpt-dir", str(tmp_path / "ckpt"),
         "--out", str(out), "--progress", str(progress)],
        env=_fastrun_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    summary = json.loads(out.read_text())
    assert summary["restart_count"] == 1 and summary["resumed_from_step"] == 3
    events = [json.loads(ln) for ln in progress.read_text().splitlines()]
    parents = {e["ppid"] for e in events}
    # both attempts forked by the same zygote: one parent, not the agent
    assert len(parents) == 1 and proc.pid not in parents, events
    assert {(e["rank"], e["step"]) for e in events if e["restart"] == 1} == {
        (r, s) for r in range(2) for s in range(4, 7)
    }
    assert "plainly" not in err and "ignored" not in err


# ---------------------------------------------------------------- one owner, explicit states


def _live_zygotes() -> set[int]:
    """Live (not zombie) zygote processes whose parent is this process, from /proc."""
    found = set()
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if (int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X")
                and b"_zygote_boot.py" in cmdline):
            found.add(int(d))
    return found


def _wait_state(z, state: str, timeout: float = 60) -> None:
    with z._cond:
        assert z._cond.wait_for(lambda: z.state == state, timeout), z.state


def test_zygote_states_change_only_by_valid_transitions():
    from fastelastic.multiprocessing._zygote import ZygoteState

    cmd = python_command(PY, _args(1, "x")[0])
    z = Zygote(("json",), cmd, ready_timeout=60)
    assert z.state is ZygoteState.NEW and z.state == "new"
    with z._cond, pytest.raises(RuntimeError, match="new -> ready"):
        z._set_state(ZygoteState.READY)
    z.close()
    assert z.state is ZygoteState.CLOSED
    with z._cond, pytest.raises(RuntimeError, match="closed -> starting"):
        z._set_state(ZygoteState.STARTING)
    z.start()  # a closed zygote never starts
    assert z.state is ZygoteState.CLOSED and z.pid is None and not _live_zygotes()


def test_close_while_a_dead_zygote_is_replaced_leaves_none_alive(zygote_factory):
    """close() lands after the handle decided to replace a zygote that died and before the
    new one is launched: close() wins, and no zygote is alive once it returned."""
    z = zygote_factory()
    _wait_state(z, "ready")
    closer = threading.Thread(target=z.close)
    deciders: list[threading.Thread] = []

    class CloseNow(logging.Handler):
        def emit(self, record):
            if "starting a new one" in record.getMessage() and not deciders:
                deciders.append(threading.current_thread())
                closer.start()
                _wait_state(z, "closed", 10)  # then let the replacement go ahead

    log = logging.getLogger("fastelastic.multiprocessing._zygote")
    handler = CloseNow(level=logging.WARNING)
    log.addHandler(handler)
    try:
        first = z.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        assert wait_gone(first, 10)
        _wait_state(z, "closed", 30)
        closer.join(30)
        assert not closer.is_alive()
        assert deciders
        deciders[0].join(30)  # the thread that decided has done all it would do
        assert not deciders[0].is_alive()
        assert _live_zygotes() == set()
    finally:
        log.removeHandler(handler)
        for pid in _live_zygotes():
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def unreported_exit(tmp_path, zygote_factory, monkeypatch):
    """A zygote worker that died while its zygote is stopped (SIGSTOP): nobody can tell its
    exit status. Yields (context, the zygote, an Event set when the agent starts asking the
    zygote for the status)."""
    from fastelastic.multiprocessing import _zygote

    monkeypatch.setattr(_zygote, "_KILL_GRACE_S", 3.0)
    z = zygote_factory()
    asking = threading.Event()
    real = z.exit_status

    def exit_status(pid, timeout):
        asking.set()
        return real(pid, timeout)

    monkeypatch.setattr(z, "exit_status", exit_status)
    pc, (pid,) = _start_waiting(z, tmp_path / "o", 1)
    zpid = z.pid
    os.kill(zpid, signal.SIGSTOP)
    try:
        os.kill(pid, signal.SIGKILL)
        yield pc, asking
    finally:
        os.kill(zpid, signal.SIGCONT)
        pc.close()


def test_exit_codes_are_read_while_a_zygote_exit_is_awaited(unreported_exit):
    """The agent asks a stopped zygote for an exit status (blocks up to the grace period); the
    health check reading the exit codes meanwhile must not wait for it."""
    pc, asking = unreported_exit
    results: list = []
    waiter = threading.Thread(target=lambda: results.append(pc.wait(30)))
    waiter.start()
    try:
        assert asking.wait(30)
        t0 = time.monotonic()
        pc.exitcodes()
        pc.pids()
        assert time.monotonic() - t0 < 1.0  # not the 3 s the waiting thread may spend
    finally:
        waiter.join(30)
    assert results and results[0].is_failed()


def test_an_exit_status_nobody_reported_is_reported_unknown(unreported_exit):
    """Not a made-up exit code 1: a distinct code, and the failure says what is known."""
    from fastelastic.multiprocessing import errors

    pc, _ = unreported_exit
    result = pc.wait(30)
    failure = result.failures[0]
    assert failure.exitcode not in range(256)  # no exit status: not a real exit's code
    assert failure.exitcode == errors.EXITCODE_UNKNOWN
    assert "exit status" in failure.message and "unknown" in failure.message
    assert "zygote did not report" in failure.message
    assert pc.exitcodes()[0] is None


@pytest.mark.torch
@pytest.mark.parametrize("implied", ["1", "0"], ids=["default", "off"])
def test_preloading_torch_preloads_torch_dynamo(tmp_path, zygote_factory, monkeypatch, caplog,
                                                implied):
    """``--preload torch`` also preloads ``torch._dynamo``: every optimizer's constructor
    imports it, and it was the largest cost of a restart with ``--preload torch`` (4-6 s for
    4 workers on 2 cores). ``FASTELASTIC_PRELOAD_DYNAMO=0`` leaves it to the worker."""
    pytest.importorskip("torch", reason="!!! torch 2.13 is not installed: --preload torch untested")
    monkeypatch.setenv("FASTELASTIC_PRELOAD_DYNAMO", implied)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a thread-free torch import (README)
    caplog.set_level(logging.INFO, logger="fastelastic.multiprocessing._zygote")
    z = zygote_factory(("torch",))
    out = tmp_path / "o"
    out.mkdir()
    pc, result = _run(z, _args(1, "modules", str(out)), _envs(1), DefaultLogsSpecs())
    assert not result.is_failed(), result
    seen = json.loads((out / "0.json").read_text())
    assert seen["ppid"] != os.getpid(), z.reason  # forked by the zygote, not started plainly
    assert seen["torch"] is True
    assert seen["torch._dynamo"] is (implied == "1")
    ready = [r.getMessage() for r in caplog.records if "ready: imported" in r.getMessage()]
    assert len(ready) == 1 and ("(and torch._dynamo)" in ready[0]) is (implied == "1"), ready


@pytest.mark.torch
@pytest.mark.parametrize("script", ["no-torch", "torch"])
def test_a_torch_zygote_starts_workers_as_plain_python_would(tmp_path, monkeypatch,
                                                             zygote_factory, script):
    """With ``--preload torch`` (and so ``torch._dynamo``, whose import sets
    ``TORCHINDUCTOR_CACHE_DIR``) a script that never imports torch, and one that imports it and
    builds an optimizer, start with the argv, ``__main__``, ``sys.path[0]`` and environment a
    plain start gives them."""
    pytest.importorskip("torch", reason="!!! torch 2.13 is not installed: --preload torch untested")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a thread-free torch import (README)
    monkeypatch.delenv("FASTELASTIC_PRELOAD_DYNAMO", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    extra = {"FE_DUMP_THEN_TORCH": "1"} if script == "torch" else {}
    z = zygote_factory(("torch",))
    assert z.wait_ready(120) and z.state == "ready", z.reason
    dumps = {}
    for kind, zyg in (("plain", None), ("zygote", z)):
        out = tmp_path / kind
        out.mkdir()
        pc, result = _run(zyg, _args(1, "dump", str(out)), _envs(1, **extra),
                          DefaultLogsSpecs(log_dir=str(tmp_path / f"l{kind}")))
        assert result is not None and not result.is_failed(), result
        dumps[kind] = json.loads((out / "0.json").read_text())
    plain, forked = dumps["plain"], dumps["zygote"]
    assert forked["ppid"] == z.pid != plain["ppid"]  # really forked by it
    for d in (plain, forked):
        d.pop("pid"), d.pop("ppid")
        assert d["env"].pop("TORCHELASTIC_ERROR_FILE").endswith("/0/error.json")
    forked = json.loads(json.dumps(forked).replace(str(tmp_path / "zygote"),
                                                   str(tmp_path / "plain")))
    env_diff = {k: (plain["env"].get(k), forked["env"].get(k))
                for k in set(forked["env"]) | set(plain["env"])
                if forked["env"].get(k) != plain["env"].get(k)}
    assert env_diff == {}
    for key in ("argv", "orig_argv", "path", "file", "name", "main_is_globals", "cwd"):
        assert forked[key] == plain[key], key
