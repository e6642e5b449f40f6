"""Runs torch's own FileTimerServer (it SIGKILLs its own process after a reap, so it gets one).

argv: <fifo path> <max_interval>; prints ``ready`` then every log_event as ``event <name> <json>``.
"""

import sys
import threading

from torch.distributed.elastic.timer import FileTimerServer


def _log_event(name, request):
    body = request.to_json() if request is not None else "null"
    sys.stdout.write(f"event {name} {body}\n")
    sys.stdout.flush()


def main() -> None:
    server = FileTimerServer(
        sys.argv[1], "torch-run", max_interval=float(sys.argv[2]), log_event=_log_event
    )
    server.start()
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    threading.Event().wait()


if __name__ == "__main__":
    main()
