"""Worker functions for the multiprocessing tests (importable by spawn/forkserver children)."""

import os
import signal
import subprocess
import sys


def double(x):
    print(f"out {x}")
    print(f"err {x}", file=sys.stderr)
    return {"rank": int(os.environ["LOCAL_RANK"]), "value": x * 2, "env": os.environ.get("FOO")}


def fail(x):
    raise ValueError(f"boom from {x}")


def exit_code(code):
    sys.exit(code)


def kill_self(sig):
    os.kill(os.getpid(), sig)


def spawn_grandchild(wfd, ignore_term):
    """Starts a grandchild (sleep), reports 'worker_pid grandchild_pid' on wfd or stdout, waits."""
    cmd = ["sh", "-c", "trap '' TERM; sleep 60"] if ignore_term else ["sleep", "60"]
    child = subprocess.Popen(cmd)
    line = f"{os.getpid()} {child.pid}\n"
    if wfd is None:
        print(line, end="", flush=True)
    else:
        os.write(wfd, line.encode())
        os.close(wfd)
    child.wait()


def report_pgid(wfd):
    os.write(wfd, f"{os.getpid()} {os.getpgid(0)} {signal.getsignal(signal.SIGTERM)}\n".encode())
    os.close(wfd)


def block_on_fd(rfd):
    """Exits with the byte value read from rfd (fork start method: the fd is inherited)."""
    data = os.read(rfd, 1)
    sys.exit(data[0] if data else 99)


def signal_dispositions():
    """What this worker's stop signals do: 'default', 'keyboard-interrupt' or 'other'."""
    import signal

    def name(h):
        if h is signal.SIG_DFL:
            return "default"
        if h is signal.default_int_handler:
            return "keyboard-interrupt"
        return "other"

    return {s.name: name(signal.getsignal(s))
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)}


def end_late(out_dir, how):
    """Returns (or exits: ``how`` is ``"exit"``/``"raise"``) with a non-daemon thread still
    running, an atexit handler to run and a file left open and unflushed."""
    import atexit
    import json
    import threading

    rank = os.environ["LOCAL_RANK"]
    gate = threading.Event()
    threading.Thread(target=lambda: gate.wait(30)).start()

    def _at_exit():
        alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
        with open(os.path.join(out_dir, f"{rank}.atexit"), "w") as f:
            json.dump({"threads_left": alive}, f)

    atexit.register(_at_exit)
    left_open = open(os.path.join(out_dir, f"{rank}.left_open"), "w", buffering=1 << 16)  # noqa: SIM115
    left_open.write(f"never flushed nor closed by rank {rank}\n")
    threading.Timer(0.2, gate.set).start()
    if how == "exit":
        sys.exit(f"goodbye from rank {rank}")
    if how == "raise":
        raise RuntimeError(f"late boom from rank {rank}")
    return {"rank": int(rank)}
