"""A worker process for the timer tests: runs timer ops, reports, then blocks until stdin closes.

argv: <fifo path> <client: ours|torch> <json list of ops>
ops:  ["acquire", scope, after_seconds, signal]   ["release", scope]   ["stackdump"]
stdout: one line ``ready {"pid": P, "deadlines": {scope: monotonic deadline}}``, then
``signal N`` for every SIGUSR1/SIGURG received.
"""

import json
import os
import signal
import sys
import time


def _on_signal(signum, frame):
    sys.stdout.write(f"signal {signum}\n")
    sys.stdout.flush()


def main() -> None:
    path, kind, ops = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if kind == "torch":
        from torch.distributed.elastic.timer import FileTimerClient
    else:
        from fastelastic.timer import FileTimerClient
    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGURG, _on_signal)
    clients: dict[int, object] = {}
    deadlines = {}
    for op in ops:
        if op[0] == "acquire":
            _, scope, after, sig = op
            client = clients.setdefault(sig, FileTimerClient(path, signal=sig))
            wall, mono = time.time(), time.monotonic()
            client.acquire(scope, wall + after)
            deadlines[scope] = mono + after
        elif op[0] == "release":
            next(iter(clients.values())).release(op[1])
        elif op[0] == "stackdump":
            from fastelastic.timer import enable_stack_dump

            enable_stack_dump()
    sys.stdout.write("ready " + json.dumps({"pid": os.getpid(), "deadlines": deadlines}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()


if __name__ == "__main__":
    main()
