"""A stand-in agent for the SIGKILL test: starts workers that each start a grandchild.

Usage: python orphan_agent.py LOG_DIR {binary|fork-thread|spawn}. Workers' stdout is tee'd, so
each worker's ``<worker pid> <grandchild pid>`` line appears on our stdout with a
``[orphanN]:`` header; then we block until killed.
"""

import sys
import threading

import mpworkers

from fastelastic.multiprocessing import DefaultLogsSpecs, Std, start_processes


def main(log_dir: str, mode: str) -> None:
    nprocs = 2
    if mode == "binary":
        entry = "/bin/sh"
        args = {r: ("-c", 'sleep 60 & echo "$$ $!"; wait') for r in range(nprocs)}
    else:
        entry = mpworkers.spawn_grandchild
        args = {r: (None, False) for r in range(nprocs)}
    method = "fork" if mode == "fork-thread" else "spawn"

    def start():
        start_processes(
            "orphan",
            entry,
            args,
            {r: {} for r in range(nprocs)},
            DefaultLogsSpecs(log_dir=log_dir, tee=Std.OUT),
            start_method=method,
        )

    if mode == "fork-thread":  # not the main thread: no parent-death signal, only the guardian
        t = threading.Thread(target=start)
        t.start()
        t.join()
    else:
        start()
    sys.stdin.read()  # block until killed


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
