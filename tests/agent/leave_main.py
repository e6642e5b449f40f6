"""Runs ``launch_agent`` over a recording static rendezvous (for the preemption-leave tests).

Usage: ``python leave_main.py OUTDIR PORT [--no-leave]``. The handler appends ``leave`` (with
the workers that had already been signalled then) and ``shutdown`` lines to
``OUTDIR/rdzv.log``; the workers are ``agent_workers.py sigwait OUTDIR`` (they record the
signal they get, then exit).
"""

from __future__ import annotations

import logging
import os
import sys

from fastelastic.launcher.api import LaunchConfig, launch_agent
from fastelastic.rendezvous import rendezvous_handler_registry
from fastelastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = sys.argv[1]


def note(line: str) -> None:
    with open(os.path.join(OUT, "rdzv.log"), "a") as f:
        f.write(line + "\n")


class Recording(StaticTCPRendezvous):
    def get_backend(self) -> str:
        return "recording"

    def leave(self) -> None:
        signalled = sorted(n for n in os.listdir(OUT) if n.startswith("sig"))
        note(f"leave signalled={','.join(signalled) or '-'}")

    def shutdown(self) -> bool:
        note("shutdown")
        return super().shutdown()


class NoLeave(StaticTCPRendezvous):
    def get_backend(self) -> str:
        return "recording"

    def shutdown(self) -> bool:
        note("shutdown")
        return super().shutdown()


def create(params):  # type: ignore[no-untyped-def]
    base = create_rdzv_handler(params)
    cls = NoLeave if "--no-leave" in sys.argv else Recording
    base.__class__ = cls
    return base


logging.basicConfig(level=logging.INFO, stream=sys.stderr)
rendezvous_handler_registry.register("recording", create)
config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, rdzv_backend="recording",
                      rdzv_endpoint=f"127.0.0.1:{sys.argv[2]}", rdzv_configs={"rank": 0},
                      run_id="leave", max_restarts=0, shutdown_timeout=10)
launch_agent(config, sys.executable, [os.path.join(HERE, "agent_workers.py"), "sigwait", OUT])
note("returned")
