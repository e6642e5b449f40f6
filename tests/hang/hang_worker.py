"""A plain gloo training loop for the hang tests: one rank hangs, saves, evaluates or pauses.

Settings come from the environment (HANG_*); every step is appended to $HANG_OUT/steps.jsonl
as {"rank", "restart", "step", "t"} (wall clock), so a test reads what the ranks did.
"""

import atexit
import ctypes
import json
import os
import threading
import time

import torch
import torch.distributed as dist

RANK = int(os.environ["RANK"])
RESTART = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
OUT = os.environ["HANG_OUT"]
HOW = os.environ.get("HANG_HOW", "none")
HANG_RANK = int(os.environ.get("HANG_RANK", "-1"))
HANG_STEP = int(os.environ.get("HANG_STEP", "5"))
STEPS = int(os.environ.get("HANG_STEPS", "12"))
STEP_S = float(os.environ.get("HANG_STEP_S", "0.02"))
SLOW_FIRST_S = float(os.environ.get("HANG_SLOW_FIRST_S", "0"))


def _at(name):
    """(step, seconds) of one event: HANG_<NAME>_AT and HANG_<NAME>_S."""
    env = os.environ
    return int(env.get(f"HANG_{name}_AT", "-1")), float(env.get(f"HANG_{name}_S", "0"))


SAVE_AT, SAVE_S = _at("SAVE")
END = os.environ.get("HANG_END", "")  # after training: upload (atexit/thread), deadlock
END_S = float(os.environ.get("HANG_END_S", "0"))
END_RANK = int(os.environ.get("HANG_END_RANK", "-1"))  # -1: every rank
# deadlock_before_end: the rank that deadlocks (1), or the local rank given here
END_LOCAL_RANK = int(os.environ.get("HANG_END_LOCAL_RANK", "-1"))
EVAL_AT, EVAL_S = _at("EVAL")
PAUSE_AT, PAUSE_S = _at("PAUSE")


def note(**kw):
    with open(os.path.join(OUT, "steps.jsonl"), "a") as f:
        f.write(json.dumps({"rank": RANK, "restart": RESTART, "pid": os.getpid(),
                            "t": time.time(), **kw}) + "\n")


def first(what):
    """True for the first process of the job to ask (any rank, any restart)."""
    try:
        os.close(os.open(os.path.join(OUT, f"{what}.once"), os.O_CREAT | os.O_EXCL))
    except FileExistsError:
        return False
    return True


def hung_in_native_call():
    libc = ctypes.PyDLL(None)
    while True:  # a C call that holds the GIL (a signal cuts sleep short: it sleeps again)
        libc.sleep(3600)


def hung_in_native_call_once():
    ctypes.PyDLL(None).sleep(3600)  # the GIL held; the script goes on if a signal ends it


def hung_in_sleep():
    time.sleep(3600)


def hung_in_deadlock():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def hung_in_python_loop():
    n = 0
    while True:
        n += 1


def crashed():
    os._exit(1)  # the comparison: a crash, restarted as usual


HANGS = {"crash": crashed, "native": hung_in_native_call,
         "native_once": hung_in_native_call_once, "sleep": hung_in_sleep,
         "deadlock": hung_in_deadlock, "loop": hung_in_python_loop}


class SlowFile:
    """A file whose first write takes SAVE_S (a slow filesystem), inside torch.save."""

    def __init__(self, path):
        self.f = open(path, "wb")
        self.slow = True

    def write(self, b):
        if self.slow:
            self.slow = False
            time.sleep(SAVE_S)
        return self.f.write(b)

    def flush(self):
        self.f.flush()

    def close(self):
        self.f.close()


def main():
    note(event="start")  # the phases of a restart: the script runs, then its group forms
    dist.init_process_group("gloo")
    note(event="init")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    for step in range(STEPS):
        note(step=step)
        if RANK == HANG_RANK and step == HANG_STEP and HOW in HANGS and first("hang"):
            note(event="hang", how=HOW)
            HANGS[HOW]()
        if step == 0 and SLOW_FIRST_S and RANK == 0:
            time.sleep(SLOW_FIRST_S)
        if step == PAUSE_AT and RANK == 0 and first("pause"):
            time.sleep(PAUSE_S)
        if step == SAVE_AT and RANK == 0:
            f = SlowFile(os.path.join(OUT, f"ckpt.{RANK}"))
            torch.save(model.state_dict(), f)
            f.close()
        if step == EVAL_AT:
            model.eval()
            end = time.monotonic() + EVAL_S
            with torch.no_grad():
                while time.monotonic() < end:
                    model(x)
                    time.sleep(0.05)
            model.train()
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        time.sleep(STEP_S)
    note(event="done")
    if END == "deadlock_before_end" and (
            RANK == 1 if END_LOCAL_RANK < 0 else int(os.environ["LOCAL_RANK"]) == END_LOCAL_RANK):
        hung_in_deadlock()  # after the last step, before the program's end (a teardown in it)
    dist.destroy_process_group()
    if END and END_RANK in (-1, RANK):
        at_end()


def upload():
    time.sleep(END_S)  # a slow upload of the finished run's files
    note(event="uploaded")


def at_end():
    """What the program leaves to the interpreter's exit (after its main code returned)."""
    if END == "upload" and RANK % 2 == 0:
        atexit.register(upload)
    elif END == "upload":
        threading.Thread(target=upload, name="upload").start()  # non-daemon: joined at exit
    elif END == "deadlock" or (END == "upload_deadlock" and RANK == 1):
        atexit.register(hung_in_deadlock)
    elif END == "upload_deadlock":
        atexit.register(upload)


if __name__ == "__main__":
    main()
