"""``--preload``: what the preloaded imports set in the environment reaches the workers.

A plain worker imports torch or Lightning itself and keeps the variables those imports set
(Lightning sets ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so that ``torch.cuda.is_available()`` does
not initialise CUDA; torch's inductor ``TORCHINDUCTOR_CACHE_DIR``). A worker forked by the
zygote must end with the same environment, though the imports ran in the zygote.
"""

from __future__ import annotations

import pytest
from run_testlib import HERE, base_env, env_diff, read_dumps, run_launcher

JOB = str(HERE / "import_env_job.py")


@pytest.mark.timeout(120)
def test_preloaded_imports_leave_the_environment_a_plain_worker_has(tmp_path):
    got = {}
    for kind, extra in (("plain", []), ("preload", ["--preload", "fe_import_env_mod"])):
        out = tmp_path / kind
        out.mkdir()
        env = base_env(DUMP_DIR=str(out), FE_IMPORT_FORCED="agent", FE_IMPORT_REMOVED="agent")
        env["PYTHONPATH"] = f"{HERE}:{env['PYTHONPATH']}"  # the zygote imports it from here
        r = run_launcher("fastrun", ["--standalone", "--nproc-per-node", "2", *extra, JOB], env,
                         timeout=90)
        assert r.returncode == 0, r.stderr[-3000:]
        got[kind] = read_dumps(out)
        # the preloaded run's workers were forked by the zygote (no fallback to a plain start)
        preloaded = {d["env"]["FE_WAS_PRELOADED"] for d in got[kind].values()}
        assert preloaded == {"1" if extra else "0"}, (kind, r.stderr[-2000:])
    plain, forked = got["plain"], got["preload"]
    assert sorted(plain) == sorted(forked) == [0, 1]
    for rank in (0, 1):
        pe, fe = plain[rank]["env"], forked[rank]["env"]
        assert pe["FE_IMPORT_DEFAULT"] == pe["FE_IMPORT_FORCED"] == "from-import"
        assert "FE_IMPORT_REMOVED" not in pe and pe["LOCAL_RANK"] == str(rank)
        diff = env_diff(pe, fe, {"DUMP_DIR", "MASTER_PORT", "TORCHELASTIC_ERROR_FILE",
                                 "TORCHELASTIC_RUN_ID", "FE_WAS_PRELOADED"})
        assert not diff, f"rank {rank}: env differs (plain, preloaded): {diff}"
