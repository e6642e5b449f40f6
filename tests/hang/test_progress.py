"""The worker side of the hang check, in real interpreters: the bootstrap leaves no trace,
chains to the user's sitecustomize, and the marks land in the slot (steps, saves, evaluation,
forked children detached, the explicit call)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fastelastic.progress import _worker as w
from fastelastic.progress._launch import PROGRESS_ENV, ProgressSlots, plain_start_env

REPO = Path(__file__).resolve().parents[2]

SHOW = textwrap.dedent("""
    import json, os, subprocess, sys
    child = subprocess.run([sys.executable, "-c",
        "import os, json; print(json.dumps({k: v for k, v in os.environ.items()"
        " if k.startswith(('PYTHONPATH', 'FASTELASTIC'))}))"],
        capture_output=True, text=True).stdout
    print(json.dumps({
        "path": sys.path,
        "env": {k: v for k, v in os.environ.items() if k.startswith(("PYTHONPATH", "FAST"))},
        "site": getattr(sys.modules.get("sitecustomize"), "__file__", None),
        "child": json.loads(child),
        "user_site_ran": os.environ.get("USER_SITE_RAN"),
    }))
""")


@pytest.fixture
def slots():
    s = ProgressSlots()
    yield s
    s.close()


def _run(script: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    path = cwd / "prog.py"
    path.write_text(script)
    return subprocess.run([sys.executable, str(path)], env=env, cwd=str(cwd),
                          capture_output=True, text=True, timeout=120)


def _env(pythonpath: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTELASTIC", "PYTHONPATH"))}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return env


@pytest.mark.parametrize("pythonpath", [None, "", "REPO"])
@pytest.mark.parametrize("user_site", [False, True])
def test_bootstrap_leaves_no_trace(tmp_path: Path, slots, pythonpath, user_site) -> None:
    parts = []
    if user_site:
        site_dir = tmp_path / "usersite"
        site_dir.mkdir()
        (site_dir / "sitecustomize.py").write_text("import os\nos.environ['USER_SITE_RAN'] = '1'\n")
        parts.append(str(site_dir))
    if pythonpath == "REPO":
        parts.append(str(REPO / "src"))
    pp = os.pathsep.join(parts) if parts else pythonpath
    base = _env(pp)
    plain = _run(SHOW, base, tmp_path)
    assert plain.returncode == 0, plain.stderr
    path = slots.prepare([0])[0]
    env = dict(base)
    env.update(plain_start_env({PROGRESS_ENV: path}, base))
    booted = _run(SHOW, env, tmp_path)
    assert booted.returncode == 0, booted.stderr
    assert booted.stderr == ""
    a, b = json.loads(plain.stdout), json.loads(booted.stdout)
    assert b == a  # sys.path, the environment, sitecustomize, a child's environment
    assert (b["user_site_ran"] == "1") is user_site
    assert slots.read(0).pid > 0  # it did arm: the slot knows the worker


STEPS = textwrap.dedent("""
    import io, os, sys, time
    import torch
    from fastelastic.progress import _worker as w
    s = w._slot
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
    seen = {}

    class Probe(io.BytesIO):
        def write(self, b):
            seen["in_save"] = (s[w.F_SUSPEND], s[w.F_SUSPEND_KIND])
            return super().write(b)

    torch.save(model.state_dict(), Probe())
    seen["after_save"] = (s[w.F_SUSPEND], s[w.F_SUSPEND_KIND])
    model.eval()
    seen["eval"] = bool(s[w.F_EVAL_NS])
    model.train()
    seen["train"] = bool(s[w.F_EVAL_NS])
    model.eval()
    opt.step()  # a step ends an evaluation too
    seen["step_ends_eval"] = bool(s[w.F_EVAL_NS])
    pid = os.fork()
    if pid == 0:
        opt.step(); opt.step()  # a forked child is not the rank
        os._exit(0 if w._slot is None else 3)
    _, status = os.waitpid(pid, 0)
    seen["child"] = os.waitstatus_to_exitcode(status)
    import fastelastic.progress
    fastelastic.progress.step()
    with fastelastic.progress.suspend():
        seen["custom"] = s[w.F_SUSPEND_KIND]
    seen["dump_sig"] = s[w.F_DUMP_SIG]
    print(repr(seen))
""")


@pytest.mark.torch
def test_marks_land_in_the_slot(tmp_path: Path, slots) -> None:
    pytest.importorskip("torch", reason="!!! torch is not installed: torch marks untested")
    base = _env(str(REPO / "src"))
    path = slots.prepare([0])[0]
    env = dict(base)
    env.update(plain_start_env({PROGRESS_ENV: path}, base))
    r = _run(STEPS, env, tmp_path)
    assert r.returncode == 0, r.stderr
    seen = eval(r.stdout.strip())  # noqa: S307 - our own repr
    assert seen["in_save"] == (1, w.K_SAVE)
    assert seen["after_save"] == (0, 0)
    assert seen == {**seen, "eval": True, "train": False, "step_ends_eval": False, "child": 0,
                    "custom": w.K_CUSTOM}
    v = slots.read(0)
    assert v.steps == 3 + 1 + 1  # three steps, the one ending the evaluation, step()
    assert v.hooked and seen["dump_sig"] == w.DUMP_SIGNAL
    # it exited: its end marked (no suspend), and its dump signal disarmed (faulthandler's
    # handler is gone)
    assert v.suspend == 0 and v.end_ns >= v.last_ns > 0 and v.dump_sig == 0


def test_explicit_step_without_torch(tmp_path: Path, slots) -> None:
    base = _env(str(REPO / "src"))
    path = slots.prepare([0])[0]
    env = dict(base)
    env.update(plain_start_env({PROGRESS_ENV: path}, base))
    script = ("import sys, fastelastic.progress as p\np.step(); p.step()\n"
              "print('torch' in sys.modules)\n")
    r = _run(script, env, tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr
    assert slots.read(0).steps == 2
    r = _run(script, base, tmp_path)  # not a checked worker: a no-op
    assert r.returncode == 0, r.stderr


def test_no_slot_no_injection() -> None:
    env = {"A": "1"}
    assert plain_start_env(env, {"PYTHONPATH": "/x"}) is env
