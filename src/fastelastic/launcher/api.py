"""The launcher API torch users call: ``LaunchConfig``, ``elastic_launch``, ``launch_agent``.

Mirrors ``torch.distributed.launcher.api`` (torch 2.13). Differences: four extra
``LaunchConfig`` fields (``exit_barrier_timeout``, ``events_endpoint``, ``preload``,
``hang_timeout``), torch is never imported, and a ``ChildFailedError`` raised here carries
``run_log_dir`` (the job's log directory) so that the failure report can say where the full
logs are.
"""

from __future__ import annotations

import logging
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastelastic import events, metrics
from fastelastic.agent.server.api import WorkerSpec
from fastelastic.agent.server.local_elastic_agent import LocalElasticAgent
from fastelastic.errors import SignalException
from fastelastic.multiprocessing import DefaultLogsSpecs, LogsSpecs
from fastelastic.multiprocessing.errors import ChildFailedError
from fastelastic.numa import as_numa_options
from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous import registry as rdzv_registry
from fastelastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = ["LaunchConfig", "elastic_launch", "launch_agent"]

logger = logging.getLogger(__name__)


@dataclass
class LaunchConfig:
    """What ``launch_agent`` needs to run one node of an elastic job.

    Args:
        min_nodes: the job starts once this many nodes joined the rendezvous.
        max_nodes: the most nodes the job runs on.
        nproc_per_node: workers started by the agent on this node.
        logs_specs: where worker output and error files go (default ``DefaultLogsSpecs()``).
        run_id: job id shared by all nodes (a random one is made when empty).
        role: the workers' role name.
        rdzv_endpoint: endpoint of the rendezvous backend, usually ``HOST:PORT``.
        rdzv_backend: rendezvous backend name (``static``, ``c10d``, ``etcd``...).
        rdzv_configs: extra backend settings (``timeout``, ``join_timeout``...).
        rdzv_timeout: legacy; sets ``rdzv_configs["timeout"]`` when not -1 (default 900 s).
        max_restarts: how many times the worker group may be restarted.
        monitor_interval: seconds between health checks of the workers.
        start_method: ``spawn``, ``fork`` or ``forkserver`` (for function entrypoints).
        log_line_prefix_template: prefix for worker log lines (``${role_name}``,
            ``${rank}``, ``${local_rank}``).
        metrics_cfg: passed to ``fastelastic.metrics.initialize_metrics``.
        local_addr: the address other nodes and workers reach this node at: rank 0's
            ``MASTER_ADDR``, and the workers' stores this node hosts (default: its FQDN,
            looked up when first needed). The fast rendezvous (backends ``c10d`` and
            ``etcd``) does not tell nodes apart by it: each launcher has its own identity
            (hostname, pid and a random nonce). torch's dynamic rendezvous (``c10d-v2``,
            ``etcd-v2``) names a node by it and its pid, as torch does.
        event_log_handler: name of a registered ``fastelastic.events`` handler.
        numa_options: NUMA binding (``--numa-binding``): a mode name or a ``NumaOptions``
            (fastelastic's or torch's, read by its attributes); see :mod:`fastelastic.numa`.
        signals_to_handle: signals forwarded to the workers (comma separated names).
        duplicate_stdout_filters: stdout lines matching any of these also go to a file.
        duplicate_stderr_filters: stderr lines matching any of these also go to a file.
        virtual_local_rank: every worker gets LOCAL_RANK=0 and only its own GPU visible.
        shutdown_timeout: seconds between SIGTERM and SIGKILL when stopping workers
            (default ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30).
        exit_barrier_timeout: seconds a finished node waits for the others (fastelastic).
        events_endpoint: ``tcp://HOST:PORT`` where ``fastelastic watch`` listens; the agent
            publishes its events and status there over ZeroMQ (fastelastic).
        preload: modules imported once by a worker zygote that forks every Python worker
            (fastelastic; ``None``: ``$FASTELASTIC_PRELOAD``; see ``fastrun --preload``).
        hang_timeout: seconds with no progress on any rank (optimizer steps, after the
            first) before the job counts as hung and restarts, or ``"auto"`` (at least 30 s
            and 5 x the longest interval between steps seen); 0 is off (fastelastic;
            ``None``: ``$FASTELASTIC_HANG_TIMEOUT``, else off; see ``fastrun --hang-timeout``).
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: LogsSpecs | None = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: int | None = None
    exit_barrier_timeout: float = 300.0
    events_endpoint: str | None = None
    preload: list[str] | None = None
    hang_timeout: float | str | None = None

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = 900
        if self.logs_specs is None:
            self.logs_specs = DefaultLogsSpecs()
        if self.shutdown_timeout is None:
            self.shutdown_timeout = int(os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "30"))
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")
        # a mode name, ours or torch's NumaOptions (read by its attributes); a bad one fails here
        self.numa_options = as_numa_options(self.numa_options)


class elastic_launch:  # noqa: N801 - torch's spelling
    """Runs ``entrypoint`` under an elastic agent on this node: ``elastic_launch(cfg, fn)(*args)``.

    ``entrypoint`` is a function (its return values come back by global rank) or a command
    (``"script.py"``, or ``sys.executable`` with the script in ``args``).

    Example::

        outputs = elastic_launch(LaunchConfig(1, 1, 4, rdzv_backend="c10d",
                                              rdzv_endpoint="localhost:0"), train)(lr)
        print(outputs[0])
    """

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Callable[..., Any] | str | None,
        health_check_server: Any | None = None,
    ) -> None:
        self._config = config
        self._entrypoint = entrypoint
        self._health_check_server = health_check_server

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(
            self._config,
            self._entrypoint,
            list(args),
            health_check_server=self._health_check_server,
        )


def _get_entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """A function's ``__name__``; for the interpreter, its first non-option argument."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((a for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""


def _get_addr_and_port(params: RendezvousParameters) -> tuple[str | None, int | None]:
    """MASTER_ADDR/MASTER_PORT for the static backend (taken from its endpoint), else None."""
    if params.backend != "static":
        return None, None
    endpoint = params.endpoint.strip()
    if not endpoint:
        raise ValueError(
            "Endpoint is missing in endpoint. Try to add --master-addr and --master-port"
        )
    addr, port = parse_rendezvous_endpoint(endpoint, default_port=-1)
    if port == -1:
        raise ValueError(f"port is missing in endpoint: {endpoint}. Try to specify --master-port")
    return addr, port


class _Events:
    """Taps the agent's event destinations and publishes them to ``config.events_endpoint``."""

    def __init__(self, endpoint: str, spec: WorkerSpec) -> None:
        from fastelastic.events.handlers import register_handler, unregister_handler
        from fastelastic.watch.publisher import EventPublisher, PublishingHandler, agent_status

        self._unregister = unregister_handler
        self._register = register_handler
        self.agent: Any = None
        self.publisher = EventPublisher(
            endpoint, status=lambda: agent_status(self.agent, spec)
        )
        # The user's destination keeps getting every event; ours is a tap in front of it.
        user = spec.event_log_handler
        self._name = f"fastelastic-publish-{id(self)}"
        inner = events.get_logging_handler(user)
        register_handler(self._name, PublishingHandler(self.publisher, inner))
        spec.event_log_handler = self._name
        # Rendezvous events (membership) go to the fixed "dynamic_rendezvous" destination.
        self._rdzv_prev = events.get_logging_handler("dynamic_rendezvous")
        register_handler(
            "dynamic_rendezvous", PublishingHandler(self.publisher, self._rdzv_prev), replace=True
        )

    def watch_failures(self, agent: Any) -> None:
        """Publishes each worker failure (rank, exit code or signal) the moment it is seen.

        The agent records worker events only when the run ends, so a failure followed by a
        restart would otherwise never reach the watcher.
        """
        monitor = getattr(agent, "_monitor_workers", None)
        if monitor is None:
            return

        def monitored(worker_group: Any) -> Any:
            result = monitor(worker_group)
            for rank, f in sorted(getattr(result, "failures", {}).items()):
                code = int(f.exitcode)
                sig = f.signal_name() if code < 0 else None
                self.publisher.publish_event({
                    "name": "fastelastic.worker.failed",
                    "source": "AGENT",
                    "metadata": {"global_rank": rank, "local_rank": f.local_rank,
                                 "exit_code": code, "signal": sig, "pid": f.pid},
                })
            return result

        agent._monitor_workers = monitored

    def close(self, state: str | None) -> None:
        if state is not None:
            self.publisher.set_final(state=state, workers_alive=0)
        self._register("dynamic_rendezvous", self._rdzv_prev, replace=True)
        self._unregister(self._name)
        self.publisher.close()


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    health_check_server: Any | None = None,
) -> dict[int, Any]:
    """Runs one node's agent until the job ends; returns its workers' results by global rank.

    Raises:
        ChildFailedError: workers failed after the allowed restarts; ``run_log_dir`` names the
            job's log directory.
        SignalException: the launcher received one of ``signals_to_handle``.
    """
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        logger.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    entrypoint_name = _get_entrypoint_name(entrypoint, args)
    logger.info(
        "Starting elastic_operator: entrypoint=%s nodes=%s:%s nproc_per_node=%s run_id=%s "
        "rdzv=%s@%s max_restarts=%s", entrypoint_name, config.min_nodes, config.max_nodes,
        config.nproc_per_node, config.run_id, config.rdzv_backend, config.rdzv_endpoint,
        config.max_restarts,
    )
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(params)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle

    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        event_log_handler=config.event_log_handler,
        numa_options=config.numa_options,
        duplicate_stdout_filters=config.duplicate_stdout_filters,
        duplicate_stderr_filters=config.duplicate_stderr_filters,
        virtual_local_rank=config.virtual_local_rank,
        preload=config.preload,
    )
    agent = LocalElasticAgent(
        spec=spec,
        logs_specs=config.logs_specs,  # type: ignore[arg-type]
        start_method=config.start_method,
        exit_barrier_timeout=config.exit_barrier_timeout,
        log_line_prefix_template=config.log_line_prefix_template,
        shutdown_timeout=config.shutdown_timeout,  # type: ignore[arg-type]
        health_check_server=health_check_server,
        hang_timeout=config.hang_timeout,
    )
    tap: _Events | None = None
    final_state: str | None = "FAILED"
    shutdown_rdzv = True
    try:
        if config.events_endpoint:
            tap = _Events(config.events_endpoint, spec)
            tap.agent = agent
            tap.watch_failures(agent)
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = agent.run()
        events.record(agent.get_event_succeeded(), spec.event_log_handler)
        if result is None:  # the rendezvous closed before this node joined (torch: AttributeError)
            final_state = "SUCCEEDED"
            return {}
        if result.is_failed():
            err = ChildFailedError(name=entrypoint_name, failures=result.failures)
            err.run_log_dir = _run_log_dir(config.logs_specs)  # type: ignore[attr-defined]
            raise err
        final_state = "SUCCEEDED"
        return result.return_values  # type: ignore[no-any-return]
    except ChildFailedError:
        raise
    except SignalException:
        # Keep the rendezvous open: closing it would end this run id for every node.
        shutdown_rdzv = False
        final_state = "STOPPED"
        events.record(agent.get_event_failed(), spec.event_log_handler)
        raise
    except Exception:
        events.record(agent.get_event_failed(), spec.event_log_handler)
        raise
    finally:
        if shutdown_rdzv:
            spec.rdzv_handler.shutdown()
        if tap is not None:
            tap.close(final_state)


def _run_log_dir(logs_specs: Any) -> str | None:
    for attr in ("run_log_dir", "_run_log_dir"):
        value = getattr(logs_specs, attr, None)
        if value:
            return str(value)
    root = getattr(logs_specs, "root_log_dir", None)
    return str(root) if root else None
