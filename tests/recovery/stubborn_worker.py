"""A worker that keeps running through SIGTERM (only SIGKILL stops it); for the stop tests.

Writes ``$STUB_DIR/pid<LOCAL_RANK>`` once its handler is set, and ``term<LOCAL_RANK>`` (the
wall-clock time) when SIGTERM arrives.
"""

import os
import signal
import time

DIR = os.environ["STUB_DIR"]
LR = os.environ["LOCAL_RANK"]


def publish(name: str, text: str) -> None:
    with open(os.path.join(DIR, name + ".tmp"), "w") as f:
        f.write(text)
    os.rename(os.path.join(DIR, name + ".tmp"), os.path.join(DIR, name))


signal.signal(signal.SIGTERM, lambda s, f: publish(f"term{LR}", repr(time.time())))
publish(f"pid{LR}", str(os.getpid()))
end = time.monotonic() + 300
while time.monotonic() < end:
    time.sleep(0.05)
