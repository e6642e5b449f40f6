"""Worker of the zygote tests; run as ``python -u zygote_worker.py MODE OUT_DIR [ARGS]``.

Modes: ``dump`` writes what a program can see of how it was started (environment, argv,
``sys.path``, ``__main__``, signal state, process group, stdio) to ``OUT_DIR/<RANK>.json``;
``ready-wait [term|ignore-term]`` writes its pid file, then blocks (``term``: a SIGTERM handler
notes the signal and exits 0; ``ignore-term``: SIGTERM ignored); ``fail`` / ``fail-record``
raise (the latter under ``@record``); ``exit N`` exits with N; ``end-late`` / ``exit-late``
end normally / by ``sys.exit(message)`` with a thread, an atexit handler and unflushed files
still to finish; ``rng`` dumps the RNG draws;
``grandchild`` starts ``sleep`` in its group, writes both pids, then blocks; ``wait-first``
writes ``<RANK>.<restart>.pid`` and blocks on the first attempt only; ``modules`` writes
whether torch and torch._dynamo were imported before it ran.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

MODE = sys.argv[1]
OUT = sys.argv[2]
RANK = os.environ.get("RANK", "0")


def _write(name: str, data: object) -> None:
    tmp = os.path.join(OUT, f".{name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, os.path.join(OUT, name))


def _block(seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


def _sig_lines() -> dict:
    with open("/proc/self/status") as f:
        return {ln.split(":")[0]: ln.split()[1] for ln in f if ln.startswith(("SigBlk", "SigIgn",
                                                                            "SigCgt"))}


def _fd_target(fd: int) -> str:
    try:
        st = os.fstat(fd)
    except OSError:
        return "closed"
    return f"{st.st_dev}:{st.st_ino}:{os.get_inheritable(fd)}"


if MODE == "dump":
    main = sys.modules["__main__"]
    _write(f"{RANK}.json", {
        "env": dict(os.environ),
        "argv": sys.argv,
        "orig_argv": sys.orig_argv,
        "path": sys.path,
        "file": __file__,
        "name": __name__,
        "spec": re.sub(" at 0x[0-9a-f]+", "", repr(__spec__)),
        "loader": type(globals().get("__loader__")).__name__,
        "cached": globals().get("__cached__"),
        "main_is_globals": main.__dict__ is globals(),
        "cwd": os.getcwd(),
        "sig": _sig_lines(),
        "sigint": repr(signal.getsignal(signal.SIGINT)),
        "handlers": {s.name: repr(signal.getsignal(s)) for s in signal.Signals
                     if s not in (signal.SIGKILL, signal.SIGSTOP)},
        "pgid_is_pid": os.getpgid(0) == os.getpid(),
        "sid": os.getsid(0),
        "stdin": _fd_target(0),
        "stdout_buffered": sys.stdout.line_buffering,
        "unbuffered": sys.stdout.write_through,
        "fds": sorted(int(x) for x in os.listdir("/proc/self/fd")),
        "pid": os.getpid(),
        "ppid": os.getppid(),
    })
    if os.environ.get("FE_DUMP_THEN_TORCH"):  # a training script: torch and an optimizer
        import torch

        torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
elif MODE == "modules":  # which of these were imported before the script ran
    _write(f"{RANK}.json", {"torch": "torch" in sys.modules,
                            "torch._dynamo": "torch._dynamo" in sys.modules,
                            "ppid": os.getppid()})
elif MODE == "ready-wait":
    how = sys.argv[3] if len(sys.argv) > 3 else ""
    if how == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif how == "term":
        def _on_term(signum, frame):
            _write(f"{RANK}.sig", {"signal": signum})
            sys.exit(0)
        signal.signal(signal.SIGTERM, _on_term)
    _write(f"{RANK}.pid", {"pid": os.getpid(), "ppid": os.getppid()})
    _block()
elif MODE == "wait-first":  # the first attempt blocks, a restarted one exits 0
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _write(f"{RANK}.{attempt}.pid", {"pid": os.getpid(), "ppid": os.getppid()})
    if attempt == "0":
        _block()
elif MODE == "fail":
    raise RuntimeError(f"boom from rank {RANK}")
elif MODE == "fail-record":
    from fastelastic.multiprocessing.errors import record

    @record
    def main() -> None:
        raise RuntimeError(f"recorded boom from rank {RANK}")

    main()
elif MODE in ("fail-late", "end-late", "exit-late"):
    # what Python does at exit (an uncaught exception, the end of the script, or an uncaught
    # SystemExit): join the non-daemon threads, run the atexit handlers, flush stdout (and,
    # at a normal exit, the files left open)
    import atexit
    import threading

    gate = threading.Event()

    def _late() -> None:
        gate.wait(30)
        print(f"thread of rank {RANK} finished", flush=True)

    threading.Thread(target=_late).start()
    atexit.register(lambda: _write(f"{RANK}.atexit", {"thread_done": not any(
        t.name != "MainThread" and t.is_alive() for t in threading.enumerate())}))
    sys.stdout = open(sys.stdout.fileno(), "w", buffering=1 << 16, closefd=False)
    sys.stdout.write(f"unflushed output of rank {RANK}\n")
    if MODE != "fail-late":
        left_open = open(os.path.join(OUT, f"{RANK}.left_open"), "w", buffering=1 << 16)
        left_open.write(f"never flushed nor closed by rank {RANK}\n")
    threading.Timer(0.2, gate.set).start()
    if MODE == "fail-late":
        raise RuntimeError(f"late boom from rank {RANK}")
    if MODE == "exit-late":
        sys.exit(f"goodbye from rank {RANK}")
elif MODE == "exit":
    sys.exit(int(sys.argv[3]))
elif MODE == "rng":
    import numpy as np

    _write(f"{RANK}.rng", {"numpy": int(np.random.randint(0, 2**62)), "random": random.random(),
                           "ppid": os.getppid()})
elif MODE == "grandchild":
    child = subprocess.Popen(["sleep", "60"])
    _write(f"{RANK}.pid", {"pid": os.getpid(), "ppid": os.getppid(), "grandchild": child.pid})
    _block()
elif MODE == "orphan":  # leaves a grandchild in its process group and exits at once
    child = subprocess.Popen(["sleep", "60"])
    _write(f"{RANK}.pid", {"pid": os.getpid(), "ppid": os.getppid(), "grandchild": child.pid})
else:
    raise SystemExit(f"unknown mode {MODE}")
