"""``fastrun`` (and ``python -m fastelastic.run``): the torchrun-compatible launcher.

Replace ``torchrun`` with ``fastrun`` and change nothing else: the flags, their defaults, the
``PET_<NAME>`` environment fallbacks, the worker environment and the single-node switch from
the static to the c10d rendezvous are torchrun's (torch 2.13). Two flags are new:

* ``--exit-barrier-timeout SECONDS``: how long a finished node waits for the others.
* ``--events-endpoint tcp://HOST:PORT``: every agent publishes its events as JSON over ZeroMQ
  to that address, where ``fastelastic watch tcp://HOST:PORT`` listens (the watcher binds,
  the agents connect, so all agents of a job can share one endpoint).

Everything after the training script (or ``-m module``) goes to the script verbatim.

The ``fastrun`` command (:func:`console_main`) exits with status 2 and one line on stderr on
bad flags, and ends a failed job with a report naming the root-cause rank, its host, exit code
or signal, its traceback and where the logs are. :func:`main` is torchrun's, for calling from
Python: it returns None on success and raises instead of exiting. torch is never imported by
the launcher.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import uuid
from argparse import ArgumentParser, Namespace
from collections.abc import Callable
from typing import Any, NoReturn

from fastelastic.launcher.args import (
    check_env,
    determine_local_world_size,
    env,
    get_args_parser,
    parse_args,
    parse_min_max_nnodes,
)
from fastelastic.multiprocessing.errors import record

__all__ = [
    "check_env",
    "config_from_args",
    "console_main",
    "determine_local_world_size",
    "env",
    "get_args_parser",
    "get_rdzv_endpoint",
    "get_use_env",
    "main",
    "parse_args",
    "parse_min_max_nnodes",
    "run",
    "run_script_path",
]

logger = logging.getLogger("fastelastic.run")  # also when run as `python -m fastelastic.run`

_EVENTS_ENDPOINT_RE = re.compile(r"^(tcp://(\[[0-9a-fA-F:.]+\]|[^:/\[\]]+):[0-9]{1,5}|ipc://.+)$")


def get_rdzv_endpoint(args: Namespace) -> str:
    """The rendezvous endpoint: ``--rdzv-endpoint``, or MASTER_ADDR:MASTER_PORT for static."""
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return f"{args.master_addr}:{args.master_port}"
    return str(args.rdzv_endpoint)


def get_use_env(args: Namespace) -> bool:
    """Whether workers read LOCAL_RANK from the environment (always, unless ``use_env`` is off)."""
    return bool(getattr(args, "use_env", True))


def _parse_rdzv_conf(text: str) -> dict[str, Any]:
    conf: dict[str, Any] = {}
    if not text.strip():
        return conf
    for kv in text.strip().split(","):
        key, sep, value = kv.partition("=")
        key, value = key.strip(), value.strip()
        if not key:
            raise ValueError("--rdzv-conf must be key=value,key=value")
        if not sep or not value:
            raise ValueError(f"--rdzv-conf option {key!r} has no value")
        conf[key] = value
    return conf


def _known_backends() -> set[str]:
    from fastelastic.rendezvous import rendezvous_handler_registry

    return set(getattr(rendezvous_handler_registry, "_registry", {}))


def _check_script(args: Namespace) -> None:
    """Raises ValueError when the program to launch cannot exist (it would fail on every rank)."""
    script = args.training_script
    if args.run_path:
        if not os.path.isfile(script):
            raise ValueError(f"training script {script!r} not found")
        return
    if args.module:
        from importlib.machinery import PathFinder

        top = script.split(".")[0]
        if top in sys.builtin_module_names:
            return
        if PathFinder.find_spec(top, [os.getcwd(), *sys.path]) is None:
            raise ValueError(f"module {top!r} (of -m {script}) not found")
        return
    if args.no_python:
        import shutil

        if shutil.which(script) is None:
            raise ValueError(f"program {script!r} not found or not executable")
        return
    if not os.path.exists(script):
        raise ValueError(f"training script {script!r} not found")


def _validate(args: Namespace) -> None:
    """Checks everything that can be checked before anything starts; raises ValueError."""
    try:
        min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    except (RuntimeError, ValueError):
        raise ValueError(f"--nnodes {args.nnodes}: expected N or MIN:MAX with integers") from None
    if not 0 < min_nodes <= max_nodes:
        raise ValueError(
            f"--nnodes {args.nnodes}: need 0 < MIN <= MAX (got min={min_nodes}, max={max_nodes})"
        )
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.monitor_interval <= 0:
        raise ValueError(f"--monitor-interval must be > 0, got {args.monitor_interval}")
    if args.exit_barrier_timeout < 0:
        raise ValueError(f"--exit-barrier-timeout must be >= 0, got {args.exit_barrier_timeout}")
    if args.shutdown_timeout is not None and args.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.module and args.no_python and not args.run_path:
        raise ValueError("Don't use both the '--no-python' flag and the '--module' flag")
    if args.run_path and not os.path.isabs(args.training_script):
        raise ValueError(f"--run-path needs an absolute script path, got {args.training_script!r}")
    if not args.standalone:
        from fastelastic.rendezvous.registry import _register_out_of_tree_handler

        known = _known_backends()
        if args.rdzv_backend not in known and not _register_out_of_tree_handler(
            args.rdzv_backend
        ):
            raise ValueError(
                f"unknown rendezvous backend {args.rdzv_backend!r} "
                f"(known: {', '.join(sorted(known))}, or a torchrun.handlers entry point)"
            )
    if args.events_endpoint and not _EVENTS_ENDPOINT_RE.match(args.events_endpoint):
        raise ValueError(
            f"--events-endpoint {args.events_endpoint!r}: expected tcp://HOST:PORT or ipc://PATH"
        )
    from fastelastic.multiprocessing import Std

    _std("--redirects", args.redirects, Std)
    _std("--tee", args.tee, Std)
    _local_ranks(args.local_ranks_filter)
    _preload(args)
    _hang_timeout(args)
    _checkpoint_drain(args)
    _checkpoint_copy_to(args)
    _parse_rdzv_conf(args.rdzv_conf)
    determine_local_world_size(args.nproc_per_node)
    _check_script(args)


def _preload(args: Namespace) -> list[str] | None:
    """``--preload`` as a list (None when not given: the agent reads FASTELASTIC_PRELOAD)."""
    value = getattr(args, "preload", None)
    if value is None:
        return None
    from fastelastic.multiprocessing._zygote import parse_preload

    return list(parse_preload(value))


def _hang_timeout(args: Namespace) -> float | str | None:
    """``--hang-timeout`` in seconds or ``"auto"`` (None when not given: the agent reads the
    env var)."""
    from fastelastic.agent.server._hang import AUTO, HANG_TIMEOUT_ENV, parse_hang_timeout

    value = getattr(args, "hang_timeout", None)
    if value is None:
        env = os.environ.get(HANG_TIMEOUT_ENV)
        if env is not None:
            try:
                parse_hang_timeout(env)
            except ValueError as e:
                raise ValueError(f"{HANG_TIMEOUT_ENV}: {e}") from None
        return None
    seconds = parse_hang_timeout(value)
    return "auto" if seconds == AUTO else seconds


def _checkpoint_drain(args: Namespace) -> None:
    """``--checkpoint-drain-timeout``, checked and handed to the agent (in this process) as
    ``$FASTELASTIC_CHECKPOINT_DRAIN_TIMEOUT``."""
    from fastelastic.checkpoint._owner import DRAIN_ENV

    value = getattr(args, "checkpoint_drain_timeout", None)
    name = "--checkpoint-drain-timeout"
    if value is None:
        value, name = os.environ.get(DRAIN_ENV), DRAIN_ENV
        if value is None:
            return
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"{name} {value!r}: expected seconds (a number, 0 or more)")
    os.environ[DRAIN_ENV] = repr(seconds)


def _checkpoint_copy_to(args: Namespace) -> None:
    """``--checkpoint-copy-to``, checked and handed to the agent (in this process) as
    ``$FASTELASTIC_CHECKPOINT_COPY_TO``."""
    from fastelastic.checkpoint._copy import COPY_TO_ENV, parse_copy_to

    value = getattr(args, "checkpoint_copy_to", None)
    if value is None:
        value = os.environ.get(COPY_TO_ENV)
        if value is None:
            return
    parse_copy_to(value)  # raises ValueError with the flag's name
    os.environ[COPY_TO_ENV] = value


def _local_ranks(text: str) -> set[int] | None:
    if not text:
        return None
    try:
        ranks = {int(x) for x in text.split(",")}
    except ValueError:
        raise ValueError(
            "--local-ranks-filter must be a comma-separated list of integers, e.g. 0,1,2"
        ) from None
    return ranks


def _std(flag: str, value: str, std: Any) -> Any:
    try:
        return std.from_str(value)
    except ValueError:
        raise ValueError(
            f"{flag} {value!r}: expected 0 (none), 1 (stdout), 2 (stderr), 3 (both), "
            "or per local rank as 0:1,1:2"
        ) from None


def _logs_specs_class(name: str | None) -> type:
    from fastelastic.multiprocessing import DefaultLogsSpecs

    if name is None:
        return DefaultLogsSpecs
    from importlib import metadata

    group = metadata.entry_points().select(group="torchrun.logs_specs", name=name)
    for ep in group:
        return ep.load()  # type: ignore[no-any-return]
    raise ValueError(f"Could not find entrypoint under 'torchrun.logs_specs[{name}]' key")


def config_from_args(args: Namespace) -> tuple[Any, Callable[..., Any] | str, list[str]]:
    """Builds the :class:`~fastelastic.launcher.api.LaunchConfig`, the entrypoint and its args.

    Also sets ``OMP_NUM_THREADS=1`` in this process's environment (inherited by the workers)
    when it is unset and there is more than one worker per node, as torchrun does.

    Raises:
        RuntimeError: ``--nnodes`` has more than two parts (as torch).
        AssertionError: ``--nnodes`` MIN > MAX or < 1, or ``--max-restarts`` < 0 (as torch).
        ValueError: any other invalid flag value.
    """
    from fastelastic.launcher.api import LaunchConfig
    from fastelastic.multiprocessing import Std

    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    # torch's error types for these two (AssertionError); fastrun's _validate says ValueError first
    if not 0 < min_nodes <= max_nodes:
        raise AssertionError(
            f"min_nodes must be > 0 and <= max_nodes, got min_nodes={min_nodes}, "
            f"max_nodes={max_nodes}"
        )
    if args.max_restarts < 0:
        raise AssertionError("max_restarts must be >= 0")
    if args.rdzv_backend != "static" and not args.rdzv_endpoint:
        logger.warning(
            "master_addr is only used for static rdzv_backend and when rdzv_endpoint "
            "is not specified."
        )
    if args.node_rank != 0 and args.rdzv_backend != "static":
        logger.warning(
            "node_rank is only used for static rdzv_backend. It will be ignored "
            "for rdzv_backend=%s.",
            args.rdzv_backend,
        )
    nproc_per_node = determine_local_world_size(args.nproc_per_node)
    if "OMP_NUM_THREADS" not in os.environ and nproc_per_node > 1:
        logger.warning(
            "\n*****************************************\n"
            "Setting OMP_NUM_THREADS environment variable for each process to be "
            "%s in default, to avoid your system being overloaded, "
            "please further tune the variable for optimal performance in "
            "your application as needed. \n"
            "*****************************************",
            1,
        )
        os.environ["OMP_NUM_THREADS"] = "1"

    rdzv_configs = _parse_rdzv_conf(args.rdzv_conf)
    if args.rdzv_backend == "static":
        rdzv_configs["rank"] = args.node_rank
    logs_specs = _logs_specs_class(args.logs_specs)(
        log_dir=args.log_dir,
        redirects=_std("--redirects", args.redirects, Std),
        tee=_std("--tee", args.tee, Std),
        local_ranks_filter=_local_ranks(args.local_ranks_filter),
    )
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc_per_node,
        run_id=args.rdzv_id,
        role=args.role,
        rdzv_endpoint=get_rdzv_endpoint(args),
        rdzv_backend=args.rdzv_backend,
        rdzv_configs=rdzv_configs,
        max_restarts=args.max_restarts,
        monitor_interval=args.monitor_interval,
        start_method=args.start_method,
        log_line_prefix_template=os.getenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"),
        local_addr=args.local_addr,
        logs_specs=logs_specs,
        event_log_handler=args.event_log_handler,
        numa_options=args.numa_binding,
        signals_to_handle=args.signals_to_handle,
        duplicate_stdout_filters=args.duplicate_stdout_filters,
        duplicate_stderr_filters=args.duplicate_stderr_filters,
        virtual_local_rank=args.virtual_local_rank,
        shutdown_timeout=args.shutdown_timeout,
        exit_barrier_timeout=args.exit_barrier_timeout,
        events_endpoint=args.events_endpoint,
        preload=_preload(args),
        hang_timeout=_hang_timeout(args),
    )

    cmd: Callable[..., Any] | str
    cmd_args: list[str] = []
    if args.run_path:
        cmd = run_script_path
        cmd_args.append(args.training_script)
    elif not args.no_python:
        cmd = os.getenv("PYTHON_EXEC", sys.executable)
        cmd_args.append("-u")
        if args.module:
            cmd_args.append("-m")
        cmd_args.append(args.training_script)
    else:
        if args.module:
            raise ValueError("Don't use both the '--no-python' flag and the '--module' flag")
        cmd = args.training_script
    if not get_use_env(args):
        cmd_args.append("--local-rank=${local_rank}")
    cmd_args.extend(args.training_script_args)
    return config, cmd, cmd_args


def run_script_path(training_script: str, *training_script_args: str) -> None:
    """Runs ``training_script`` with :func:`runpy.run_path` as ``__main__`` in this interpreter."""
    import runpy

    sys.argv = [training_script, *training_script_args]
    runpy.run_path(sys.argv[0], run_name="__main__")


def _apply_rendezvous_defaults(args: Namespace) -> None:
    """torchrun's rules: --standalone, and static on one node without a port, become c10d."""
    if args.standalone:
        args.rdzv_backend = "c10d"
        args.rdzv_endpoint = "localhost:0"
        args.rdzv_id = str(uuid.uuid4())
        logger.info(
            "\n**************************************\n"
            "Rendezvous info:\n"
            "--rdzv-backend=%s --rdzv-endpoint=%s --rdzv-id=%s\n"
            "**************************************\n",
            args.rdzv_backend,
            args.rdzv_endpoint,
            args.rdzv_id,
        )
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint and args.master_port is None:
        _, max_nodes = parse_min_max_nnodes(args.nnodes)
        if max_nodes == 1:
            args.rdzv_backend = "c10d"
            args.rdzv_endpoint = "localhost:0"
            args.rdzv_id = str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500


def _fill_defaults(args: Namespace) -> None:
    """Gives a Namespace built by torch's parser or by hand fastrun's defaults where it has none.

    Only options are filled (flags fastrun adds, like ``--exit-barrier-timeout``, and any
    other a hand-built Namespace omits); the script and its arguments must be there.
    """
    for action in get_args_parser()._actions:
        if action.option_strings and action.dest != "help" and not hasattr(args, action.dest):
            setattr(args, action.dest, action.default)


def run(args: Namespace) -> Any:
    """Launches the job described by ``args``; returns rank -> return value.

    ``args`` is what :func:`parse_args` returns, or a Namespace built by torch's
    ``torch.distributed.run.get_args_parser()`` or by hand: options it lacks take fastrun's
    defaults (which honour ``PET_<NAME>``).

    Raises:
        ChildFailedError: a worker failed (after the allowed restarts).
        SignalException: the launcher received one of ``--signals-to-handle``.
        ValueError: an invalid flag value.
    """
    from fastelastic.launcher.api import elastic_launch

    _fill_defaults(args)
    _apply_rendezvous_defaults(args)
    config, cmd, cmd_args = config_from_args(args)
    return elastic_launch(config=config, entrypoint=cmd)(*cmd_args)


@record
def main(args: list[str] | None = None) -> None:
    """torchrun's ``main``, for calling from Python: parse, check, launch; None on success.

    Raises:
        SystemExit: an unknown or malformed flag (status 2, from argparse, as torch).
        ValueError: an invalid flag value, or a script or module that does not exist.
        ChildFailedError: the job failed (after the allowed restarts).
        SignalException: the launcher received one of ``--signals-to-handle``.
    """
    ns = parse_args(args)
    _validate(ns)
    run(ns)


def console_main(args: list[str] | None = None) -> NoReturn:
    """The ``fastrun`` command: parse, check, launch, report, and exit.

    Exit status: 0 on success, 1 when the job failed (after the failure report), 2 on bad
    flags (one line on stderr), 128+N when stopped by signal N. As PID 1 (a container's entry
    point) it reaps orphans and forwards signals to the launcher (:mod:`.launcher._pid1`).
    """
    from fastelastic.launcher._pid1 import become_init_if_pid1
    from fastelastic.launcher.report import run_and_report
    from fastelastic.utils.logging import configure_cli_logging

    become_init_if_pid1()  # a pod's PID 1: the launcher runs in a child, PID 1 reaps orphans
    configure_cli_logging()
    try:
        parser: ArgumentParser = get_args_parser()
    except ValueError as e:  # a PET_<NAME> variable that cannot be parsed
        print(f"fastrun: error: {e}", file=sys.stderr)
        sys.exit(2)
    ns = parser.parse_args(args)
    try:
        _validate(ns)
    except ValueError as e:
        parser.error(str(e))
    sys.exit(run_and_report(lambda: run(ns), parser))


if __name__ == "__main__":
    console_main()
