"""Worker for the agent-restart test: the first attempt hangs under a 0.3 s timer, the next exits 0.

argv: <marker file>. The first attempt writes its pid there.
"""

import os
import signal
import sys

from fastelastic import timer


def main() -> int:
    marker = sys.argv[1]
    if os.path.exists(marker):
        return 0
    with open(marker, "w") as f:
        f.write(str(os.getpid()))
    timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
    with timer.expires(after=0.3, scope="hung-collective"):
        signal.pause()  # a hang only the watchdog ends
    return 3


if __name__ == "__main__":
    sys.exit(main())
