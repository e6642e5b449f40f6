"""fastrun's parser against torchrun's: same flags, spellings, defaults and PET_ fallbacks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from fastelastic.launcher.args import (
    determine_local_world_size,
    get_args_parser,
    parse_min_max_nnodes,
)

NEW_DESTS = {"exit_barrier_timeout", "events_endpoint", "preload", "hang_timeout",
             "checkpoint_drain_timeout", "checkpoint_copy_to"}


@pytest.fixture(scope="module")
def torch_run():
    try:
        import torch.distributed.run as trun
    except ImportError as e:  # pragma: no cover - CI installs torch
        pytest.skip(f"!!! torch is not installed, cannot compare with torchrun: {e}")
    return trun


def _both(torch_run, argv, env=None, monkeypatch=None):
    if env:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
    ours = vars(get_args_parser().parse_args(argv))
    theirs = vars(torch_run.get_args_parser().parse_args(argv))
    return ours, theirs


CMDLINES = [
    ["train.py"],
    ["--nnodes", "1:4", "--nproc-per-node", "3", "train.py", "--lr", "0.1"],
    ["--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d", "--rdzv_endpoint=h:1234",
     "--rdzv_id=abc", "--rdzv_conf=timeout=30,join_timeout=5", "train.py"],
    ["--standalone", "--max-restarts", "3", "--monitor-interval", "0.5", "--start-method",
     "fork", "--role", "trainer", "-m", "pkg.mod", "a", "b"],
    ["--no-python", "--log-dir", "/tmp/x", "-r", "3", "-t", "0:1,1:2", "prog"],
    ["--run-path", "--local-ranks-filter", "0,1", "--node-rank", "1", "--master-addr",
     "10.0.0.1", "--master-port", "1234", "--local-addr", "127.0.0.1", "/abs/s.py"],
    ["--event-log-handler", "console", "--signals-to-handle", "SIGTERM,SIGUSR1",
     "--shutdown-timeout", "5", "--virtual-local-rank", "--numa-binding", "node", "s.py"],
    ["--duplicate-stdout-filters", "a,,b,c", "--duplicate_stderr_filters", "x", "s.py"],
    ["--logs-specs", "mine", "s.py", "--nnodes", "7"],  # script args are not ours
]


@pytest.mark.parametrize("argv", CMDLINES, ids=lambda a: " ".join(a)[:50])
def test_same_namespace_as_torchrun(torch_run, argv):
    ours, theirs = _both(torch_run, argv)
    assert set(ours) - NEW_DESTS == set(theirs)
    for k, v in theirs.items():
        assert ours[k] == v, k


def test_every_torchrun_option_string_exists(torch_run):
    ours = {s for a in get_args_parser()._actions for s in a.option_strings}
    theirs = {s for a in torch_run.get_args_parser()._actions for s in a.option_strings}
    assert theirs <= ours, theirs - ours
    assert {"--exit-barrier-timeout", "--events-endpoint", "--events_endpoint"} <= ours


PET_ENV = {
    "PET_NNODES": "2:3",
    "PET_NPROC_PER_NODE": "5",
    "PET_RDZV_BACKEND": "c10d",
    "PET_RDZV_ENDPOINT": "host:99",
    "PET_RDZV_ID": "jobx",
    "PET_MAX_RESTARTS": "4",
    "PET_STANDALONE": "1",
    "PET_MODULE": "1",
    "PET_ROLE": "r",
    "PET_LOG_DIR": "/tmp/l",
    "PET_REDIRECTS": "2",
    "PET_TEE": "1",
    "PET_NODE_RANK": "3",
    "PET_MASTER_ADDR": "1.2.3.4",
    "PET_MASTER_PORT": "4321",
    "PET_SIGNALS_TO_HANDLE": "SIGINT",
    "PET_SHUTDOWN_TIMEOUT": "9",
    "PET_VIRTUAL_LOCAL_RANK": "1",
}


def test_pet_env_fallbacks_match_torchrun(torch_run, monkeypatch):
    ours, theirs = _both(torch_run, ["s.py"], PET_ENV, monkeypatch)
    for k, v in theirs.items():
        assert ours[k] == v, k
    assert ours["nproc_per_node"] == "5" and ours["standalone"] is True
    # the command line wins over the environment
    ours2, theirs2 = _both(torch_run, ["--nproc-per-node", "2", "s.py"], PET_ENV, monkeypatch)
    assert ours2["nproc_per_node"] == theirs2["nproc_per_node"] == "2"


def test_new_flags_env_and_defaults(monkeypatch):
    ns = get_args_parser().parse_args(["s.py"])
    assert ns.exit_barrier_timeout == 300.0 and ns.events_endpoint is None
    monkeypatch.setenv("PET_EVENTS_ENDPOINT", "tcp://127.0.0.1:5555")
    monkeypatch.setenv("PET_EXIT_BARRIER_TIMEOUT", "7.5")
    ns = get_args_parser().parse_args(["s.py"])
    assert ns.events_endpoint == "tcp://127.0.0.1:5555" and ns.exit_barrier_timeout == 7.5


def test_nnodes_and_nproc_values(torch_run):
    for text in ("1", "2:5", "3:3"):
        assert parse_min_max_nnodes(text) == torch_run.parse_min_max_nnodes(text)
    with pytest.raises(RuntimeError, match="MIN:MAX"):
        parse_min_max_nnodes("2:20:30")
    with pytest.raises(ValueError):
        parse_min_max_nnodes("a:b")
    assert determine_local_world_size("7") == 7
    assert determine_local_world_size("cpu") == torch_run.determine_local_world_size("cpu")
    assert determine_local_world_size("auto") == torch_run.determine_local_world_size("auto")
    with pytest.raises(ValueError):
        determine_local_world_size("x")
    with pytest.raises(ValueError):
        determine_local_world_size("0")


def _fastrun(*argv, env=None, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fastelastic.run", *argv],
        capture_output=True, text=True, timeout=60, env=env, cwd=cwd,
    )


BAD = [
    (["--nnodes", "3:2", "{script}"], "--nnodes 3:2"),
    (["--nnodes", "0", "{script}"], "--nnodes 0"),
    (["--nproc-per-node", "x", "{script}"], "--nproc-per-node 'x'"),
    (["--rdzv-backend", "nope", "{script}"], "unknown rendezvous backend 'nope'"),
    (["does_not_exist.py"], "training script 'does_not_exist.py' not found"),
    (["--no-python", "no-such-program-xyz"], "no-such-program-xyz"),
    (["-m", "no_such_module_xyz.sub"], "module 'no_such_module_xyz'"),
    (["--start-method", "thread", "{script}"], "--start-method"),
    (["--max-restarts", "-1", "{script}"], "--max-restarts"),
    (["--events-endpoint", "udp://x", "{script}"], "--events-endpoint"),
    (["--bogus", "{script}"], "--bogus"),
    (["--standalone", "--nproc-per-node", "2", "-r", "9", "{script}"], "--redirects '9'"),
    (["--standalone", "--tee", "0:7", "{script}"], "--tee '0:7'"),
    (["--standalone", "--local-ranks-filter", "a", "{script}"], "--local-ranks-filter"),
    (["--standalone", "--rdzv-conf", "foo", "{script}"], "--rdzv-conf option 'foo'"),
    ([], "training_script"),
]


@pytest.mark.parametrize("argv,needle", BAD, ids=[b[1] for b in BAD])
def test_bad_flags_exit_2_with_one_line(tmp_path, argv, needle):
    script = tmp_path / "ok.py"
    script.write_text("print('should never run')\n")
    r = _fastrun(*[a.format(script=script) for a in argv])
    assert r.returncode == 2, r
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("fastrun: error:") and needle in lines[0], lines[0]
    assert "should never run" not in r.stdout


def test_pet_standalone_not_integer_is_one_line(tmp_path):
    script = tmp_path / "ok.py"
    script.write_text("")
    r = _fastrun(str(script), env={**os.environ, "PET_STANDALONE": "yes"})
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "fastrun: error: PET_STANDALONE='yes' must be an integer (0 or 1)"
    ]


def _error_type(fn, *a):
    try:
        fn(*a)
    except Exception as e:
        return type(e)
    return None


@pytest.mark.parametrize("text", ["2:20:30", "1:2:3:4", "::", "a", "a:b", "1:", "", "1.5"])
def test_nnodes_errors_have_torchs_types(torch_run, text):
    theirs = _error_type(torch_run.parse_min_max_nnodes, text)
    assert theirs is not None
    assert _error_type(parse_min_max_nnodes, text) is theirs


@pytest.mark.parametrize("argv", [
    ["--nnodes", "2:20:30", "s.py"],
    ["--nnodes", "3:2", "s.py"],
    ["--nnodes", "0", "s.py"],
    ["--max-restarts", "-1", "s.py"],
    ["--local-ranks-filter", "a", "s.py"],
    ["--nproc-per-node", "x", "s.py"],
    ["-r", "9", "s.py"],
    ["--no-python", "-m", "s.py"],
], ids=lambda a: " ".join(a))
def test_config_from_args_errors_have_torchs_types(torch_run, argv, monkeypatch):
    from fastelastic.run import config_from_args

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    theirs = _error_type(torch_run.config_from_args, torch_run.parse_args(argv))
    assert theirs is not None
    assert _error_type(config_from_args, get_args_parser().parse_args(argv)) is theirs


def test_rdzv_endpoint_help_shows_the_candidate_list():
    """--help names the candidate list syntax of --rdzv-endpoint, not only HOST:PORT."""
    out = subprocess.run([sys.executable, "-m", "fastelastic.run", "--help"], capture_output=True,
                         text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr
    help_text = " ".join(out.stdout.split())
    assert "HOST:PORT,HOST:PORT,..." in help_text
    assert "comma-separated list of candidates" in help_text
