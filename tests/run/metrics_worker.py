"""Worker for the /metrics test: attempt 0's rank 0 hangs past its watchdog timer and is killed;
attempt 1's workers report ready and run until DIR/done exists."""

from __future__ import annotations

import os
import sys
import time


def wait_for(path: str, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return True
        time.sleep(0.02)
    return False


def main(outdir: str) -> int:
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    done = os.path.join(outdir, "done")
    if attempt == 0:
        if os.environ["LOCAL_RANK"] == "0":
            from fastelastic import timer

            timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
            with timer.expires(after=0.3):  # the agent's watchdog SIGKILLs us in this block
                wait_for(done, 30)
            return 7
        wait_for(done, 30)  # stopped by the agent when rank 0 is killed
        return 8
    tmp = os.path.join(outdir, f".ready{os.environ['LOCAL_RANK']}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.rename(tmp, os.path.join(outdir, f"ready{os.environ['LOCAL_RANK']}"))
    return 0 if wait_for(done, 60) else 9


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
