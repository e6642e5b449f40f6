"""SimpleElasticAgent logic: rank exchange traffic, restarts, membership change, exit barrier.

The agent under test is a small subclass running real child processes with ``subprocess``;
the rendezvous is a static handler over a real TCP store (see conftest).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
import types

import pytest
from agent_testlib import CountingStore, StoreRendezvous, store_client

from fastelastic.agent.server import (
    RunResult,
    SimpleElasticAgent,
    WorkerSpec,
    WorkerState,
)
from fastelastic.agent.server.api import Worker, WorkerGroup
from fastelastic.errors import StoreConnectionError


class PopenAgent(SimpleElasticAgent):
    """Runs ``spec.entrypoint`` (a python snippet) as real child processes."""

    def __init__(self, spec, **kw):
        super().__init__(spec, **kw)
        self.procs: dict[int, subprocess.Popen] = {}
        self.started_envs: list[dict[str, str]] = []

    def _start_workers(self, wg: WorkerGroup):
        restart = str(wg.spec.max_restarts - self._remaining_restarts)
        for w in wg.workers:
            env = {"RANK": str(w.global_rank), "TORCHELASTIC_RESTART_COUNT": restart}
            self.started_envs.append(env)
            self.procs[w.local_rank] = subprocess.Popen(
                [sys.executable, "-c", wg.spec.entrypoint], env=env
            )
        return {lr: p.pid for lr, p in self.procs.items()}

    def _stop_workers(self, wg):
        self._shutdown()

    def _monitor_workers(self, wg):
        codes = {lr: p.poll() for lr, p in self.procs.items()}
        failed = {
            wg.workers[lr].global_rank: types.SimpleNamespace(
                exitcode=c, pid=self.procs[lr].pid, error_file_data={}
            )
            for lr, c in codes.items()
            if c not in (None, 0)
        }
        if failed:
            return RunResult(WorkerState.FAILED, failures=failed)
        if all(c == 0 for c in codes.values()):
            return RunResult(
                WorkerState.SUCCEEDED,
                return_values={wg.workers[lr].global_rank: None for lr in codes},
            )
        return RunResult(WorkerState.HEALTHY)

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(death_sig)
            p.wait(timeout)
        self.procs.clear()


def make_spec(rdzv, code, role="trainer", nproc=2, max_restarts=3, interval=0.02):
    return WorkerSpec(
        role=role,
        local_world_size=nproc,
        rdzv_handler=rdzv,
        entrypoint=code,
        max_restarts=max_restarts,
        monitor_interval=interval,
    )


def run_agents(specs_by_rank, **kw):
    """Runs one PopenAgent per spec in threads; returns {rank: (agent, result or exception)}."""
    out = {}

    def go(rank, spec):
        agent = PopenAgent(spec, **kw)
        try:
            out[rank] = (agent, agent.run())
        except BaseException as e:  # noqa: BLE001 - reported by the test
            out[rank] = (agent, e)

    threads = [threading.Thread(target=go, args=item) for item in specs_by_rank.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an agent did not finish in 60 s"
    return out


def test_spec_validation_and_entrypoint_name():
    rdzv = types.SimpleNamespace()
    with pytest.raises(ValueError, match="local_world_size"):
        WorkerSpec(role="r", local_world_size=0, rdzv_handler=rdzv, entrypoint="x")
    with pytest.raises(ValueError, match="monitor_interval"):
        WorkerSpec(
            role="r", local_world_size=1, rdzv_handler=rdzv, entrypoint="x", monitor_interval=0
        )
    with pytest.raises(ValueError, match="entrypoint"):
        WorkerSpec(role="r", local_world_size=1, rdzv_handler=rdzv)
    assert (
        WorkerSpec(
            role="r", local_world_size=1, rdzv_handler=rdzv, entrypoint="/usr/bin/python3"
        ).get_entrypoint_name()
        == "python3"
    )
    with pytest.warns(DeprecationWarning):
        spec = WorkerSpec(role="r", local_world_size=1, rdzv_handler=rdzv, fn=make_spec)
    assert spec.entrypoint is make_spec and spec.get_entrypoint_name() == "make_spec"
    assert WorkerState.is_running(WorkerState.HEALTHY) and WorkerState.is_running(
        WorkerState.UNHEALTHY
    )
    assert not WorkerState.is_running(WorkerState.SUCCEEDED)
    assert (
        str(Worker(1, 2, 3, 4, 5))
        == "local_rank=1,global_rank=2,role_rank=3,world_size=4,role_world_size=5"
    )


def test_spec_has_every_torch_field():
    torch_api = pytest.importorskip(
        "torch.distributed.elastic.agent.server.api",
        reason="torch 2.13 needed to compare WorkerSpec fields",
    )
    import dataclasses

    fields = dataclasses.fields(WorkerSpec)
    ours = [(f.name, f.default) for f in fields]
    theirs = [(f.name, f.default) for f in dataclasses.fields(torch_api.WorkerSpec)]
    # fastelastic's own fields come last, with defaults, so torch's positional order holds
    assert ours[: len(theirs)] == theirs
    assert ours[len(theirs) :] == [("preload", None)]


@pytest.mark.usefixtures("no_identical_env")
def test_slow_path_store_traffic_and_ranks(store_server):
    layout = [("trainer", 2), ("ps", 1), ("trainer", 3)]
    stores = [CountingStore(store_client(store_server)) for _ in layout]
    results = {}

    def agent(i):
        spec = types.SimpleNamespace(role=layout[i][0], local_world_size=layout[i][1])
        results[i] = SimpleElasticAgent._assign_worker_ranks(None, stores[i], i, len(layout), spec)

    threads = [threading.Thread(target=agent, args=(i,)) for i in range(len(layout))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for s in stores:
        s._store.close()  # not counted
    assert [[w.global_rank for w in results[i]] for i in range(3)] == [[0, 1], [2], [3, 4, 5]]
    assert [[w.role_rank for w in results[i]] for i in range(3)] == [[0, 1], [0], [2, 3, 4]]
    assert [results[i][0].role_world_size for i in range(3)] == [5, 1, 5]
    assert all(w.world_size == 6 for i in range(3) for w in results[i])
    assert stores[0].calls == {"set": 1, "multi_get": 1, "multi_set": 1, "get": 1}
    for s in stores[1:]:
        assert s.calls == {"set": 1, "get": 1}


@pytest.mark.parametrize("env", ["TORCH_ELASTIC_WORKER_IDENTICAL", "FASTELASTIC_WORKER_IDENTICAL"])
def test_fast_path_uses_no_store(monkeypatch, no_identical_env, env):
    monkeypatch.setenv(env, "1")
    store = CountingStore(object())
    spec = types.SimpleNamespace(role="trainer", local_world_size=4)
    ws = SimpleElasticAgent._assign_worker_ranks(None, store, 2, 3, spec)
    assert [w.global_rank for w in ws] == [8, 9, 10, 11]
    assert [w.role_rank for w in ws] == [8, 9, 10, 11]
    assert {w.world_size for w in ws} == {12} and {w.role_world_size for w in ws} == {12}
    assert store.calls == {}


@pytest.mark.usefixtures("no_identical_env")
def test_restarts_until_success(store_server, tmp_path):
    # Each worker fails while fewer than 2 restarts happened, then succeeds.
    code = "import os,sys; sys.exit(0 if int(os.environ['TORCHELASTIC_RESTART_COUNT']) >= 2 else 3)"
    rdzv = StoreRendezvous(store_server, 0, 1)
    agent = PopenAgent(make_spec(rdzv, code), exit_barrier_timeout=10)
    result = agent.run()
    assert result.state == WorkerState.SUCCEEDED and not result.is_failed()
    assert sorted(result.return_values) == [0, 1]
    counts = [int(e["TORCHELASTIC_RESTART_COUNT"]) for e in agent.started_envs]
    assert counts == [0, 0, 1, 1, 2, 2]
    assert rdzv.rounds == 3 and agent.restart_count == 2


@pytest.mark.usefixtures("no_identical_env")
def test_failure_after_max_restarts(store_server):
    rdzv = StoreRendezvous(store_server, 0, 1)
    agent = PopenAgent(
        make_spec(rdzv, "import sys; sys.exit(7)", max_restarts=1), exit_barrier_timeout=5
    )
    result = agent.run()
    assert result.is_failed() and result.state == WorkerState.FAILED
    assert result.failures and set(result.failures) <= {0, 1}
    assert {f.exitcode for f in result.failures.values()} == {7}
    assert rdzv.rounds == 2 and agent.restart_count == 1


class UncheckableRendezvous(StoreRendezvous):
    """A rendezvous whose lost-member check fails (its store went away with a peer)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.checks = 0

    def get_backend(self) -> str:
        return "static"   # no membership timer: the check runs only after a failure

    def lost_members(self):
        self.checks += 1
        raise StoreConnectionError("connection to the store at 127.0.0.1:1 failed")


@pytest.mark.usefixtures("no_identical_env")
def test_a_failing_lost_member_check_loses_no_worker_failure(store_server, caplog):
    """A group failed: a lost-member check that raises still ends in the restart, then the
    failure report, that the workers' exit codes call for."""
    rdzv = UncheckableRendezvous(store_server, 0, 1)
    events = []
    agent = PopenAgent(
        make_spec(rdzv, "import sys; sys.exit(7)", max_restarts=1),
        exit_barrier_timeout=5,
    )
    agent._record_worker_events = lambda result: events.append(result)
    result = agent.run()
    assert result.is_failed() and result.state == WorkerState.FAILED
    assert {f.exitcode for f in result.failures.values()} == {7}
    assert events == [result]                      # the worker events were recorded
    assert rdzv.rounds == 2 and agent.restart_count == 1 and rdzv.checks == 2
    assert "could not check for lost nodes" in caplog.text


@pytest.mark.usefixtures("no_identical_env")
def test_membership_change_restarts_without_using_a_retry(store_server, tmp_path):
    flag = tmp_path / "go"
    # Workers wait for the flag file, bounded at 20 s.
    code = (
        f"import os,time,sys\nd=time.monotonic()+20\n"
        f"while not os.path.exists({str(flag)!r}) and time.monotonic()<d: time.sleep(0.01)\n"
        f"sys.exit(0 if os.path.exists({str(flag)!r}) else 9)"
    )
    rdzv = StoreRendezvous(store_server, 0, 1)
    agent = PopenAgent(make_spec(rdzv, code, nproc=1), exit_barrier_timeout=5)
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("r", agent.run()))
    t.start()
    deadline = time.monotonic() + 20
    while rdzv.rounds < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    rdzv.waiting = 1  # a new node shows up
    while rdzv.rounds < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    flag.touch()
    t.join(30)
    assert box["r"].state == WorkerState.SUCCEEDED
    assert rdzv.rounds == 2 and agent.restart_count == 0


@pytest.mark.usefixtures("no_identical_env")
def test_failed_node_releases_exit_barrier_at_once(store_server):
    ok = make_spec(StoreRendezvous(store_server, 0, 2), "pass", nproc=1, max_restarts=0)
    bad = make_spec(
        StoreRendezvous(store_server, 1, 2), "import sys; sys.exit(1)", nproc=1, max_restarts=0
    )
    start = time.monotonic()
    out = run_agents({0: ok, 1: bad}, exit_barrier_timeout=120)
    elapsed = time.monotonic() - start
    assert out[0][1].state == WorkerState.SUCCEEDED
    assert out[1][1].is_failed()
    assert elapsed < 30, f"healthy agent sat in the exit barrier for {elapsed:.1f} s"


@pytest.mark.usefixtures("no_identical_env")
def test_exit_barrier_waits_for_slow_peer(store_server, tmp_path):
    flag = tmp_path / "release"
    slow_code = (
        f"import os,time\nd=time.monotonic()+20\n"
        f"while not os.path.exists({str(flag)!r}) and time.monotonic()<d: time.sleep(0.01)"
    )
    fast = PopenAgent(
        make_spec(StoreRendezvous(store_server, 0, 2), "pass", nproc=1), exit_barrier_timeout=60
    )
    slow = PopenAgent(
        make_spec(StoreRendezvous(store_server, 1, 2), slow_code, nproc=1), exit_barrier_timeout=60
    )
    box = {}
    ts = [
        threading.Thread(target=lambda a=a, k=k: box.setdefault(k, a.run()))
        for k, a in (("f", fast), ("s", slow))
    ]
    for t in ts:
        t.start()
    deadline = time.monotonic() + 20
    while not fast._in_exit_barrier and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fast._in_exit_barrier, "the finished agent should be waiting for its peer"
    assert "f" not in box
    flag.touch()
    for t in ts:
        t.join(30)
    assert box["f"].state == box["s"].state == WorkerState.SUCCEEDED


def test_exit_barrier_timeout_is_configurable(store_server, caplog, monkeypatch):
    # The peer (group rank 1) never arrives: the barrier gives up after exit_barrier_timeout.
    monkeypatch.setenv("FASTELASTIC_WORKER_IDENTICAL", "1")  # no rank exchange with the peer
    agent = PopenAgent(
        make_spec(StoreRendezvous(store_server, 0, 2), "pass", nproc=1), exit_barrier_timeout=1
    )
    start = time.monotonic()
    result = agent.run()
    elapsed = time.monotonic() - start
    assert result.state == WorkerState.SUCCEEDED
    assert 1.0 <= elapsed < 15, elapsed
    assert not agent._in_exit_barrier
    assert "Error waiting on exit barrier" in caplog.text



class ClosedWhileWaiting(StoreRendezvous):
    """A node left waiting (redundant) when the job closed its rendezvous, as torch raises it."""

    def next_rendezvous(self):
        from fastelastic.rendezvous import RendezvousGracefulExitError

        self.rounds += 1
        raise RendezvousGracefulExitError("The rendezvous 'test' is closed, terminating pending")


def test_run_returns_none_on_a_graceful_rendezvous_exit(store_server, tmp_path):
    """As torch: run() returns None (no RunResult) and starts no worker."""
    marker = tmp_path / "ran"
    handler = ClosedWhileWaiting(store_server, rank=0, world_size=1)
    agent = PopenAgent(make_spec(handler, f"open({str(marker)!r}, 'w')", nproc=1))
    assert agent.run() is None
    assert handler.rounds == 1 and not marker.exists() and agent.procs == {}


class FakeWorkersAgent(SimpleElasticAgent):
    """torch's own launcher tests drive the protected steps in their own order with an agent
    like this one (no real workers; ids are global ranks)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.stopped = self.started = 0

    def _start_workers(self, wg):
        self.started += 1
        return {w.local_rank: w.global_rank for w in wg.workers}

    def _stop_workers(self, wg, is_restart=False):
        wg.group_rank = wg.group_world_size = None
        self.stopped += 1

    def _monitor_workers(self, wg):
        return RunResult(WorkerState.HEALTHY)

    def _shutdown(self, death_sig=signal.SIGTERM, timeout=30):
        pass


def test_protected_steps_out_of_order_are_recorded_not_refused(store_server):
    """A fresh agent restarted three times (torch's ``test_restart_workers``; it raised
    ``AssertionError: agent state INIT -> STOPPING`` while the states were checked)."""
    from fastelastic.agent.server._runloop import AgentState

    rdzv = StoreRendezvous(store_server, 0, 1)
    agent = FakeWorkersAgent(make_spec(rdzv, "pass", nproc=3))
    wg = agent.get_worker_group()
    for i in range(3):
        agent._restart_workers(wg)
        assert wg.state == WorkerState.HEALTHY
        assert wg.group_rank == 0 and wg.group_world_size == 1
        assert [w.id for w in wg.workers] == [0, 1, 2]
        assert agent._agent_state is AgentState.RUNNING
        assert (agent.started, agent.stopped) == (i + 1, i + 1)
    # a step into a state the run loop never goes to from here is recorded too
    agent._enter_step(AgentState.EXIT_BARRIER)
    agent._rendezvous(wg)
    assert agent._agent_state is AgentState.RENDEZVOUS
    # the run loop's own decisions are still checked
    with pytest.raises(AssertionError, match="RENDEZVOUS -> SUCCEEDED"):
        agent._set_state(AgentState.SUCCEEDED)


class UnhealthyAgent(PopenAgent):
    """Its monitor calls the running group UNHEALTHY (as a hang or D-state check does)."""

    def _monitor_workers(self, wg):
        return RunResult(WorkerState.UNHEALTHY)


@pytest.mark.usefixtures("no_identical_env")
def test_unhealthy_with_no_restart_left_is_a_failure_with_failures(store_server):
    """The run loop's last failure from an UNHEALTHY group returns FAILED, never without a
    failure: the launcher raises ChildFailedError (fastrun exits 1) from it."""
    from fastelastic.errors import ChildFailedError
    from fastelastic.multiprocessing.errors import EXITCODE_UNKNOWN

    rdzv = StoreRendezvous(store_server, 0, 1)
    agent = UnhealthyAgent(make_spec(rdzv, "import time; time.sleep(30)", max_restarts=0),
                           exit_barrier_timeout=5)
    result = agent.run()
    assert result.is_failed() and result.state == WorkerState.FAILED
    assert sorted(result.failures) == [0, 1]
    f = result.failures[1]
    assert f.local_rank == 1 and f.exitcode == EXITCODE_UNKNOWN
    assert f.stopped_for == ("the worker group was UNHEALTHY with no restart left: the agent "
                             "stopped it")
    assert f.stopped_for in f.message
    assert ChildFailedError("job", result.failures).get_first_failure()[0] in (0, 1)
    assert agent.procs == {}  # stopped
