"""Worker entrypoints for the agent tests: callables (importable by spawned children) and a CLI.

Run as a script: ``python agent_workers.py MODE ARGS...`` (the binary entrypoint kind).
"""

from __future__ import annotations

import json
import os
import sys
import time


def publish(path: str, text: str) -> None:
    """Writes a file that readers polling for its existence never see half-written."""
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)

ENV_KEYS = [
    "RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING",
    "TORCHELASTIC_ERROR_FILE",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
]


def env_worker(tag: str) -> dict:
    """Returns the agent-provided environment (plus ``tag``, to check args are passed)."""
    out = {k: os.environ.get(k) for k in ENV_KEYS}
    out["tag"] = tag
    return out


def failing_worker() -> None:
    """Fails on local rank 1 only."""
    if os.environ["LOCAL_RANK"] == "1":
        raise ValueError("worker one is unhappy")


def wait_for(path: str, limit: float = 30.0) -> bool:
    deadline = time.monotonic() + limit
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.005)
    return os.path.exists(path)


def _gloo() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")  # env:// from the agent's variables
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    n = dist.get_world_size()
    assert t.item() == n * (n + 1) / 2, t
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "env":  # env OUTDIR LOCAL_RANK_MACRO
        outdir, lr = argv[1], argv[2]
        data = env_worker(lr)
        with open(os.path.join(outdir, f"{os.environ['RANK']}.json"), "w") as f:
            json.dump(data, f)
        return 0
    if mode == "fail_until":  # fail_until N LOGDIR: exit 3 while restart count < N
        n, logdir = int(argv[1]), argv[2]
        count = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
        publish(os.path.join(logdir, f"r{os.environ['RANK']}_{count}"), str(os.getpid()))
        if count >= n:
            return 0
        # Fail only once every worker of this attempt has logged, so none is stopped first.
        peers = [
            os.path.join(logdir, f"r{r}_{count}") for r in range(int(os.environ["WORLD_SIZE"]))
        ]
        deadline = time.monotonic() + 20
        while not all(os.path.exists(p) for p in peers) and time.monotonic() < deadline:
            time.sleep(0.005)
        return 3
    if mode == "exit":  # exit CODE
        return int(argv[1])
    if mode == "raise":
        print("about to fail", flush=True)
        return 1 // 0
    if mode == "wait":  # wait FLAG: run until the flag file exists
        return 0 if wait_for(argv[1]) else 9
    if mode == "pidwait":  # pidwait DIR FLAG: write our pid then wait
        publish(os.path.join(argv[1], f"pid{os.environ['LOCAL_RANK']}"), str(os.getpid()))
        return 0 if wait_for(argv[2], 60) else 9
    if mode == "timer":  # timer FLAG: arm a 0.3 s watchdog timer, then hang until FLAG
        from fastelastic import timer

        timer.configure(timer.FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
        with timer.expires(after=0.3):
            wait_for(argv[1], 30)
        return 0
    if mode == "elastic":  # elastic DIR WORLD: log the round, hang until the world has WORLD nodes
        with open(
            os.path.join(argv[1], f"{os.environ['RANK']}_{os.environ['GROUP_WORLD_SIZE']}"), "w"
        ):
            pass
        if int(os.environ["GROUP_WORLD_SIZE"]) >= int(argv[2]):
            return 0
        wait_for(os.path.join(argv[1], "never"), 30)
        return 8
    if mode == "sigwait":  # sigwait DIR: write pid, record the first signal received, exit
        import signal

        def on_signal(signum, frame):
            publish(os.path.join(argv[1], f"sig{os.environ['LOCAL_RANK']}"),
                    signal.Signals(signum).name)
            os._exit(0)

        for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            signal.signal(sig, on_signal)
        publish(os.path.join(argv[1], f"pid{os.environ['LOCAL_RANK']}"), str(os.getpid()))
        wait_for(os.path.join(argv[1], "never"), 60)
        return 9
    if mode == "grandchild":  # grandchild DIR: start a sleeping child, write both pids, hang
        import subprocess

        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        pids = f"{os.getpid()} {child.pid}"
        publish(os.path.join(argv[1], f"pids{os.environ['LOCAL_RANK']}"), pids)
        wait_for(os.path.join(argv[1], "never"), 60)
        return 9
    if mode == "gloo":
        _gloo()
        return 0
    print(f"unknown mode {mode}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
