"""fastrun's command line: every torchrun 2.13 flag, ``PET_<NAME>`` fallbacks, one-line errors."""

from __future__ import annotations

import glob
import os
import re
import sys
from argparse import REMAINDER, Action, ArgumentParser, Namespace
from collections.abc import Sequence
from typing import Any, NoReturn

__all__ = [
    "FastrunArgumentParser",
    "check_env",
    "determine_local_world_size",
    "env",
    "get_args_parser",
    "parse_args",
    "parse_min_max_nnodes",
]

NUMA_MODES = ("node", "socket", "exclusive", "core-complex")

# argparse's test for a word that is a negative number rather than an option
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


class env(Action):  # noqa: N801 - torch's spelling (torch.distributed.argparse_util.env)
    """An option whose default comes from ``PET_<DEST>`` when that variable is set.

    A value on the command line always wins; the environment wins over the declared default.
    """

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kwargs: Any):
        default = os.environ.get(f"PET_{dest.upper()}", default)
        if default:
            required = False
        super().__init__(dest=dest, default=default, required=required, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, values)


class check_env(Action):  # noqa: N801 - torch's spelling
    """A boolean flag that is also on when ``PET_<DEST>`` holds a non-zero integer.

    Raises:
        ValueError: ``PET_<DEST>`` is not an integer (when the parser is built, as torch's).
    """

    def __init__(self, dest: str, default: bool = False, **kwargs: Any):
        raw = os.environ.get(f"PET_{dest.upper()}", "1" if default else "0")
        try:
            value = bool(int(raw))
        except ValueError:
            raise ValueError(f"PET_{dest.upper()}={raw!r} must be an integer (0 or 1)") from None
        super().__init__(dest=dest, const=True, default=value, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, self.const)


class FastrunArgumentParser(ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line on stderr and exit status 2.

    Only the words before the training script (or ``-m module``) are parsed: the first word
    that is not an option or an option's value is the script, and every word after it goes
    to the script verbatim, whatever it looks like (``--``, ``-h``, a fastrun flag or an
    abbreviation of one). torchrun gives those words to argparse too, which fails on the ones
    that abbreviate two of its flags and drops a ``--`` right after the script.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Namespace | None = None
    ) -> tuple[Namespace, list[str]]:
        argv = list(sys.argv[1:] if args is None else args)
        at = self._script_index(argv)
        if at is None:  # no script: argparse says what is missing
            return super().parse_known_args(argv, namespace)
        ns, extras = super().parse_known_args(argv[: at + 1], namespace)
        ns.training_script_args = argv[at + 1:]
        return ns, extras

    def _takes_value(self, option: str) -> bool | None:
        """Whether ``option`` (a full option string or an abbreviation) takes a value.

        None when it names no option of this parser; for an ambiguous abbreviation (which
        argparse rejects anyway) whether any of its candidates does.
        """
        table = self._option_string_actions
        if option in table:
            return table[option].nargs != 0
        if not (self.allow_abbrev and option.startswith("--")):
            return None
        found = [a for s, a in table.items() if s.startswith(option)]
        return any(a.nargs != 0 for a in found) if found else None

    def _script_index(self, argv: list[str]) -> int | None:
        """Index of the training script in ``argv``, classifying words as argparse does."""
        i = 0
        while i < len(argv):
            word = argv[i]
            if word == "--":
                return i + 1 if i + 1 < len(argv) else None
            if (len(word) < 2 or word[0] not in self.prefix_chars
                    or (word not in self._option_string_actions
                        and (_NEGATIVE_NUMBER.match(word) or " " in word))):
                return i
            i += 1 + self._values_after(word)
        return None

    def _values_after(self, word: str) -> int:
        """How many of the following words the option ``word`` consumes (0 or 1)."""
        if word[1] in self.prefix_chars:  # --long, --long=value, --abbrev
            name, eq, _ = word.partition("=")
            return 0 if eq else int(bool(self._takes_value(name)))
        # -x, -xVALUE, or flags chained as -abc
        for k in range(1, len(word)):
            takes = self._takes_value(word[0] + word[k])
            if takes is None:
                return 0
            if takes:
                return 1 if k == len(word) - 1 else 0
        return 0


def comma_separated_list(value: str) -> list[str]:
    """Splits ``a,b`` into items; ``,,`` stands for a literal comma inside an item."""
    marker = "\0"
    return [item.replace(marker, ",") for item in value.replace(",,", marker).split(",")]


def get_args_parser(prog: str = "fastrun") -> ArgumentParser:
    """Builds the parser with torchrun 2.13's flags and defaults plus fastrun's own.

    Every option accepts the dash and the underscore spelling, and (except ``--logs-specs`` and
    ``--numa-binding``, as in torchrun) falls back to the ``PET_<NAME>`` environment variable.
    """
    p = FastrunArgumentParser(
        prog=prog,
        description="Launch an elastic multi-process job (a drop-in replacement for torchrun).",
    )
    a = p.add_argument
    # Sizes.
    a("--nnodes", action=env, type=str, default="1:1",
      help="Number of nodes, N or MIN:MAX for an elastic job.")
    a("--nproc-per-node", "--nproc_per_node", action=env, type=str, default="1",
      help="Workers per node: an integer, auto, cpu, gpu or xpu.")
    # Rendezvous.
    a("--rdzv-backend", "--rdzv_backend", action=env, type=str, default="static",
      help="Rendezvous backend (static, c10d, fastelastic, etcd, etcd-v2, c10d-v2).")
    a("--rdzv-endpoint", "--rdzv_endpoint", action=env, type=str, default="",
      help="Rendezvous endpoint, usually HOST:PORT. With the c10d or fastelastic backend, a "
      "comma-separated list of candidates HOST:PORT,HOST:PORT,... keeps the job going when the "
      "store's host is lost (docs/failover.md).")
    a("--rdzv-id", "--rdzv_id", action=env, type=str, default="none",
      help="Job id shared by all nodes of the job.")
    a("--rdzv-conf", "--rdzv_conf", action=env, type=str, default="",
      help="Extra rendezvous settings as key=value,key=value.")
    a("--standalone", action=check_env,
      help="Single-node job: host a c10d rendezvous on a free localhost port with a fresh run "
      "id; --rdzv-backend/--rdzv-endpoint/--rdzv-id are then ignored.")
    # Workers.
    a("--max-restarts", "--max_restarts", action=env, type=int, default=0,
      help="How many times the worker group may be restarted before the job fails.")
    a("--monitor-interval", "--monitor_interval", action=env, type=float, default=0.1,
      help="Seconds between worker health checks (fastelastic reacts to exits at once).")
    a("--start-method", "--start_method", action=env, type=str, default="spawn",
      choices=["spawn", "fork", "forkserver"], help="How worker processes are created.")
    a("--event-log-handler", "--event_log_handler", action=env, type=str, default="null",
      help="Name of a registered event handler (fastelastic.events).")
    a("--role", action=env, type=str, default="default", help="Role name of the workers.")
    a("-m", "--module", action=check_env,
      help="Run the script argument as a module, as `python -m` does.")
    a("--no-python", "--no_python", action=check_env,
      help="Execute the script directly instead of through the Python interpreter.")
    a("--run-path", "--run_path", action=check_env,
      help="Run the script (an absolute path) with runpy.run_path inside the worker "
      "interpreter; takes precedence over --no-python.")
    a("--log-dir", "--log_dir", action=env, type=str, default=None,
      help="Base directory for the job's log files (a per-run sub-directory is created).")
    a("-r", "--redirects", action=env, type=str, default="0",
      help="Send worker streams to files: 1 stdout, 2 stderr, 3 both, or per local rank as "
      "0:1,1:2.")
    a("-t", "--tee", action=env, type=str, default="0",
      help="Like --redirects but also keep the stream on the console.")
    a("--local-ranks-filter", "--local_ranks_filter", action=env, type=str, default="",
      help="Show console output only for these local ranks, e.g. 0,1.")
    a("--duplicate-stdout-filters", "--duplicate_stdout_filters", action=env,
      type=comma_separated_list, default=[],
      help="Also copy stdout lines containing any of these strings to a file (,, escapes a comma).")
    a("--duplicate-stderr-filters", "--duplicate_stderr_filters", action=env,
      type=comma_separated_list, default=[],
      help="Also copy stderr lines containing any of these strings to a file.")
    # Static rendezvous / torch.distributed.launch compatibility.
    a("--node-rank", "--node_rank", type=int, action=env, default=0,
      help="Rank of this node (static rendezvous only).")
    a("--master-addr", "--master_addr", default="127.0.0.1", type=str, action=env,
      help="Address of the rank-0 node (static rendezvous only).")
    a("--master-port", "--master_port", default=None, type=int, action=env,
      help="Port on the rank-0 node (static rendezvous only; 29500 when not given).")
    a("--local-addr", "--local_addr", default=None, type=str, action=env,
      help="Address other nodes use to reach this node (default: this host's FQDN).")
    a("--logs-specs", "--logs_specs", default=None, type=str,
      help="Name of a torchrun.logs_specs entry point providing the LogsSpecs class.")
    a("--numa-binding", "--numa_binding", type=str, choices=NUMA_MODES, default=None,
      help="Bind the worker of local rank i to CPUs near GPU i, as torchrun (no numactl "
      "needed). A worker that cannot be bound fails the launch; FASTELASTIC_NUMA_FALLBACK=1 "
      "runs it unbound, with a warning.")
    a("--signals-to-handle", "--signals_to_handle", action=env, type=str,
      default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
      help="Signals the launcher forwards to the workers, comma separated.")
    a("--shutdown-timeout", "--shutdown_timeout", action=env, type=int, default=None,
      help="Seconds between SIGTERM and SIGKILL when stopping workers "
      "(default: TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30).")
    a("--virtual-local-rank", "--virtual_local_rank", action=check_env,
      help="Give every worker LOCAL_RANK=0 and restrict CUDA_VISIBLE_DEVICES to its own GPU.")
    # fastrun only.
    a("--exit-barrier-timeout", "--exit_barrier_timeout", action=env, type=float, default=300.0,
      help="Seconds a finished node waits for the other nodes to finish (torchrun: fixed 300).")
    a("--events-endpoint", "--events_endpoint", action=env, type=str, default=None,
      help="Publish the agent's events as JSON over ZeroMQ to tcp://HOST:PORT, where "
      "`fastelastic watch tcp://HOST:PORT` listens. All agents of a job may share it.")
    a("--preload", type=str, default=None,
      help="Import these modules (comma separated, e.g. torch) once in a worker zygote that "
      "forks every Python worker, so starts and restarts skip Python's startup and the "
      "imports (default: $FASTELASTIC_PRELOAD); with torch, torch._dynamo too (every "
      "optimizer imports it; FASTELASTIC_PRELOAD_DYNAMO=0: not). Needs "
      "OMP_NUM_THREADS=1-like thread-free imports and no CUDA at import; see docs/preload.md.")
    a("--hang-timeout", "--hang_timeout", type=str, default=None,
      help="SECONDS|auto: restart the job when no rank made progress (an optimizer step, "
      "after the first) for this many seconds, with no save, load or evaluation under way; "
      "the hung rank is named and every rank's stacks go to the log directory. auto: at "
      "least 30 s and 5x the longest interval between steps seen. 0 is off (default: "
      "$FASTELASTIC_HANG_TIMEOUT, else off).")
    a("--checkpoint-drain-timeout", "--checkpoint_drain_timeout", type=str, default=None,
      help="SECONDS: how long the agent's exit waits for fastelastic.checkpoint's disk write "
      "of the newest step (the one under way and the one waiting for it; after a crash, a "
      "hang verdict or SIGTERM). 0: no wait (default: "
      "$FASTELASTIC_CHECKPOINT_DRAIN_TIMEOUT, else 300).")
    a("--checkpoint-copy-to", "--checkpoint_copy_to", type=str, default=None,
      help="next|+K|off: the agent of which node holds a copy of this node's "
      "fastelastic.checkpoint shards, copied behind training, for a node's loss: next (the "
      "next node in rank order), +K (the K-th next: another failure domain when nodes are "
      "numbered rack by rack) or off (default: $FASTELASTIC_CHECKPOINT_COPY_TO, else next).")
    a("training_script", type=str,
      help="The program to launch in every worker, followed by its own arguments.")
    a("training_script_args", nargs=REMAINDER)
    return p


def parse_args(args: list[str] | None = None) -> Namespace:
    """Parses ``args`` (default ``sys.argv[1:]``) with :func:`get_args_parser`."""
    return get_args_parser().parse_args(args)


def parse_min_max_nnodes(nnodes: str) -> tuple[int, int]:
    """Parses ``N`` or ``MIN:MAX``.

    Raises:
        RuntimeError: more than two ``:``-separated parts (torch's error type).
        ValueError: a part is not an integer.
    """
    parts = nnodes.split(":")
    if len(parts) not in (1, 2):
        raise RuntimeError(f'nnodes={nnodes} is not in "MIN:MAX" format')
    try:
        nums = [int(x) for x in parts]
    except ValueError:
        raise ValueError(f"nnodes={nnodes!r} must be N or MIN:MAX with integers") from None
    return nums[0], nums[-1]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _nvidia_gpu_count() -> int:
    """GPUs the worker would see, read from the driver without loading CUDA or torch."""
    present = len(glob.glob("/proc/driver/nvidia/gpus/*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    ids = [v for v in visible.split(",") if v.strip()]
    count = 0
    for v in ids:
        if v.strip().startswith("-"):
            break  # CUDA stops enumerating at the first invalid id
        count += 1
    return min(count, present)


def determine_local_world_size(nproc_per_node: str) -> int:
    """Turns ``--nproc-per-node`` (an integer, ``cpu``, ``gpu``, ``auto``, ``xpu``...) into a count.

    ``cpu``, ``gpu`` and ``auto`` are answered without importing torch (CPU affinity and the
    NVIDIA driver's device list); other accelerator names ask torch, as torchrun does.

    Raises:
        ValueError: an unknown value, or a device type with no device present.
    """
    try:
        n = int(nproc_per_node)
    except ValueError:
        pass
    else:
        if n < 1:
            raise ValueError(f"--nproc-per-node must be at least 1, got {n}")
        return n
    if nproc_per_node == "cpu":
        return _cpu_count()
    if nproc_per_node == "gpu":
        n = _nvidia_gpu_count()
        if n == 0:
            raise ValueError("--nproc-per-node gpu: CUDA is not available (no visible GPU)")
        return n
    if nproc_per_node == "auto":
        return _nvidia_gpu_count() or _cpu_count()
    if nproc_per_node in _TORCH_DEVICE_KINDS:
        return _torch_device_count(nproc_per_node)
    raise ValueError(
        f"--nproc-per-node {nproc_per_node!r}: expected an integer, auto, cpu, gpu or xpu"
    )


# Accelerators only torch can count; torchrun matches the private-use backend by its default name.
_TORCH_DEVICE_KINDS = ("xpu", "privateuseone")


def _torch_device_count(kind: str) -> int:
    """Asks torch about an accelerator fastrun cannot count itself (only for those values)."""
    try:
        import torch  # noqa: PLC0415 - only for rare accelerator names, never on the common path
    except ImportError:
        raise ValueError(f"--nproc-per-node {kind}: needs torch, which is not installed") from None
    mod = getattr(torch, kind, None)
    if mod is None or not mod.is_available():
        raise ValueError(f"--nproc-per-node {kind}: {kind} is not available")
    return int(mod.device_count())
