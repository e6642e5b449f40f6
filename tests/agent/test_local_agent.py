"""LocalElasticAgent end to end: real workers, the real static rendezvous and store, signals."""

from __future__ import annotations

import http.client
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import agent_workers
import pytest
from agent_testlib import owned

from fastelastic import events
from fastelastic.agent.server import WorkerSpec, WorkerState
from fastelastic.agent.server.local_elastic_agent import LocalElasticAgent
from fastelastic.multiprocessing import DefaultLogsSpecs
from fastelastic.multiprocessing.errors import ChildFailedError
from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = os.path.join(HERE, "agent_workers.py")
AGENT_MAIN = os.path.join(HERE, "agent_main.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def static(rank: int = 0, world: int = 1, port: int | None = None, run_id: str = "agent-test"):
    return owned(get_rendezvous_handler(
        RendezvousParameters(
            backend="static",
            endpoint=f"127.0.0.1:{port or free_port()}",
            run_id=run_id,
            min_nodes=world,
            max_nodes=world,
            rank=rank,
            timeout=60,
        )
    ))


def binary_spec(*args, nproc=2, max_restarts=0, role="trainer", **kw):
    return WorkerSpec(
        role=role,
        local_world_size=nproc,
        rdzv_handler=static(),
        entrypoint=sys.executable,
        args=(WORKERS, *args),
        max_restarts=max_restarts,
        **kw,
    )


def make_agent(spec, tmp_path, **kw):
    kw.setdefault("exit_barrier_timeout", 10)
    return LocalElasticAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), **kw)


def wait_until(cond, limit=30.0):
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in (
        "TORCH_ELASTIC_WORKER_IDENTICAL",
        "FASTELASTIC_WORKER_IDENTICAL",
        "TORCHELASTIC_HEALTH_CHECK_PORT",
        "TORCHELASTIC_ENABLE_FILE_TIMER",
        "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_callable_entrypoint_env_and_return_values(tmp_path, monkeypatch, start_method):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=static(run_id="cb"),
        entrypoint=agent_workers.env_worker,
        args=("tag${local_rank}",),
    )
    result = make_agent(spec, tmp_path, start_method=start_method).run()
    assert result.state == WorkerState.SUCCEEDED and not result.is_failed()
    assert sorted(result.return_values) == [0, 1]
    for rank, env in result.return_values.items():
        assert env["tag"] == f"tag{rank}"
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1"
        assert env["ROLE_NAME"] == "trainer" and env["TORCHELASTIC_RUN_ID"] == "cb"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RESTART_COUNT"] == "0" and env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"/attempt_0/{rank}/error.json")
        assert env["OMP_NUM_THREADS"] == "3" and env["CUDA_VISIBLE_DEVICES"] == "4,5"


def test_binary_entrypoint_and_virtual_local_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "6,7")
    out = tmp_path / "env"
    out.mkdir()
    spec = binary_spec("env", str(out), "${local_rank}", virtual_local_rank=True)
    result = make_agent(spec, tmp_path).run()
    assert result.state == WorkerState.SUCCEEDED
    envs = {int(p.stem): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(envs) == [0, 1]
    for rank, env in envs.items():
        assert env["tag"] == str(rank)  # ${local_rank} substituted in the binary's args
        assert env["LOCAL_RANK"] == "0" and env["CUDA_VISIBLE_DEVICES"] == ["6", "7"][rank]


def test_callable_failure_shows_traceback_without_record(tmp_path):
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=static(),
        entrypoint=agent_workers.failing_worker,
        max_restarts=0,
    )
    result = make_agent(spec, tmp_path).run()
    assert result.is_failed() and list(result.failures) == [1]
    failure = result.failures[1]
    assert failure.exitcode != 0
    report = str(ChildFailedError("trainer", result.failures))
    assert "worker one is unhappy" in report, report


def test_binary_failure_shows_traceback_without_record(tmp_path):
    result = make_agent(binary_spec("raise", nproc=1), tmp_path).run()
    assert result.is_failed() and list(result.failures) == [0]
    assert result.failures[0].exitcode == 1
    report = str(ChildFailedError("trainer", result.failures))
    assert "ZeroDivisionError" in report, report


def test_restarts_increase_restart_count(tmp_path):
    logdir = tmp_path / "runs"
    logdir.mkdir()
    agent = make_agent(binary_spec("fail_until", "2", str(logdir), max_restarts=3), tmp_path)
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED and agent.restart_count == 2
    assert sorted(p.name for p in logdir.iterdir()) == [
        "r0_0",
        "r0_1",
        "r0_2",
        "r1_0",
        "r1_1",
        "r1_2",
    ]
    pids = {p.read_text() for p in logdir.iterdir()}
    assert len(pids) == 6  # every attempt ran fresh processes


def test_failure_after_restarts_exhausted(tmp_path):
    agent = make_agent(binary_spec("exit", "5", max_restarts=1), tmp_path)
    result = agent.run()
    assert result.is_failed() and agent.restart_count == 1
    # a rank stopped before its own exit 5 is listed with -15, as torch lists it
    assert {f.exitcode for f in result.failures.values()} <= {5, -signal.SIGTERM}
    assert ChildFailedError("exit", result.failures).get_first_failure()[1].exitcode == 5


def get_health(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_health_endpoint_reports_workers(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("TORCHELASTIC_HEALTH_CHECK_PORT", str(port))
    monkeypatch.setenv("FASTELASTIC_HEALTH_CHECK_ADDR", "127.0.0.1")
    flag = tmp_path / "flag"
    agent = make_agent(binary_spec("pidwait", str(tmp_path), str(flag)), tmp_path)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", agent.run()))
    t.start()
    try:
        assert wait_until(lambda: (tmp_path / "pid0").exists() and (tmp_path / "pid1").exists())
        code, body = get_health(port)
        assert code == 200 and body["healthy"] and body["state"] == "HEALTHY"
        assert body["restart_count"] == 0 and isinstance(body["last_progress_time"], int)
        pids = sorted(w["pid"] for w in body["workers"])
        assert pids == sorted(int((tmp_path / f"pid{i}").read_text()) for i in range(2))
        assert all(w["state"] != "EXITED" for w in body["workers"])
    finally:
        flag.touch()
        t.join(60)
    assert box["r"].state == WorkerState.SUCCEEDED
    with pytest.raises(OSError):
        get_health(port)


def run_agent_proc(cfg, **kw):
    return subprocess.Popen(
        [sys.executable, AGENT_MAIN, json.dumps(cfg)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=HERE,
        **kw,
    )


def result_of(out: str) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert lines, out
    return json.loads(lines[-1][7:])


def test_heterogeneous_roles_three_agents(tmp_path):
    out = tmp_path / "env"
    out.mkdir()
    port = free_port()
    layout = [("trainer", 2), ("ps", 1), ("trainer", 3)]
    procs = [
        run_agent_proc(
            {
                "port": port,
                "rank": i,
                "world": 3,
                "role": role,
                "nproc": n,
                "args": ["env", str(out), "${local_rank}"],
                "log_dir": str(tmp_path / f"logs{i}"),
            }
        )
        for i, (role, n) in enumerate(layout)
    ]
    outs = [p.communicate(timeout=90) for p in procs]
    for (stdout, stderr), p in zip(outs, procs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
        assert result_of(stdout)["state"] == "SUCCEEDED"
    envs = {int(p.stem): json.loads(p.read_text()) for p in out.iterdir()}
    assert sorted(envs) == list(range(6))
    expected = {  # rank: (group rank, role, role rank, role world size, local rank)
        0: (0, "trainer", 0, 5, 0),
        1: (0, "trainer", 1, 5, 1),
        2: (1, "ps", 0, 1, 0),
        3: (2, "trainer", 2, 5, 0),
        4: (2, "trainer", 3, 5, 1),
        5: (2, "trainer", 4, 5, 2),
    }
    for rank, (group, role, role_rank, role_ws, local) in expected.items():
        env = envs[rank]
        assert (
            int(env["GROUP_RANK"]),
            env["ROLE_NAME"],
            int(env["ROLE_RANK"]),
            int(env["ROLE_WORLD_SIZE"]),
            int(env["LOCAL_RANK"]),
        ) == (group, role, role_rank, role_ws, local)
        assert env["WORLD_SIZE"] == "6" and env["GROUP_WORLD_SIZE"] == "3"


def test_log_line_prefix_with_hostname(tmp_path):
    p = run_agent_proc(
        {
            "port": free_port(),
            "rank": 0,
            "world": 1,
            "nproc": 1,
            "args": ["raise"],
            "tee": 3,
            "prefix": "[${role_name}|${rank}|${local_rank}|${hostname}]:",
        }
    )
    stdout, stderr = p.communicate(timeout=60)
    assert result_of(stdout)["state"] == "FAILED"
    assert f"[trainer|0|0|{socket.gethostname()}]:about to fail" in stdout + stderr, stdout + stderr


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_signal_to_agent_leaves_no_worker(tmp_path, sig):
    flag = tmp_path / "never"
    p = run_agent_proc(
        {
            "port": free_port(),
            "rank": 0,
            "world": 1,
            "nproc": 2,
            "args": ["pidwait", str(tmp_path), str(flag)],
        }
    )
    try:
        assert wait_until(lambda: all((tmp_path / f"pid{i}").exists() for i in range(2)))
        pids = [int((tmp_path / f"pid{i}").read_text()) for i in range(2)]
        assert all(pid_alive(x) for x in pids)
        p.send_signal(sig)
        p.communicate(timeout=60)
        assert wait_until(lambda: not any(pid_alive(x) for x in pids), 20), "a worker survived"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_unmodified_torch_gloo_script_four_workers(tmp_path):
    pytest.importorskip("torch", reason="!!! torch 2.13 is required for the gloo test")
    agent = make_agent(binary_spec("gloo", nproc=4), tmp_path)
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED, result.failures


class _Collect(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[dict] = []

    def emit(self, record):
        self.records.append(json.loads(record.getMessage()))


def test_watchdog_kill_is_recorded_and_fails_the_group(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ENABLE_FILE_TIMER", "1")
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    sink = _Collect()
    events.register_handler("agent-test-watchdog", sink, replace=True)
    try:
        spec = binary_spec(
            "timer", str(tmp_path / "never"), nproc=1, event_log_handler="agent-test-watchdog"
        )
        agent = make_agent(spec, tmp_path)
        start = time.monotonic()
        result = agent.run()
        elapsed = time.monotonic() - start
    finally:
        events.unregister_handler("agent-test-watchdog")
    assert result.is_failed() and result.failures[0].exitcode == -signal.SIGKILL
    assert elapsed < 20, f"the stuck worker was not killed by the watchdog ({elapsed:.1f}s)"
    names = [r["name"] for r in sink.records]
    assert "kill worker process" in names, names
    kill = next(r for r in sink.records if r["name"] == "kill worker process")
    assert json.loads(kill["metadata"]["metadata"])["worker_pid"] == str(result.failures[0].pid)
    states = [
        r["metadata"]["state"] for r in sink.records if r["name"].startswith("torchelastic.worker")
    ]
    assert "START" in states and "FAILED" in states


def test_failed_node_releases_healthy_node_from_exit_barrier(tmp_path):
    port = free_port()
    ok = run_agent_proc(
        {"port": port, "rank": 0, "world": 2, "args": ["exit", "0"], "exit_barrier_timeout": 120}
    )
    bad = run_agent_proc(
        {"port": port, "rank": 1, "world": 2, "args": ["exit", "4"], "exit_barrier_timeout": 120}
    )
    start = time.monotonic()
    ok_out, ok_err = ok.communicate(timeout=60)
    elapsed = time.monotonic() - start
    bad_out, _ = bad.communicate(timeout=60)
    assert result_of(ok_out)["state"] == "SUCCEEDED", ok_err[-2000:]
    assert result_of(bad_out)["state"] == "FAILED"
    assert elapsed < 30, f"healthy agent waited {elapsed:.1f}s in the exit barrier"
    assert "the agent of group_rank 1 failed" in ok_err


def test_new_node_triggers_restart_with_bigger_world(tmp_path):
    """c10d rendezvous: a second node joining makes the running agent restart (not a retry)."""
    port = free_port()
    base = {
        "port": port,
        "world": 2,
        "min": 1,
        "backend": "c10d",
        "run_id": "grow",
        "args": ["elastic", str(tmp_path), "2"],
        "max_restarts": 1,
    }
    first = run_agent_proc(
        {**base, "rank": 0, "rdzv_conf": {"is_host": True, "last_call_timeout": 1}}
    )
    second = None
    try:
        assert wait_until(lambda: (tmp_path / "0_1").exists(), 40), "first round never started"
        second = run_agent_proc(
            {**base, "rank": 1, "rdzv_conf": {"is_host": False, "last_call_timeout": 1}}
        )
        out1, err1 = first.communicate(timeout=60)
        out2, err2 = second.communicate(timeout=60)
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)
    r1, r2 = result_of(out1), result_of(out2)
    assert r1["state"] == r2["state"] == "SUCCEEDED", err1[-3000:] + err2[-3000:]
    assert r1["restart_count"] == 0  # a membership change does not use a retry
    assert {"0_2", "1_2"} <= {p.name for p in tmp_path.iterdir()}


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_handled_signal_is_forwarded_to_workers(tmp_path, sig):
    p = run_agent_proc(
        {"port": free_port(), "rank": 0, "world": 1, "nproc": 2, "args": ["sigwait", str(tmp_path)]}
    )
    try:
        assert wait_until(lambda: all((tmp_path / f"pid{i}").exists() for i in range(2)))
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
        assert p.returncode != 0  # the agent re-raises the signal as SignalException
        for i in range(2):
            assert (tmp_path / f"sig{i}").read_text() == sig.name, err[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


def test_uninterruptible_state_policy(tmp_path, monkeypatch):
    """D-state cannot be produced unprivileged, so the process context's report is stubbed."""
    monkeypatch.setenv("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "0.000001")
    agent = make_agent(binary_spec("exit", "0", max_restarts=3), tmp_path)
    wg = agent.get_worker_group()
    states = {0: "disk-sleep", 1: "sleeping"}
    agent._pcontext = types.SimpleNamespace(
        worker_states=lambda: dict(states), pids=lambda: {0: 101, 1: 102}
    )
    assert agent._check_uninterruptible_state_timeout(wg, 0.000001) is None  # first sighting
    states[0] = "sleeping"
    assert agent._check_uninterruptible_state_timeout(wg, 0.000001) is None  # left D-state
    assert agent._uninterruptible_state_first_seen == {}
    states[0] = "disk-sleep"
    assert agent._check_uninterruptible_state_timeout(wg, 0.000001) is None
    result = agent._check_uninterruptible_state_timeout(wg, 0.000001)
    assert result is not None and result.state == WorkerState.UNHEALTHY
    assert agent._remaining_restarts == 0  # a wedged worker disables restarts
    monkeypatch.setenv("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "bogus")
    assert make_agent(binary_spec("exit", "0"), tmp_path)._uninterruptible_state_timeout == 0.0


def test_killed_agent_releases_exit_barrier(tmp_path):
    """A peer agent SIGKILLed mid-run: the store server releases the barrier for the others."""
    port = free_port()
    ok = run_agent_proc(
        {"port": port, "rank": 0, "world": 2, "args": ["exit", "0"], "exit_barrier_timeout": 120}
    )
    doomed = run_agent_proc(
        {
            "port": port,
            "rank": 1,
            "world": 2,
            "args": ["pidwait", str(tmp_path), str(tmp_path / "never")],
            "exit_barrier_timeout": 120,
        }
    )
    try:
        assert wait_until(lambda: (tmp_path / "pid0").exists())
        worker = int((tmp_path / "pid0").read_text())
        start = time.monotonic()
        doomed.kill()
        doomed.wait(30)
        ok_out, ok_err = ok.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        for p in (ok, doomed):
            if p.poll() is None:
                p.kill()
                p.wait(10)
    assert result_of(ok_out)["state"] == "SUCCEEDED", ok_err[-2000:]
    assert elapsed < 30, f"healthy agent waited {elapsed:.1f}s for a dead peer"
    assert "group_rank 1 disconnected" in ok_err, ok_err[-2000:]
    assert wait_until(lambda: not pid_alive(worker), 20), "the dead agent's worker survived"


def test_health_endpoint_answers_during_rendezvous(tmp_path, monkeypatch):
    hport, port = free_port(), free_port()
    monkeypatch.setenv("TORCHELASTIC_HEALTH_CHECK_PORT", str(hport))
    monkeypatch.setenv("FASTELASTIC_HEALTH_CHECK_ADDR", "127.0.0.1")
    spec = WorkerSpec(
        role="trainer",
        local_world_size=1,
        rdzv_handler=static(0, 2, port=port, run_id="t"),  # agent_main uses run_id "t"
        entrypoint=sys.executable,
        args=(WORKERS, "exit", "0"),
        max_restarts=0,
    )
    agent = make_agent(spec, tmp_path)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("r", agent.run()))
    t.start()
    peer = None
    try:

        def answered():
            try:
                return get_health(hport)
            except OSError:
                return None

        assert wait_until(lambda: answered() is not None), "no health server during rendezvous"
        code, body = get_health(hport)
        assert code == 200 and body["state"] == "INIT" and body["workers"][0]["pid"] is None
        env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_HEALTH_CHECK_PORT"}
        peer = run_agent_proc({"port": port, "rank": 1, "world": 2, "args": ["exit", "0"]}, env=env)
        out, err = peer.communicate(timeout=60)
        assert result_of(out)["state"] == "SUCCEEDED", err[-2000:]
    finally:
        t.join(60)
        if peer is not None and peer.poll() is None:
            peer.kill()
            peer.wait(10)
    assert box["r"].state == WorkerState.SUCCEEDED


def test_stop_kills_grandchildren(tmp_path):
    p = run_agent_proc(
        {
            "port": free_port(),
            "rank": 0,
            "world": 1,
            "nproc": 2,
            "args": ["grandchild", str(tmp_path)],
        }
    )
    try:
        assert wait_until(lambda: all((tmp_path / f"pids{i}").exists() for i in range(2)))
        pids = [int(x) for i in range(2) for x in (tmp_path / f"pids{i}").read_text().split()]
        assert len(pids) == 4 and all(pid_alive(x) for x in pids)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=60)
        assert wait_until(lambda: not any(pid_alive(x) for x in pids), 20), "a process survived"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
