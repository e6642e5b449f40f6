"""Tests of start_processes / PContext: callables, binaries, failures, signals, stopping, logs."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import mpworkers
import pytest
from mphelpers import is_alive, open_fds, read_line, wait_gone

from fastelastic.errors import ChildFailedError
from fastelastic.multiprocessing import (
    DefaultLogsSpecs,
    MultiprocessContext,
    RunProcsResult,
    Std,
    SubprocessContext,
    start_processes,
)

pytestmark = pytest.mark.timeout(60)

PY = sys.executable


def _envs(n: int, **extra: str) -> dict[int, dict[str, str]]:
    return {r: {"LOCAL_RANK": str(r), **extra} for r in range(n)}


def _fifo_gate(tmp_path, name="gate"):
    path = str(tmp_path / name)
    os.mkfifo(path)
    return path, os.open(path, os.O_RDWR)  # O_RDWR never blocks; the worker reads it


# ---------------------------------------------------------------- callables


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_callable_return_values_by_local_rank(method, logs_dir):
    pc = start_processes(
        "trainer",
        mpworkers.double,
        {0: (1,), 1: (5,)},
        _envs(2, FOO="bar"),
        DefaultLogsSpecs(log_dir=logs_dir, redirects=Std.ALL),
        start_method=method,
    )
    assert isinstance(pc, MultiprocessContext) and set(pc.pids()) == {0, 1}
    result = pc.wait(30)
    assert isinstance(result, RunProcsResult) and not result.is_failed()
    assert result.return_values == {
        0: {"rank": 0, "value": 2, "env": "bar"},
        1: {"rank": 1, "value": 10, "env": "bar"},
    }
    with open(result.stdouts[1]) as f:
        assert f.read() == "out 5\n"
    with open(result.stderrs[0]) as f:
        assert f.read() == "err 1\n"


def test_callable_failure_is_recorded_and_formatted(logs_dir):
    pc = start_processes(
        "trainer",
        mpworkers.fail,
        {0: ("r0",)},
        _envs(1),
        DefaultLogsSpecs(log_dir=logs_dir, redirects=Std.ALL),
        start_method="fork",
    )
    result = pc.wait(30)
    assert result is not None and result.is_failed()
    failure = result.failures[0]
    assert failure.exitcode == 1 and failure.local_rank == 0 and failure.pid == pc.pids()[0]
    # function launches are wrapped with @record: the error file has the traceback
    assert failure.error_file.endswith("error.json")
    assert failure.message["message"] == "ValueError: boom from r0"
    err = ChildFailedError("trainer", {7: failure})
    text = str(err)
    assert "rank      : 7 (local_rank: 0)" in text
    assert "exitcode  : 1" in text and f"pid: {failure.pid}" in text
    assert 'raise ValueError(f"boom from {x}")' in text
    assert err.get_first_failure() == (7, failure)


def test_fork_worker_gets_own_group_and_default_signal_handlers():
    r, w = os.pipe()
    try:
        pc = start_processes(
            "g",
            mpworkers.report_pgid,
            {0: (w,)},
            _envs(1),
            DefaultLogsSpecs(log_dir=os.devnull),
            start_method="fork",
        )
        pid, pgid, handler = read_line(r, 10).split()
        assert int(pid) == int(pgid) == pc.pids()[0]
        assert handler == str(signal.SIG_DFL).encode()  # not the agent's raising handler
        assert not pc.wait(10).is_failed()
    finally:
        os.close(r)
        os.close(w)


def test_sys_exit_code_and_signal_death():
    pc = start_processes(
        "x",
        mpworkers.exit_code,
        {0: (0,), 1: (3,)},
        _envs(2),
        DefaultLogsSpecs(log_dir=os.devnull),
        start_method="fork",
    )
    result = pc.wait(30)
    assert set(result.failures) == {1} and result.failures[1].exitcode == 3
    pc = start_processes(
        "x",
        mpworkers.kill_self,
        {0: (signal.SIGSEGV,)},
        _envs(1),
        DefaultLogsSpecs(log_dir=os.devnull),
        start_method="fork",
    )
    failure = pc.wait(30).failures[0]
    assert failure.exitcode == -signal.SIGSEGV and failure.signal_name() == "SIGSEGV"
    assert "(SIGSEGV)" in str(ChildFailedError("x", {0: failure}))


@pytest.mark.parametrize("how", ["return", "exit", "raise"])
def test_spawned_worker_ends_as_python_would_without_the_teardown(tmp_path, logs_dir, how):
    """A spawned worker's end: its return value stored, its non-daemon threads joined, its
    atexit handlers run and the files it left open flushed, and its exit status Python's
    (0; 1 with ``sys.exit``'s message or the traceback on stderr), without the interpreter's
    teardown (where a gloo thread can abort or deadlock a worker that did not destroy its
    process group)."""
    n = 2 if how == "return" else 1  # a failure stops its siblings
    pc = start_processes(
        "x",
        mpworkers.end_late,
        {r: (str(tmp_path), how) for r in range(n)},
        _envs(n),
        DefaultLogsSpecs(log_dir=logs_dir, redirects=Std.ALL),
        start_method="spawn",
    )
    result = pc.wait(30)
    for r in range(n):
        assert json.loads((tmp_path / f"{r}.atexit").read_text()) == {"threads_left": []}
        left_open = (tmp_path / f"{r}.left_open").read_text()
        assert left_open == f"never flushed nor closed by rank {r}\n"
    if how == "return":
        assert not result.is_failed()
        assert result.return_values == {0: {"rank": 0}, 1: {"rank": 1}}
        return
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 1}
    with open(result.stderrs[0]) as f:
        err = f.read()
    if how == "exit":
        assert err == "goodbye from rank 0\n"
    else:
        assert err.startswith("Process x-0:\n") and "RuntimeError: late boom from rank 0" in err


# ---------------------------------------------------------------- binaries


def test_binary_success_and_args_stringified(logs_dir):
    pc = start_processes(
        "echo",
        "/bin/echo",
        {0: (1, [2, 3]), 1: ("a",)},
        _envs(2),
        DefaultLogsSpecs(log_dir=logs_dir, redirects=Std.OUT),
    )
    assert isinstance(pc, SubprocessContext)
    # torch's shape: handlers with a Popen in .proc, each a process-group leader
    assert {r: h.proc.pid for r, h in pc.subprocess_handlers.items()} == pc.pids()
    assert pc.subprocess_handlers[1].local_rank_id == 1
    result = pc.wait(30)
    assert not result.is_failed() and result.return_values == {0: None, 1: None}
    with open(result.stdouts[0]) as f:
        assert f.read() == "1 [2, 3]\n"


def test_binary_traceback_without_record_reaches_the_user(capfd, logs_dir, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("print('to stdout')\ndef f():\n    raise KeyError('no-record-here')\nf()\n")
    pc = start_processes(
        "plain",
        PY,
        {0: (script,), 1: ("-c", "import time; time.sleep(60)")},
        _envs(2),
        DefaultLogsSpecs(log_dir=logs_dir),
    )
    result = pc.wait(30)
    # as torch: rank 1, stopped because rank 0 failed, is listed too; rank 0 is the root cause
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 1, 1: -signal.SIGTERM}
    assert ChildFailedError("plain", result.failures).get_first_failure()[0] == 0
    failure = result.failures[0]
    assert failure.exitcode == 1 and failure.error_file == "<N/A>"
    assert "KeyError: 'no-record-here'" in failure.message
    assert "raise KeyError('no-record-here')" in failure.message
    text = str(ChildFailedError("plain", {0: failure}))
    assert "Traceback (most recent call last)" in text and "no-record-here" in text
    out, err = capfd.readouterr()
    # not redirected: the user still sees both streams on the console
    assert "to stdout" in out and "KeyError: 'no-record-here'" in err
    # ...and stderr was also captured to a file next to the error file
    with open(os.path.join(os.path.dirname(pc.error_files[0]), "stderr.log")) as f:
        assert "no-record-here" in f.read()
    assert not is_alive(pc.pids()[1])


def test_binary_killed_by_signal():
    pc = start_processes(
        "k",
        "/bin/sh",
        {
            0: (
                "-c",
                "kill -KILL $$",
            )
        },
        _envs(1),
        DefaultLogsSpecs(log_dir=os.devnull),
    )
    failure = pc.wait(30).failures[0]
    assert failure.exitcode == -9 and "Signal 9 (SIGKILL)" in failure.message


@pytest.mark.slow
def test_binary_with_torch_record_error_file(logs_dir):
    pytest.importorskip("torch", reason="!!! torch 2.13 is not installed: interop test skipped")
    script = (
        "from torch.distributed.elastic.multiprocessing.errors import record\n"
        "@record\ndef main():\n    raise RuntimeError('torch-recorded')\nmain()\n"
    )
    pc = start_processes("t", PY, {0: ("-c", script)}, _envs(1), DefaultLogsSpecs(log_dir=logs_dir))
    failure = pc.wait(60).failures[0]
    assert failure.error_file == pc.error_files[0]
    assert failure.message["message"] == "RuntimeError: torch-recorded"
    assert "torch-recorded" in failure.message["extraInfo"]["py_callstack"]


# ---------------------------------------------------------------- waiting


def test_wait_returns_the_moment_a_worker_fails(tmp_path):
    path, gate = _fifo_gate(tmp_path)
    try:
        pc = start_processes(
            "w",
            "/bin/sh",
            {0: ("-c", f"read x < {path}; exit 7"), 1: ("-c", "sleep 60")},
            _envs(2),
            DefaultLogsSpecs(log_dir=os.devnull),
        )
        assert pc.wait(0) is None
        assert pc.wait(0.05, period=5) is None  # period is not a sleep
        t0 = time.monotonic()
        os.write(gate, b"go\n")
        result = pc.wait(30, period=10)
        assert time.monotonic() - t0 < 2.0  # torch would sleep the 10 s period here
        assert result.failures[0].exitcode == 7
    finally:
        os.close(gate)


def test_wait_any_wakeup_and_fileno():
    r, w = os.pipe()
    try:
        pc = start_processes(
            "a",
            mpworkers.block_on_fd,
            {0: (r,), 1: (r,)},
            _envs(2),
            DefaultLogsSpecs(log_dir=os.devnull),
            start_method="fork",
        )
        assert pc.wait_any(0) is False
        woke = threading.Event()

        def waker():
            woke.set()
            pc.wakeup()

        threading.Thread(target=waker).start()
        assert woke.wait(5)
        assert pc.wait_any(20) is False  # woken, no exit
        os.write(w, b"\x00")  # one worker exits cleanly
        assert pc.wait_any(20) is True
        assert pc.wait(0) is None  # the other still runs
        assert pc.exitcodes() == {r_: 0 for r_, _ in pc.exitcodes().items()}
        assert len(pc.exitcodes()) == 1
        import select

        assert not select.select([pc.fileno()], [], [], 0)[0]
        os.write(w, b"\x00")
        assert select.select([pc.fileno()], [], [], 20)[0]
        result = pc.wait(20)
        assert not result.is_failed() and result.return_values == {0: None, 1: None}
    finally:
        os.close(r)
        os.close(w)


# ---------------------------------------------------------------- stopping


@pytest.mark.parametrize("ignore_term", [False, True])
def test_close_kills_grandchildren(ignore_term):
    r, w = os.pipe()
    try:
        pc = start_processes(
            "gc",
            mpworkers.spawn_grandchild,
            {0: (w, ignore_term)},
            _envs(1),
            DefaultLogsSpecs(log_dir=os.devnull),
            start_method="fork",
        )
        worker, grandchild = (int(x) for x in read_line(r, 10).split())
        assert worker == pc.pids()[0] and is_alive(grandchild)
        t0 = time.monotonic()
        pc.close(timeout=2)
        assert time.monotonic() - t0 < 4
        assert wait_gone(grandchild, 5) and not is_alive(worker)
    finally:
        os.close(r)
        os.close(w)


def test_close_escalates_to_sigkill(tmp_path):
    path, ready = _fifo_gate(tmp_path, "ready")
    script = f"trap '' TERM; echo ready > {path}; while :; do sleep 1; done"
    try:
        pc = start_processes(
            "s", "/bin/sh", {0: ("-c", script)}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
        )
        assert read_line(ready, 10) == b"ready\n"  # SIGTERM is ignored from now on
    finally:
        os.close(ready)
    t0 = time.monotonic()
    pc.close(timeout=0.3)
    elapsed = time.monotonic() - t0
    assert 0.25 <= elapsed < 3
    assert pc.exitcodes()[0] == -signal.SIGKILL
    assert not is_alive(pc.pids()[0]) and pc.stuck_pids == {}


def test_worker_states_reports_stopped_worker_and_close_still_ends_it():
    pc = start_processes(
        "st", "/bin/sleep", {0: ("60",)}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
    )
    pid = pc.pids()[0]
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    states = pc.worker_states()
    while states.get(0) != "stopped" and time.monotonic() < deadline:
        states = pc.worker_states()  # the stop is asynchronous; bounded re-check
    assert states == {0: "stopped"}
    pc.close(timeout=0.2)
    assert not is_alive(pid)


def test_worker_in_uninterruptible_sleep_is_reported(tmp_path):
    # a vfork parent waits for its child in D state (killable); the agent sees "disk-sleep"
    import shutil
    import subprocess

    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("!!! no C compiler: cannot build the D-state worker")
    src = tmp_path / "dstate.c"
    src.write_text(
        "#include <unistd.h>\nint main(void){if(vfork()==0){pause();_exit(0);}return 0;}\n"
    )
    subprocess.run([cc, "-o", str(tmp_path / "dstate"), str(src)], check=True)
    pc = start_processes(
        "d", str(tmp_path / "dstate"), {0: ()}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
    )
    deadline = time.monotonic() + 5
    states = pc.worker_states()
    while states.get(0) != "disk-sleep" and time.monotonic() < deadline:
        states = pc.worker_states()  # vfork happens right after exec; bounded re-check
    assert states == {0: "disk-sleep"}
    pid = pc.pids()[0]
    pc.close(timeout=0.2)  # SIGTERM is deferred in D state; the group SIGKILL ends it
    assert not is_alive(pid) and pc.stuck_pids == {}


def test_validation_errors():
    with pytest.raises(RuntimeError, match="envs"):
        start_processes(
            "v", "/bin/true", {0: (), 1: ()}, {0: {}}, DefaultLogsSpecs(log_dir=os.devnull)
        )
    with pytest.raises(ValueError, match="start_method"):
        start_processes(
            "v",
            mpworkers.double,
            {0: (1,)},
            {0: {}},
            DefaultLogsSpecs(log_dir=os.devnull),
            start_method="thread",
        )


def test_no_fd_leaks_across_runs(logs_dir):
    def run():
        pc = start_processes(
            "f",
            "/bin/sh",
            {0: ("-c", "echo x; echo y >&2"), 1: ("-c", "exit 2")},
            _envs(2),
            DefaultLogsSpecs(log_dir=logs_dir, tee=Std.ALL),
            duplicate_stdout_filters=["x"],
        )
        pc.wait(30)

    run()  # starts the guardian
    before = open_fds()
    threads = threading.active_count()
    for _ in range(3):
        run()
    assert open_fds() == before
    assert threading.active_count() == threads  # each context's pump thread has ended


# ---------------------------------------------------------------- logs


def test_redirect_tee_prefix_and_filters(capfd, logs_dir):
    script = "echo keep-1; echo drop-2; echo err-3 >&2; printf tail-no-newline"
    pc = start_processes(
        "tee",
        "/bin/sh",
        {0: ("-c", script), 1: ("-c", script)},
        _envs(2),
        DefaultLogsSpecs(log_dir=logs_dir, redirects={1: Std.ALL}, tee={0: Std.ALL}),
        log_line_prefixes={0: "[pfx0]:"},
        duplicate_stdout_filters=["keep"],
    )
    result = pc.wait(30)
    assert not result.is_failed()
    out, err = capfd.readouterr()
    # rank 0 tee'd with its prefix; rank 1 only redirected: nothing on the console
    assert out.splitlines() == ["[pfx0]:keep-1", "[pfx0]:drop-2", "[pfx0]:tail-no-newline"]
    assert err.splitlines() == ["[pfx0]:err-3"]
    for rank in (0, 1):
        with open(result.stdouts[rank]) as f:
            assert f.read() == "keep-1\ndrop-2\ntail-no-newline"
        with open(result.stderrs[rank]) as f:
            assert f.read() == "err-3\n"
    attempt_dir = os.path.dirname(os.path.dirname(result.stdouts[0]))
    with open(os.path.join(attempt_dir, "filtered_stdout.log")) as f:
        assert f.read() == "[pfx0]:keep-1\n"


def test_default_tee_header_and_local_ranks_filter(capfd, logs_dir):
    pc = start_processes(
        "hdr",
        "/bin/sh",
        {0: ("-c", "echo a"), 1: ("-c", "echo b; echo c >&2")},
        _envs(2),
        DefaultLogsSpecs(log_dir=logs_dir, tee=Std.ALL, local_ranks_filter={0}),
    )
    assert not pc.wait(30).is_failed()
    out, err = capfd.readouterr()
    assert out == "[hdr0]:a\n" and err == ""


def test_wait_after_close_reports_the_stopped_workers():
    pc = start_processes(
        "c", "/bin/sleep", {0: ("60",), 1: ("60",)}, _envs(2), DefaultLogsSpecs(log_dir=os.devnull)
    )
    pc.close(timeout=5)
    t0 = time.monotonic()
    result = pc.wait(10)
    assert time.monotonic() - t0 < 1
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: -15, 1: -15}
    pc.close()  # idempotent


@pytest.mark.slow
def test_close_from_another_thread_ends_a_blocked_wait():
    pc = start_processes(
        "t", "/bin/sleep", {0: ("60",)}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
    )
    out: list = []
    started = threading.Event()

    def agent_loop():
        started.set()
        out.append(pc.wait_any(None))  # blocks until an exit or close()

    t = threading.Thread(target=agent_loop)
    t.start()
    assert started.wait(5)
    pc.close(timeout=5)
    t.join(10)
    assert not t.is_alive()
    assert pc.exitcodes() == {0: -signal.SIGTERM}


def test_start_installs_torch_signal_handlers(monkeypatch):
    from fastelastic.errors import SignalException

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR2)}
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR2,SIGNOPE")
    try:
        pc = start_processes(
            "h", "/bin/true", {0: ()}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
        )
        with pytest.raises(SignalException) as info:
            os.kill(os.getpid(), signal.SIGUSR2)
            for _ in range(1000):  # the handler runs at the next bytecode boundary
                pass
        assert info.value.sigval == signal.SIGUSR2
        assert signal.getsignal(signal.SIGTERM) == saved[signal.SIGTERM]  # not in the list
        assert not pc.wait(10).is_failed()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_exit_lost_to_a_signal_handler_is_recovered():
    # simulate a handler raising right after the monitor reported (and forgot) an exit
    pc = start_processes(
        "l",
        "/bin/sh",
        {0: ("-c", "exit 4"), 1: ("-c", "sleep 60")},
        _envs(2),
        DefaultLogsSpecs(log_dir=os.devnull),
    )
    monitor = pc._monitor
    lost = []
    deadline = time.monotonic() + 10
    while not lost and time.monotonic() < deadline:
        lost = monitor.wait(deadline - time.monotonic())  # what _collect would have recorded
    assert lost == [(pc.pids()[0], 4)]
    result = pc.wait(10)
    assert result.failures[0].exitcode == 4


def test_worker_surviving_sigkill_is_reported_not_waited_for(monkeypatch, tmp_path):
    # An unkillable (D-state) worker cannot be produced here; make SIGKILL not arrive instead.
    from fastelastic.multiprocessing._guardian import guardian
    from fastelastic.multiprocessing._pcontext import PContext

    real = PContext._signal_group
    monkeypatch.setattr(
        PContext,
        "_signal_group",
        lambda self, rank, sig: None if sig == signal.SIGKILL else real(self, rank, sig),
    )
    monkeypatch.setenv("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "0.2")
    path, ready = _fifo_gate(tmp_path, "ready")
    script = f"trap '' TERM; echo ready > {path}; exec sleep 60"
    try:
        pc = start_processes(
            "u", "/bin/sh", {0: ("-c", script)}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
        )
        assert read_line(ready, 10) == b"ready\n"
    finally:
        os.close(ready)
    pid = pc.pids()[0]
    try:
        t0 = time.monotonic()
        pc.close(timeout=0.1)
        assert time.monotonic() - t0 < 3  # did not wait for the survivor
        assert pc.stuck_pids == {0: "sleeping"}
        assert is_alive(pid)
    finally:
        os.killpg(pid, signal.SIGKILL)
        pc.subprocess_handlers[0].proc.wait(10)
        guardian.unregister(pid)  # close() left the survivor registered; it is gone now


# ---------------------------------------------------------------- failures as torch lists them

_SIBLINGS_ARGS = {0: ("-c", "exit 3"), 1: ("-c", "exec sleep 60"), 2: ("-c", "exec sleep 60")}


def _binary_failures(start, logs_specs):
    pc = start("sib", "/bin/sh", _SIBLINGS_ARGS, _envs(3), logs_specs)
    try:
        result = pc.wait(30, period=0.05)
    finally:
        pc.close()
    return result


def test_binary_failure_lists_the_stopped_siblings_as_torch(tmp_path):
    ours = _binary_failures(start_processes, DefaultLogsSpecs(log_dir=str(tmp_path / "ours")))
    expected = {0: 3, 1: -signal.SIGTERM, 2: -signal.SIGTERM}
    assert {r: f.exitcode for r, f in ours.failures.items()} == expected
    assert list(ours.failures)[0] == 0  # the root cause first
    assert ChildFailedError("sib", ours.failures).get_first_failure()[0] == 0
    assert ours.failures[0].timestamp <= min(f.timestamp for f in ours.failures.values())
    try:
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs as TorchLogs
        from torch.distributed.elastic.multiprocessing import start_processes as torch_start
    except ImportError:  # pragma: no cover - CI installs torch
        pytest.skip("!!! torch is not installed: the failures are not compared with torch's")
    theirs = _binary_failures(torch_start, TorchLogs(log_dir=str(tmp_path / "torch")))
    assert {r: f.exitcode for r, f in theirs.failures.items()} == expected


def test_root_cause_is_the_first_failure_when_a_stopped_sibling_writes_an_error_file(tmp_path):
    """A sibling that records an error while being stopped (later) never hides the root cause."""
    sibling = tmp_path / "sibling.py"
    sibling.write_text(
        "import signal, sys, time\n"
        "from fastelastic.multiprocessing.errors import record\n"
        "def stop(*_):\n"
        "    time.sleep(1.1)  # its error file is stamped at least a second after the failure\n"
        "    raise RuntimeError('stopped by the agent')\n"
        "@record\n"
        "def main():\n"
        "    signal.signal(signal.SIGTERM, stop)\n"
        "    open(sys.argv[1], 'w').close()\n"
        "    time.sleep(60)\n"
        "main()\n"
    )
    ready = tmp_path / "ready"
    root = ("import os, sys, time\n"
            "deadline = time.monotonic() + 30\n"  # fail once the sibling handles SIGTERM
            "while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:\n"
            "    time.sleep(0.01)\n"
            "sys.exit(5)\n")
    pc = start_processes(
        "rc", PY, {0: ("-c", root, ready), 1: (sibling, ready)},
        {r: {**e, "PYTHONPATH": os.pathsep.join(sys.path)} for r, e in _envs(2).items()},
        DefaultLogsSpecs(log_dir=str(tmp_path / "logs")),
    )
    result = pc.wait(30)
    assert {r: f.exitcode for r, f in result.failures.items()} == {0: 5, 1: 1}
    assert result.failures[1].error_file != "<N/A>"  # the sibling's @record wrote its file
    assert result.failures[1].timestamp > result.failures[0].timestamp
    rank, root = ChildFailedError("rc", result.failures).get_first_failure()
    assert rank == 0 and root.exitcode == 5


def test_function_failure_lists_only_the_failed_as_torch():
    """torch's MultiprocessContext reports the failed process only, not the stopped ones."""
    fail_r, fail_w = os.pipe()
    block_r, block_w = os.pipe()
    os.write(fail_w, b"\x04")
    try:
        pc = start_processes(
            "fn", mpworkers.block_on_fd, {0: (fail_r,), 1: (block_r,)}, _envs(2),
            DefaultLogsSpecs(log_dir=os.devnull), start_method="fork",
        )
        result = pc.wait(30)
        assert {k: f.exitcode for k, f in result.failures.items()} == {0: 4}
        # rank 1 was stopped (SIGTERM, or SIGKILL when a loaded machine outlasts the grace
        # period), and is not listed
        assert pc.exitcodes()[1] in (-signal.SIGTERM, -signal.SIGKILL)
    finally:
        for fd in (fail_r, fail_w, block_r, block_w):
            os.close(fd)


@pytest.mark.parametrize("kind", ["context", "torch"])
def test_forked_workers_do_not_inherit_the_agents_signal_handlers(kind):
    """A process forked from the agent starts with a fresh interpreter's dispositions at once,
    not the agent's handler that turns SIGTERM into a SignalException: a fork-started function
    worker stopped before its own setup would otherwise exit 1 from multiprocessing's
    bootstrap instead of dying of SIGTERM."""
    from fastelastic.multiprocessing._pcontext import StopSignals, _terminate_process_handler

    handler = StopSignals(lambda: None).handler if kind == "context" else (
        _terminate_process_handler)
    stops = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    before = {s: signal.getsignal(s) for s in stops}
    r, w = os.pipe()
    try:
        for s in stops:
            signal.signal(s, handler)
        pid = os.fork()
        if pid == 0:  # the child's first statements: report, then leave without cleanup
            try:
                os.write(w, json.dumps(mpworkers.signal_dispositions()).encode())
            finally:
                os._exit(0)
    finally:
        for s, h in before.items():
            signal.signal(s, h)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        seen = json.loads(f.read())
    os.waitpid(pid, 0)
    assert seen == {"SIGTERM": "default", "SIGINT": "keyboard-interrupt", "SIGHUP": "default",
                    "SIGQUIT": "default"}


def test_a_context_starting_in_another_thread_does_not_swallow_the_main_threads_signal(
    monkeypatch,
):
    """Signal state belongs to a context, not to the process: a context starting its workers
    in another thread (its bookkeeping must not be cut in half) never holds back a stop
    signal meant for the main thread, whose handler raises it at once."""
    from fastelastic.errors import SignalException
    from fastelastic.multiprocessing._guardian import guardian

    saved = signal.getsignal(signal.SIGUSR2)
    monkeypatch.setenv("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGUSR2")
    main_pc = start_processes(
        "m", "/bin/true", {0: ()}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)
    )  # installs the handler
    entered, release = threading.Event(), threading.Event()
    real_register = guardian.register

    def register(pid):  # the other thread is now inside its bookkeeping of a worker
        real_register(pid)
        if threading.current_thread() is not threading.main_thread():
            entered.set()
            release.wait(30)

    monkeypatch.setattr(guardian, "register", register)
    other: list = []

    def start_elsewhere():
        try:
            other.append(start_processes(
                "o", "/bin/true", {0: ()}, _envs(1), DefaultLogsSpecs(log_dir=os.devnull)))
        except BaseException as e:  # noqa: BLE001 - inspected below
            other.append(e)

    t = threading.Thread(target=start_elsewhere)
    t.start()
    try:
        assert entered.wait(30)
        with pytest.raises(SignalException) as info:
            os.kill(os.getpid(), signal.SIGUSR2)
            threading.Event().wait(5)  # the handler runs (and raises) during this wait
        assert info.value.sigval == signal.SIGUSR2
    finally:
        release.set()
        t.join(30)
        signal.signal(signal.SIGUSR2, saved)
    assert len(other) == 1 and not isinstance(other[0], BaseException), other
    assert not other[0].wait(10).is_failed()
    assert not main_pc.wait(10).is_failed()
