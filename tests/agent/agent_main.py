"""Runs one LocalElasticAgent in its own process (for multi-agent and signal tests).

Usage: ``python agent_main.py '<json config>'``; prints ``RESULT <json>`` when the run ends.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from fastelastic.agent.server import WorkerSpec
from fastelastic.agent.server.local_elastic_agent import LocalElasticAgent
from fastelastic.multiprocessing import DefaultLogsSpecs, Std
from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    cfg = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    conf = {"rank": cfg["rank"], "timeout": 60, **cfg.get("rdzv_conf", {})}
    handler = get_rendezvous_handler(
        RendezvousParameters(
            backend=cfg.get("backend", "static"),
            endpoint=f"127.0.0.1:{cfg['port']}",
            run_id=cfg.get("run_id", "t"),
            min_nodes=cfg.get("min", cfg["world"]),
            max_nodes=cfg["world"],
            **conf,
        )
    )
    spec = WorkerSpec(
        role=cfg.get("role", "trainer"),
        local_world_size=cfg.get("nproc", 1),
        rdzv_handler=handler,
        entrypoint=sys.executable,
        args=(os.path.join(HERE, "agent_workers.py"), *cfg["args"]),
        max_restarts=cfg.get("max_restarts", 0),
    )
    agent = LocalElasticAgent(
        spec,
        DefaultLogsSpecs(log_dir=cfg.get("log_dir"), tee=Std(cfg.get("tee", 0))),
        exit_barrier_timeout=cfg.get("exit_barrier_timeout", 30),
        log_line_prefix_template=cfg.get("prefix"),
    )
    result = agent.run()
    out = {
        "state": result.state.value,
        "failures": sorted(result.failures),
        "restart_count": agent.restart_count,
    }
    handler.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
