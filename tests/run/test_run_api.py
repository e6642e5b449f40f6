"""fastelastic.launcher.api against torch.distributed.launcher.api."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from run_testlib import REPO, base_env

from fastelastic.launcher.api import LaunchConfig, _get_entrypoint_name, elastic_launch
from fastelastic.multiprocessing.errors import ChildFailedError


def square_rank(offset: int) -> tuple[int, int, str]:
    rank = int(os.environ["RANK"])
    return rank, rank * rank + offset, os.environ["WORLD_SIZE"]


def fail_on_rank_1() -> None:
    if os.environ["RANK"] == "1":
        raise RuntimeError("function worker failed")


@pytest.mark.torch
def test_launch_config_has_torchs_fields_and_defaults(need_torch):
    from torch.distributed.launcher.api import LaunchConfig as TorchLaunchConfig

    theirs = {f.name: f for f in dataclasses.fields(TorchLaunchConfig)}
    ours = {f.name: f for f in dataclasses.fields(LaunchConfig)}
    assert set(theirs) <= set(ours)
    assert set(ours) - set(theirs) == {"exit_barrier_timeout", "events_endpoint", "preload",
                                       "hang_timeout"}
    t = TorchLaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=3)
    o = LaunchConfig(min_nodes=1, max_nodes=2, nproc_per_node=3)
    for name in theirs:
        if name in ("logs_specs", "numa_options"):
            continue
        assert getattr(o, name) == getattr(t, name), name
    assert LaunchConfig(1, 1, 1, rdzv_timeout=5).rdzv_configs == {"timeout": 5}
    with pytest.raises(ValueError):
        LaunchConfig(1, 1, 1, shutdown_timeout=-1)


def test_entrypoint_name():
    assert _get_entrypoint_name(square_rank, []) == "square_rank"
    assert _get_entrypoint_name(sys.executable, ["-u", "train.py", "--x"]) == "train.py"
    assert _get_entrypoint_name("/bin/prog", []) == "/bin/prog"
    assert _get_entrypoint_name(None, []) == ""


@pytest.mark.timeout(120)
def test_elastic_launch_function_returns_values_by_rank():
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=3, rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", run_id="api-fn", max_restarts=0,
                       start_method="spawn")
    out = elastic_launch(cfg, square_rank)(10)
    assert out == {0: (0, 10, "3"), 1: (1, 11, "3"), 2: (2, 14, "3")}


@pytest.mark.timeout(120)
def test_elastic_launch_failure_raises_child_failed_with_log_dir(tmp_path):
    from fastelastic.multiprocessing import DefaultLogsSpecs

    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="c10d",
                       rdzv_endpoint="localhost:0", run_id="api-fail", max_restarts=0,
                       logs_specs=DefaultLogsSpecs(log_dir=str(tmp_path)))
    with pytest.raises(ChildFailedError) as ei:
        elastic_launch(cfg, fail_on_rank_1)()
    rank, failure = ei.value.get_first_failure()
    assert rank == 1 and failure.exitcode != 0
    assert ei.value.run_log_dir.startswith(str(tmp_path))
    from fastelastic.launcher.report import format_failure_report

    rep = format_failure_report(ei.value, ei.value.run_log_dir, host="hostX")
    assert "root cause : rank 1 (local_rank 1) on host hostX" in rep
    assert "RuntimeError: function worker failed" in rep


@pytest.mark.timeout(60)
def test_launcher_never_imports_torch(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("print('ok')\n")
    code = (
        "import sys\n"
        "from fastelastic.run import main\n"
        "assert main(['--standalone', '--nproc-per-node', '2', '--events-endpoint',\n"
        f"             'tcp://127.0.0.1:1', {str(script)!r}]) is None\n"
        "assert 'torch' not in sys.modules, 'the launcher imported torch'\n"
        "print('no-torch')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=base_env(), cwd=str(REPO),
                       capture_output=True, text=True, timeout=50)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "no-torch" in r.stdout and r.stdout.count("ok") == 2


class _GracefulExitHandler:
    """The handler of a node left waiting when the job closed the rendezvous."""

    def __init__(self, params):
        self.params = params

    def get_backend(self):
        return "graceful-exit-test"

    use_agent_store = True

    def next_rendezvous(self):
        from fastelastic.rendezvous import RendezvousGracefulExitError

        raise RendezvousGracefulExitError("closed while this node was waiting")

    def is_closed(self):
        return True

    def set_closed(self):
        return None

    def num_nodes_waiting(self):
        return 0

    def get_run_id(self):
        return self.params.run_id

    def shutdown(self):
        return True


def test_graceful_rendezvous_exit_ends_the_launch_without_error():
    """torch's launcher fails on agent.run() returning None (AttributeError); ours returns {}."""
    from fastelastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register("graceful-exit-test", _GracefulExitHandler)
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1,
                       rdzv_backend="graceful-exit-test", rdzv_endpoint="", run_id="g")
    assert elastic_launch(cfg, square_rank)(0) == {}


def test_the_report_says_an_unknown_exit_status_is_unknown(tmp_path):
    """A worker whose exit status nobody could report is not shown as "exit code 256"."""
    from fastelastic.launcher.report import format_failure_report
    from fastelastic.multiprocessing.errors import (
        EXITCODE_UNKNOWN,
        ChildFailedError,
        ProcessFailure,
    )

    failures = {
        0: ProcessFailure(0, 11, EXITCODE_UNKNOWN, str(tmp_path / "none.json"),
                          unknown_exit="the zygote died first"),
        1: ProcessFailure(1, 12, EXITCODE_UNKNOWN, str(tmp_path / "none1.json")),
    }
    rep = format_failure_report(ChildFailedError("train.py", failures), None, host="h")
    assert "exit code 256" not in rep
    assert rep.count("exit status unknown") == 2, rep


def test_the_report_of_a_worker_the_agent_stopped_says_why_and_where_its_stacks_are(tmp_path):
    """A rank stopped for a hang (or D-state) with no restart left: the report says what it
    hung in and where its stacks are, not a traceback it never wrote."""
    import signal as _signal

    from fastelastic.launcher.report import format_failure_report
    from fastelastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    why = "hung (--hang-timeout): no progress for 5.0 s, in hung_in_sleep (train.py:60)"
    stacks = tmp_path / "hang_1" / "rank3.stacks.txt"
    failures = {
        3: ProcessFailure(1, 77, -_signal.SIGTERM, "", stopped_for=why, stacks_file=str(stacks)),
        2: ProcessFailure(0, 76, -_signal.SIGKILL, "", stopped_for="stuck in D-state"),
    }
    failures[2].timestamp += 10  # rank 3 is the first failure: the root cause
    rep = format_failure_report(ChildFailedError("train.py", failures), None, host="h")
    assert "root cause : rank 3 (local_rank 1) on host h" in rep
    assert (f"failure    : {why} (pid 77); stopped by the agent: killed by SIGTERM") in rep
    assert f"stacks     : {stacks}" in rep
    assert "traceback" not in rep
    assert "also failed: rank 2 (local_rank 0) stuck in D-state" in rep
    assert why in failures[3].message
