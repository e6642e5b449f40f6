"""Each flag's effect on the worker environment: fastrun against torchrun, same command line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from run_testlib import DUMP, HERE, base_env, free_port, read_dumps, run_launcher

pytestmark = [pytest.mark.torch, pytest.mark.usefixtures("need_torch")]

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# Differ by nature between two runs; checked separately below.
PER_RUN = {"DUMP_DIR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_RUN_ID"}


def _run_both(tmp_path: Path, args: list[str], env_extra: dict[str, str] | None = None,
              cwd: str | None = None):
    results = {}
    for which in ("torchrun", "fastrun"):
        d = tmp_path / which
        d.mkdir()
        env = base_env(DUMP_DIR=str(d), **(env_extra or {}))
        r = run_launcher(which, [a.replace("{port}", str(_run_both.port)) for a in args], env,
                         cwd=cwd)
        assert r.returncode == 0, f"{which} failed:\n{r.stderr[-3000:]}"
        results[which] = read_dumps(d)
    return results["torchrun"], results["fastrun"]


_run_both.port = 0  # type: ignore[attr-defined]


def _compare(theirs: dict[int, dict], ours: dict[int, dict], same_run_id: bool,
             ignore: frozenset[str] = frozenset()) -> None:
    assert sorted(ours) == sorted(theirs) and ours, (sorted(ours), sorted(theirs))
    for rank in theirs:
        te, oe = theirs[rank]["env"], ours[rank]["env"]
        diff = {
            k: (te.get(k), oe.get(k))
            for k in set(te) | set(oe)
            if k not in PER_RUN | ignore and te.get(k) != oe.get(k)
        }
        assert not diff, f"rank {rank}: env differs (torchrun, fastrun): {diff}"
        assert ours[rank]["argv"][1:] == theirs[rank]["argv"][1:]
        assert ours[rank]["module"] == theirs[rank]["module"]
        assert ours[rank]["cwd"] == theirs[rank]["cwd"]
        assert oe["MASTER_PORT"].isdigit() and te["MASTER_PORT"].isdigit()
        for e in (te, oe):
            lr = e["LOCAL_RANK"] if e.get("TORCHELASTIC_ERROR_FILE") else None
            assert lr is None or e["TORCHELASTIC_ERROR_FILE"].endswith("/error.json")
        if same_run_id:
            assert oe["TORCHELASTIC_RUN_ID"] == te["TORCHELASTIC_RUN_ID"]
        else:
            assert UUID.match(oe["TORCHELASTIC_RUN_ID"]) and UUID.match(te["TORCHELASTIC_RUN_ID"])


CASES = {
    "standalone": (["--standalone", "--nproc-per-node", "2", str(DUMP), "a", "--b=1"], {}, False),
    "single-node-static-becomes-c10d": (["--nproc_per_node=2", str(DUMP)], {}, False),
    "c10d-flags": (
        ["--nnodes", "1:1", "--nproc-per-node", "3", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", "127.0.0.1:{port}", "--rdzv-id", "job-c10d", "--role", "trainer",
         "--max-restarts", "2", "--monitor-interval", "0.2", "--start-method", "fork",
         "--signals-to-handle", "SIGTERM,SIGUSR1", "--rdzv-conf", "join_timeout=30",
         str(DUMP)],
        {"OMP_NUM_THREADS": "3"}, True,
    ),
    "static-master-port": (
        ["--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
         "--master-port", "{port}", "--node-rank", "0", "--rdzv-id", "job-static", str(DUMP)],
        {}, True,
    ),
    "no-python": (["--standalone", "--nproc-per-node", "2", "--no-python", str(DUMP)], {}, False),
    "run-path": (["--standalone", "--nproc-per-node", "2", "--run-path", str(DUMP), "x"], {},
                 False),
    "virtual-local-rank-logs": (
        ["--standalone", "--nproc-per-node", "2", "--virtual-local-rank", "--local-addr",
         "127.0.0.1", "-r", "3", "--local-ranks-filter", "0", str(DUMP)],
        {}, False,
    ),
    "pet-env": ([str(DUMP)], {"PET_NPROC_PER_NODE": "2", "PET_STANDALONE": "1",
                              "PET_MAX_RESTARTS": "1", "PET_ROLE": "envrole"}, False),
}


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_worker_env_matches_torchrun(tmp_path, case):
    args, env, same_run_id = CASES[case]
    _run_both.port = free_port()  # type: ignore[attr-defined]
    theirs, ours = _run_both(tmp_path, args, env)
    _compare(theirs, ours, same_run_id)
    e = ours[0]["env"]
    if case == "c10d-flags":
        assert (e["ROLE_NAME"], e["TORCHELASTIC_MAX_RESTARTS"], e["OMP_NUM_THREADS"]) == (
            "trainer", "2", "3")
        assert e["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
        assert sorted(int(d["env"]["RANK"]) for d in ours.values()) == [0, 1, 2]
    if case == "standalone":
        assert e["OMP_NUM_THREADS"] == "1" and e["WORLD_SIZE"] == "2"
    if case == "static-master-port":
        assert e["MASTER_PORT"] == str(_run_both.port)  # type: ignore[attr-defined]
        assert e["TORCHELASTIC_USE_AGENT_STORE"] == theirs[0]["env"]["TORCHELASTIC_USE_AGENT_STORE"]
    if case == "virtual-local-rank-logs":
        assert {d["env"]["LOCAL_RANK"] for d in ours.values()} == {"0"}
    if case == "pet-env":
        assert e["ROLE_NAME"] == "envrole" and e["TORCHELASTIC_MAX_RESTARTS"] == "1"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_module_flag_matches_torchrun(tmp_path):
    _run_both.port = free_port()  # type: ignore[attr-defined]
    theirs, ours = _run_both(
        tmp_path, ["--standalone", "--nproc-per-node", "2", "-m", "dump_env", "q"], cwd=str(HERE)
    )
    _compare(theirs, ours, same_run_id=False)
    assert ours[1]["module"] == "__main__" and ours[1]["argv"][1:] == ["q"]
