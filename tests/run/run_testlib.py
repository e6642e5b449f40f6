"""Helpers for the fastrun tests: launch fastrun/torchrun, free ports, read worker dumps."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from jobtree import end_job, start_job

HERE = Path(__file__).resolve().parent
DUMP = HERE / "dump_env.py"
REPO = HERE.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def base_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.pop("OMP_NUM_THREADS", None)
    env.pop("PYTEST_CURRENT_TEST", None)  # pytest's own, names the phase (setup/call) running
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    env.update(extra)
    return env


def launcher_cmd(which: str) -> list[str]:
    if which == "fastrun":
        return [sys.executable, "-m", "fastelastic.run"]
    # torchrun's console script is torch.distributed.run:main; running the module with this
    # interpreter avoids picking up a shell shim (pyenv) or another Python's torchrun on PATH.
    return [sys.executable, "-m", "torch.distributed.run"]


def run_launcher(which: str, args: list[str], env: dict[str, str], cwd: str | None = None,
                 timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """Runs a launcher to its end; past ``timeout`` its whole job is ended and
    ``TimeoutExpired`` raised (a test that times out first ends it through ``jobtree``)."""
    cmd = [*launcher_cmd(which), *args]
    proc = start(cmd, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        end_job(proc)
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def read_dumps(d: Path) -> dict[int, dict]:
    out = {}
    for p in d.glob("*.json"):
        data = json.loads(p.read_text())
        out[int(data["env"]["RANK"])] = data
    return out


def torch_available() -> bool:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        return False
    return True


class Etcd:
    """A real etcd server on loopback for one test (data in ``data_dir``)."""

    def __init__(self, data_dir: Path) -> None:
        import time
        import urllib.request

        exe = shutil.which("etcd")
        if exe is None:
            import pytest

            pytest.skip("!!! no etcd binary on PATH (CI installs etcd-server): etcd form untested")
        self.port, peer = free_port(), free_port()
        url, purl = f"http://127.0.0.1:{self.port}", f"http://127.0.0.1:{peer}"
        self.proc = subprocess.Popen(
            [exe, "--data-dir", str(data_dir), "--listen-client-urls", url,
             "--advertise-client-urls", url, "--listen-peer-urls", purl,
             "--initial-advertise-peer-urls", purl, "--initial-cluster", f"default={purl}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if b"true" in r.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("etcd did not become healthy within 30 s")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported by the interpreter running the tests (not imported)."""
    import importlib.util

    return importlib.util.find_spec(name) is not None


def start(cmd: list[str], env: dict[str, str], cwd: str | None = None) -> subprocess.Popen[str]:
    """Starts one launcher (or any command) with its output captured, as a ``jobtree`` job:
    whatever ends the test also ends it and every process it started."""
    return start_job(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     text=True)


def finish_all(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str]]:
    """Waits for every process within one shared deadline: (exit code, stdout + stderr) each.

    A process still running at the deadline is killed, with every other one, and the test
    fails naming it, so a hung job never outlives its test.
    """
    import time

    deadline = time.monotonic() + timeout
    out: list[tuple[int, str]] = []
    for p in procs:
        try:
            so, se = p.communicate(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            break
        out.append((p.returncode, so + se))
    if len(out) == len(procs):
        return out
    hung = procs[len(out)]
    report = []
    for p in procs:
        if p.poll() is None:
            p.kill()
        so, se = p.communicate()
        report.append(f"--- {p.args!r}: exit {p.returncode}\n{(so + se)[-2500:]}")
    raise AssertionError(f"{hung.args!r} did not finish within {timeout}s\n" + "\n".join(report))


def env_diff(theirs: dict[str, str], ours: dict[str, str],
             ignore: frozenset[str] | set[str] = frozenset()) -> dict[str, tuple[str | None, ...]]:
    """Variables whose values differ between two worker environments, ``ignore`` left out."""
    return {k: (theirs.get(k), ours.get(k)) for k in sorted(set(theirs) | set(ours))
            if k not in ignore and theirs.get(k) != ours.get(k)}


def wait_listening(port: int, proc: subprocess.Popen[str], timeout: float = 60) -> None:
    """Returns once something accepts connections on 127.0.0.1:``port``; fails if ``proc``
    exits first or ``timeout`` passes."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            so, se = proc.communicate() if proc.poll() is not None else ("", "")
            raise AssertionError(f"nothing listens on port {port} (exit {proc.returncode})\n"
                                 f"{(so + se)[-2500:]}")
        time.sleep(0.05)
