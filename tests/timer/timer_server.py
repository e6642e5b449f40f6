"""Hosts a FileTimerServer in its own process, so the workers the tests start are not its
descendants (torch's docs allow a server hosted apart from the process that forks the workers).

argv: <fifo path> <impl: ours | ours-agent | torch>; ``ours-agent`` is constructed as the agent
constructs its own (``allow_same_user=False``). Prints ``ready`` then every log_event as
``event [name, request]`` (JSON); stops when stdin closes.
"""

import json
import sys


def _log_event(name, request):
    body = json.loads(request.to_json()) if request is not None else None
    sys.stdout.write("event " + json.dumps([name, body]) + "\n")
    sys.stdout.flush()


def main() -> None:
    path, impl = sys.argv[1], sys.argv[2]
    if impl == "torch":
        from torch.distributed.elastic.timer import FileTimerServer

        server = FileTimerServer(path, "r", max_interval=0.05, log_event=_log_event)
    else:
        from fastelastic.timer import FileTimerServer

        server = FileTimerServer(
            path,
            "r",
            max_interval=0.05,
            log_event=_log_event,
            allow_same_user=impl == "ours",
        )
    server.start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.read()
    server.stop()


if __name__ == "__main__":
    main()
