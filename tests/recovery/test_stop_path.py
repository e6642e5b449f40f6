"""The agent's stop path with real signals: a second Ctrl-C hurries the stop, never orphans."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "multiprocessing"))

from mphelpers import is_alive, wait_gone  # noqa: E402
from netns import wait_for  # noqa: E402

# The worker and its child both ignore SIGTERM and SIGINT: only SIGKILL stops them. (A file:
# the launcher substitutes ``$``-templates in arguments.)
_STUBBORN = ('trap "" TERM INT; sleep 300 & echo "$$ $!" > "$PIDS.tmp"; mv "$PIDS.tmp" "$PIDS"; '
             'wait\n')


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO / "src")
    env.update(extra)
    return env


@pytest.mark.timeout(60)
@pytest.mark.parametrize("first,second", [(signal.SIGINT, signal.SIGINT),
                                          (signal.SIGTERM, signal.SIGINT),
                                          (signal.SIGINT, signal.SIGTERM)])
def test_second_signal_kills_stubborn_workers(tmp_path, first, second):
    pids_file = tmp_path / "pids"
    script = tmp_path / "stubborn.sh"
    script.write_text(_STUBBORN)
    err = open(tmp_path / "agent.err", "wb")  # noqa: SIM115 - closed in finally
    agent = subprocess.Popen(
        [sys.executable, "-m", "fastelastic.run", "--standalone", "--nproc-per-node", "1",
         "--no-python", "/bin/sh", str(script)],
        env=_env(PIDS=str(pids_file)), stdout=subprocess.DEVNULL, stderr=err,
    )
    try:
        text = wait_for(lambda: pids_file.exists() and pids_file.read_text().strip(), 30,
                        "the worker's pid file")
        worker, child = (int(x) for x in text.split())
        assert is_alive(worker) and is_alive(child)
        agent.send_signal(first)
        log = tmp_path / "agent.err"
        try:
            wait_for(lambda: b"death signal" in log.read_bytes(), 20,
                     "the agent to start stopping")
        except TimeoutError as e:
            raise AssertionError(f"{e}; the agent said:\n{log.read_text()[-3000:]}") from None
        # the workers ignore the first signal's SIGTERM: the agent would wait 30 s for them
        assert agent.poll() is None, log.read_text()[-3000:]
        assert is_alive(worker) and is_alive(child), log.read_text()[-3000:]
        t0 = time.monotonic()
        agent.send_signal(second)
        rc = agent.wait(timeout=15)
        took = time.monotonic() - t0
        assert rc != 0, log.read_text()
        assert took < 10, f"the second signal took {took:.1f}s to stop the agent"
        survivors = [p for p in (worker, child) if not wait_gone(p, 5)]
        assert survivors == [], f"orphaned: {survivors}\n{log.read_text()[-3000:]}"
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        err.close()
        for p in (pids_file.read_text().split() if pids_file.exists() else []):
            try:
                os.kill(int(p), signal.SIGKILL)
            except ProcessLookupError:
                pass
