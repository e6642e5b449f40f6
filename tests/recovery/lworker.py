"""A worker for the leave tests: logs its start and steps; on SIGTERM it lingers (a checkpoint).

Appends JSON lines to ``$RECOVERY_OUT/events.jsonl``: ``start`` and ``step`` (with ``node``,
``pid``, ``t``, ``world``, ``restart``), and on SIGTERM ``term`` then, after
``$NODE_LINGER_S`` seconds, ``term_end`` before exiting 0. In a world of ``$DONE_WORLD`` (and
once ``$DONE_FILE`` exists, if set) it exits 0 after ``$DONE_S`` seconds; otherwise it steps
every 0.1 s for up to 600 s.
"""

import json
import os
import signal
import time

OUT = os.path.join(os.environ["RECOVERY_OUT"], "events.jsonl")
WORLD = int(os.environ["WORLD_SIZE"])


def log(ev: str, **kw: object) -> None:
    line = json.dumps({"ev": ev, "node": os.environ.get("NODE_NAME", "?"), "pid": os.getpid(),
                       "t": time.time(), "world": WORLD,
                       "restart": int(os.environ["TORCHELASTIC_RESTART_COUNT"]), **kw})
    fd = os.open(OUT, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, (line + "\n").encode())  # one O_APPEND write: lines never interleave
    os.close(fd)


def on_term(signum: int, frame: object) -> None:
    log("term")
    time.sleep(float(os.environ.get("NODE_LINGER_S", "0")))  # the work a preempted job does
    log("term_end")
    os._exit(0)


signal.signal(signal.SIGTERM, on_term)
log("start")
DONE_FILE = os.environ.get("DONE_FILE")  # if set, a world finishes only once this file exists
done = WORLD == int(os.environ.get("DONE_WORLD", "0")) and (
    not DONE_FILE or os.path.exists(DONE_FILE))
run_s = float(os.environ["DONE_S"]) if done else 600
end = time.monotonic() + run_s
step = 0
while time.monotonic() < end:
    log("step", step=step)
    step += 1
    time.sleep(min(0.1, max(0.0, end - time.monotonic())))
