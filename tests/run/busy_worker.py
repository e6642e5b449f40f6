"""A worker that keeps its CPU busy for DUR seconds (wall clock) and records each start."""

import os
import time

out, rank = os.environ["OUT"], os.environ["RANK"]
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")
with open(os.path.join(out, f"start-{rank}-{attempt}-{os.getpid()}"), "w") as f:
    f.write(str(time.time()))
end = time.monotonic() + float(os.environ.get("DUR", "30"))
n = 0
while time.monotonic() < end:
    n += 1
