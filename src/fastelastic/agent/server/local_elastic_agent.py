"""LocalElasticAgent: runs a node's workers as local processes and wakes the moment one exits."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import time
from string import Template
from typing import TYPE_CHECKING, Any

from fastelastic import events
from fastelastic.agent.server._hang import HangAction, HangWatch, resolve_hang_timeout
from fastelastic.agent.server._runloop import AgentAction, AgentState
from fastelastic.agent.server.api import (
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
)
from fastelastic.agent.server.health_check_server import (
    HealthCheckServer,
    create_healthcheck_server,
)
from fastelastic.metrics import prof, put_metric

if TYPE_CHECKING:
    from fastelastic.multiprocessing import LogsSpecs, PContext

__all__ = [
    "TORCHELASTIC_ENABLE_FILE_TIMER",
    "TORCHELASTIC_HEALTH_CHECK_PORT",
    "TORCHELASTIC_TIMER_FILE",
    "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT",
    "LocalElasticAgent",
]

logger = logging.getLogger(__name__)

TORCHELASTIC_ENABLE_FILE_TIMER = "TORCHELASTIC_ENABLE_FILE_TIMER"
TORCHELASTIC_HEALTH_CHECK_PORT = "TORCHELASTIC_HEALTH_CHECK_PORT"
TORCHELASTIC_TIMER_FILE = "TORCHELASTIC_TIMER_FILE"
TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT = "TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT"
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE = "TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"
_IDLE_WAKEUP = 5.0  # seconds; the longest the monitor blocks when no timer is needed


def _resolve_uninterruptible_state_timeout(explicit: float | None) -> float:
    """Explicit argument, else the env var, else 0 (disabled); bad values disable."""
    if explicit is not None:
        return max(0.0, float(explicit))
    raw = os.environ.get(TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT, "")
    try:
        return max(0.0, float(raw)) if raw else 0.0
    except ValueError:
        logger.warning(
            "ignoring %s=%r: not a number", TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT, raw
        )
        return 0.0


def _wchan(pid: int) -> str:
    """``", in the kernel's NAME"``: where a process sleeps (``/proc/PID/wchan``), or ""."""
    try:
        with open(f"/proc/{pid}/wchan") as f:
            name = f.read().strip()
    except OSError:
        return ""
    return f", in the kernel's {name}" if name and name != "0" else ""


def substitute_local_rank(args: tuple, local_rank: int) -> tuple:
    """Replaces ``${local_rank}`` in every string argument (torch's ``macros.substitute``)."""
    from fastelastic.utils.api import macros

    return tuple(macros.substitute(list(args), str(local_rank)))


def _route_to(host: str) -> str:
    """This host's address on the route to ``host`` (the rendezvous store's): the address
    other nodes reach this one at, where no ``--local-addr`` names it ("" if unknown)."""
    if not host:
        return ""
    try:
        infos = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)
        family, _t, _p, _c, addr = infos[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # a datagram socket's connect sends nothing: it picks the route
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return ""


class LocalElasticAgent(SimpleElasticAgent):
    """Handles the host-local workers of one ``WorkerSpec`` (torch's ``LocalElasticAgent``).

    Workers are callables (started with ``start_method``: spawn, fork or forkserver; their
    return values are collected by global rank) or binaries. Each gets torch's environment
    (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, ... TORCHELASTIC_RESTART_COUNT) so unmodified
    torch scripts work. Unlike torch, the agent does not poll: it blocks on one pidfd per
    worker and wakes the moment a worker exits; it only wakes on a timer (``monitor_interval``)
    to ask the rendezvous whether new nodes are waiting.

    Log lines are prefixed with ``log_line_prefix_template`` (else
    ``$TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE``), where ``${role_name}``, ``${rank}``,
    ``${local_rank}`` and ``${hostname}`` are substituted.

    ``TORCHELASTIC_ENABLE_FILE_TIMER=1`` starts a ``FileTimerServer`` watchdog (its FIFO is
    passed to workers as ``TORCHELASTIC_TIMER_FILE``); ``TORCHELASTIC_HEALTH_CHECK_PORT``
    starts an HTTP health endpoint (``GET /health``).

    Example::

        spec = WorkerSpec(role="trainer", local_world_size=4, entrypoint=trainer,
                          args=("foobar",), rdzv_handler=handler)
        result = LocalElasticAgent(spec, DefaultLogsSpecs()).run()
        if not result.is_failed():
            print(result.return_values[0])
    """

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: LogsSpecs,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        health_check_server: HealthCheckServer | None = None,
        uninterruptible_state_timeout: float | None = None,
        hang_timeout: float | str | None = None,
    ):
        super().__init__(spec, exit_barrier_timeout, shutdown_timeout)
        if logs_specs is None:
            raise ValueError("LocalElasticAgent needs a LogsSpecs (e.g. DefaultLogsSpecs())")
        self._start_method = start_method
        self._pcontext: PContext | None = None
        self._rdzv_handler = spec.rdzv_handler
        if log_line_prefix_template is None:
            log_line_prefix_template = os.environ.get(TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE) or None
        self._log_line_prefix_template = log_line_prefix_template
        self._worker_watchdog: Any = None
        self._logs_specs = logs_specs
        self._health_check_server = health_check_server
        self._uninterruptible_state_timeout = _resolve_uninterruptible_state_timeout(
            uninterruptible_state_timeout
        )
        self._uninterruptible_state_first_seen: dict[int, float] = {}
        self._stuck: dict[int, str] = {}  # local rank -> why it counts as wedged (D-state)
        self._exits_pending = True  # a full check is due (start, or an exit was reported)
        self._health_started = False
        self.numa_binding: str | None = None  # "MODE: RANK->CPUS ..." of the last start
        self._zygote: Any = None
        self._zygote_tried = False
        seconds = resolve_hang_timeout(hang_timeout)  # None: $FASTELASTIC_HANG_TIMEOUT
        self._hang = HangWatch(seconds) if seconds != 0 else None  # AUTO < 0
        self._hang_action: HangAction | None = None  # what the last verdict asks of this node
        self._checkpoint: Any = None  # fastelastic.checkpoint's memory: lives as long as this
        self._checkpoint_tried = False

    # ------------------------------------------------------------------ environment

    def _worker_env(
        self, wg: WorkerGroup, worker: Any, restart_count: int, use_agent_store: bool
    ) -> dict[str, str]:
        spec = wg.spec
        env = {
            "RANK": str(worker.global_rank),
            "GROUP_RANK": str(wg.group_rank),
            "ROLE_RANK": str(worker.role_rank),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.local_world_size),
            "WORLD_SIZE": str(worker.world_size),
            "GROUP_WORLD_SIZE": str(wg.group_world_size),
            "ROLE_WORLD_SIZE": str(worker.role_world_size),
            "MASTER_ADDR": str(wg.master_addr),
            "MASTER_PORT": str(wg.master_port),
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_RUN_ID": spec.rdzv_handler.get_run_id(),
            "TORCHELASTIC_USE_AGENT_STORE": str(use_agent_store),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.getenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        }
        self._set_local_rank_env(env, worker.local_rank, spec)
        if "OMP_NUM_THREADS" in os.environ:
            env["OMP_NUM_THREADS"] = os.environ["OMP_NUM_THREADS"]
        return env

    def _set_local_rank_env(self, env: dict[str, str], local_rank: int, spec: WorkerSpec) -> None:
        """LOCAL_RANK and CUDA_VISIBLE_DEVICES, in torch's normal or virtual-local-rank mode.

        Raises:
            ValueError: virtual mode and ``local_rank`` exceeds the visible devices.
        """
        parent = os.getenv("CUDA_VISIBLE_DEVICES")
        if not spec.virtual_local_rank:
            env["LOCAL_RANK"] = str(local_rank)
            if parent is not None:
                env["CUDA_VISIBLE_DEVICES"] = parent
            return
        env["LOCAL_RANK"] = "0"
        if parent is None:
            env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
            return
        gpus = parent.split(",")
        if local_rank >= len(gpus):
            raise ValueError(
                f"local_rank {local_rank} exceeds available GPUs in CUDA_VISIBLE_DEVICES={parent}"
            )
        env["CUDA_VISIBLE_DEVICES"] = gpus[local_rank].strip()

    def _log_prefix(self, spec: WorkerSpec, worker: Any) -> str:
        return Template(self._log_line_prefix_template or "").safe_substitute(
            role_name=spec.role,
            rank=worker.global_rank,
            local_rank=worker.local_rank,
            hostname=socket.gethostname(),
        )

    # ------------------------------------------------------------------ watchdog and health

    def _setup_local_watchdog(self, envs: dict[int, dict[str, str]]) -> None:
        path = os.getenv(TORCHELASTIC_TIMER_FILE)
        if os.getenv(TORCHELASTIC_ENABLE_FILE_TIMER) == "1" and self._worker_watchdog is None:
            from fastelastic.timer import FileTimerServer, default_timer_file

            if path is None:
                path = default_timer_file()
            run_id = envs[0]["TORCHELASTIC_RUN_ID"] if envs else ""
            self._worker_watchdog = FileTimerServer(
                file_path=path,
                run_id=run_id,
                max_interval=0.1,
                daemon=True,
                log_event=self._log_watchdog_event,
                allow_same_user=False,  # only this agent's workers (its descendants)
            )
            self._worker_watchdog.start()
            logger.info("FileTimerServer started on %s", path)
        if self._worker_watchdog is not None:
            path = (
                self._worker_watchdog.file_path
                if hasattr(self._worker_watchdog, "file_path")
                else path
            )
        if path is not None:
            for env in envs.values():
                env[TORCHELASTIC_TIMER_FILE] = path

    def _log_watchdog_event(self, name: str, request: Any) -> None:
        wg = self._worker_group
        spec = wg.spec
        md: dict[str, str] = {"watchdog_event": name}
        if request is not None:
            md.update(
                worker_pid=str(request.worker_pid),
                scope_id=str(request.scope_id),
                expiration_time=str(request.expiration_time),
                signal=str(request.signal),
            )
        if name == "kill worker process":
            put_metric(f"workers.{spec.role}.watchdog_kills", 1)
            logger.warning(
                "watchdog killed worker %s (scope %s)", md.get("worker_pid"), md.get("scope_id")
            )
        if isinstance(events.get_logging_handler(spec.event_log_handler), logging.NullHandler):
            return
        metadata: dict[str, events.EventMetadataValue] = {
            "run_id": spec.rdzv_handler.get_run_id(),
            "global_rank": None,
            "group_rank": wg.group_rank,
            "worker_id": None,
            "role": spec.role,
            "hostname": socket.gethostname(),
            "state": "RUNNING",
            "total_run_time": self._total_execution_time,
            "rdzv_backend": spec.rdzv_handler.get_backend(),
            "raw_error": None,
            "metadata": json.dumps(md),
            "agent_restarts": self.restart_count,
        }
        events.record(
            events.Event(name=name, source=events.EventSource.AGENT, metadata=metadata),
            spec.event_log_handler,
        )

    def _get_alive_time(self) -> int:
        """Last progress time for the health check: the watchdog's, else now."""
        if self._in_exit_barrier or self._worker_watchdog is None:
            return int(time.time())
        return int(self._worker_watchdog.get_last_progress_time())

    def _health_status(self) -> dict[str, Any]:
        wg = self._worker_group
        pc = self._pcontext
        exitcodes = pc.exitcodes() if pc is not None and hasattr(pc, "exitcodes") else {}
        live = pc.worker_states() if pc is not None and hasattr(pc, "worker_states") else {}
        workers = []
        progress = self._hang.progress() if self._hang is not None else {}
        for w in wg.workers:
            if w.id is None:
                wstate = "NOT_STARTED"
            elif w.local_rank in exitcodes:
                wstate = "EXITED"
            else:
                wstate = str(live.get(w.local_rank, "running")).upper()
            workers.append(
                {
                    "local_rank": w.local_rank,
                    "global_rank": w.global_rank,
                    "pid": w.id,
                    "state": wstate,
                    "exitcode": exitcodes.get(w.local_rank),
                    **progress.get(w.local_rank, {}),  # extra fields: the status stays
                }
            )
        return {
            "state": wg.state.value,
            "role": wg.spec.role,
            "group_rank": wg.group_rank,
            "restart_count": self.restart_count,
            "max_restarts": wg.spec.max_restarts,
            "in_exit_barrier": self._in_exit_barrier,
            "workers": workers,
        }

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        # Serve /health before the (possibly long) rendezvous, so probes see a live agent.
        self._setup_healthcheck()
        self._start_zygote(worker_group.spec)  # its imports overlap the rendezvous
        super()._rendezvous(worker_group)

    def _start_zygote(self, spec: WorkerSpec) -> None:
        """Starts the worker zygote once when ``spec.preload`` (or FASTELASTIC_PRELOAD) asks."""
        if self._zygote_tried:
            return
        self._zygote_tried = True
        from fastelastic.multiprocessing._zygote import (
            PRELOAD_ENV,
            Zygote,
            parse_preload,
            python_command,
        )

        raw = spec.preload if spec.preload is not None else os.environ.get(PRELOAD_ENV)
        modules = parse_preload(raw)
        if not modules:
            return
        cmd = python_command(spec.entrypoint, substitute_local_rank(tuple(spec.args), 0))
        if isinstance(cmd, str):
            logger.warning("--preload %s ignored: %s", ",".join(modules), cmd)
            return
        self._zygote = Zygote(modules, cmd)
        self._zygote.start()

    def _setup_healthcheck(self) -> None:
        if self._health_started:
            return
        if self._health_check_server is not None:
            self._health_check_server.start()
            self._health_started = True
            return
        raw = os.getenv(TORCHELASTIC_HEALTH_CHECK_PORT)
        if raw is None:
            return
        try:
            port = int(raw)
        except ValueError:
            logger.warning(
                "Invalid %s=%r, expecting an integer; no health check server",
                TORCHELASTIC_HEALTH_CHECK_PORT,
                raw,
            )
            return
        server = create_healthcheck_server(
            alive_callback=self._get_alive_time, port=port, timeout=60
        )
        server.set_status_callback(self._health_status)
        try:
            server.start()
        except OSError as e:
            # The workers matter more than the probe: run on, and say why probes will fail.
            logger.error("health check server not started on port %s: %s", port, e)
            return
        self._health_check_server = server
        self._health_started = True

    # ------------------------------------------------------------------ worker lifecycle

    @prof
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        from fastelastic.multiprocessing import start_processes

        spec = worker_group.spec
        if worker_group.store is None:
            raise RuntimeError("workers started before the rendezvous assigned a store")
        restart_count = self.restart_count
        use_agent_store = bool(spec.rdzv_handler.use_agent_store)
        args: dict[int, tuple] = {}
        envs: dict[int, dict[str, str]] = {}
        prefixes: dict[int, str] | None = {} if self._log_line_prefix_template else None
        for worker in worker_group.workers:
            lr = worker.local_rank
            envs[lr] = self._worker_env(worker_group, worker, restart_count, use_agent_store)
            args[lr] = substitute_local_rank(tuple(spec.args), lr)
            if prefixes is not None:
                prefixes[lr] = self._log_prefix(spec, worker)
        self._setup_local_watchdog(envs)
        self._setup_healthcheck()
        if spec.entrypoint is None:
            raise ValueError("WorkerSpec has no entrypoint")
        kwargs: dict[str, Any] = {}
        for name in ("numa_options", "duplicate_stdout_filters", "duplicate_stderr_filters"):
            if getattr(spec, name) is not None:
                kwargs[name] = getattr(spec, name)
        if self._zygote is not None:
            kwargs["zygote"] = self._zygote
        if self._hang is not None:
            self._hang.prepare(envs)  # the slot of each worker, in its environment
        self._checkpoint_round(spec.local_world_size, worker_group)
        self._pcontext = start_processes(
            name=spec.role,
            entrypoint=spec.entrypoint,
            args=args,
            envs=envs,
            logs_specs=self._logs_specs,
            log_line_prefixes=prefixes,
            start_method=self._start_method,
            **kwargs,
        )
        self._log_numa_binding(spec)
        pids = self._pcontext.pids()
        if self._hang is not None:
            self._hang.started(pids, {w.local_rank: w.global_rank for w in worker_group.workers})
        self._exits_pending = True
        self._uninterruptible_state_first_seen.clear()
        self._stuck.clear()
        if self._worker_watchdog is not None and hasattr(self._worker_watchdog, "set_allowed_pids"):
            self._worker_watchdog.set_allowed_pids(list(pids.values()))
        return pids

    def _checkpoint_round(self, local_world_size: int, wg: WorkerGroup | None = None) -> None:
        """Begins a round of the checkpoint memory: it outlives the workers (a restart restores
        from it) and ends with the agent; workers find it by this process's pid. With several
        nodes, the round's restore step is agreed with the other agents in the round's store
        (``checkpoint._across``)."""
        if not self._checkpoint_tried:
            self._checkpoint_tried = True
            from fastelastic.checkpoint._owner import from_env

            self._checkpoint = from_env()  # None with FASTELASTIC_CHECKPOINT=0
        several = wg is not None and (wg.group_world_size or 1) > 1 and wg.store is not None
        if several and self._checkpoint is None:
            from fastelastic.checkpoint._across import publish_nothing

            assert wg is not None
            publish_nothing(wg.store, wg.group_rank or 0)
        if self._checkpoint is None:
            return
        ranks = {w.local_rank: w.global_rank for w in wg.workers} if wg is not None else {}
        world = wg.workers[0].world_size if wg is not None and wg.workers else 0
        if not several:
            self._checkpoint.start_round(local_world_size, None, ranks, world)
            return
        from fastelastic.checkpoint._across import Agreement

        assert wg is not None
        self._checkpoint_copier(wg)
        limit = getattr(wg.store, "timeout", None)
        agree = Agreement(wg.store, wg.group_rank or 0, wg.group_world_size or 1,
                          limit.total_seconds() if limit is not None else 600.0,
                          getattr(wg.spec.rdzv_handler, "wait_members", None))
        self._checkpoint.start_round(local_world_size, agree, ranks, world)

    def _checkpoint_copier(self, wg: WorkerGroup) -> None:
        """The checkpoint memory's copy port (several nodes; ``--checkpoint-copy-to``)."""
        memory = self._checkpoint
        if memory is None or memory.copier is not None or memory.copy_to == -1:
            return
        from fastelastic.checkpoint import _room
        from fastelastic.checkpoint._copy import COPY_RATE_ENV, COPY_TO_ENV, Copier, parse_copy_to

        memory.copy_to = parse_copy_to(os.environ.get(COPY_TO_ENV, "next"))
        if memory.copy_to == 0:
            memory.copy_to = -1  # off: asked once
            return
        rate = os.environ.get(COPY_RATE_ENV, "").strip()
        handler = wg.spec.rdzv_handler
        host = getattr(handler, "_local_addr", "") or _route_to(
            str(getattr(handler, "_bootstrap_addr", "") or "")) or socket.getfqdn()
        try:
            memory.copier = Copier(memory, rate=float(_room.parse_bytes(rate)) if rate else 0.0,
                                   advertise=host)
        except (OSError, ValueError) as e:
            logger.error("checkpoint copy: no copy port (%s): a node's loss loses its shards", e)
            memory.copy_to = -1
            return
        logger.info("checkpoint copy: port %s; each local shard is copied to the agent %s "
                    "node(s) on in rank order", memory.copier.address, memory.copy_to)

    def _log_numa_binding(self, spec: WorkerSpec) -> None:
        """Logs the CPUs of each local rank (and keeps the line for ``fastelastic watch``)."""
        from fastelastic.numa import as_numa_options, describe

        opts = as_numa_options(spec.numa_options)
        if opts is None:
            return
        cpus = getattr(self._pcontext, "numa_cpus", {})
        self.numa_binding = describe(opts.affinity_mode.value, cpus, spec.local_world_size)
        logger.info("NUMA binding %s", self.numa_binding)

    def _wait_for_workers(self, worker_group: WorkerGroup, timeout: float | None) -> None:
        """Blocks until a worker exits or ``timeout`` elapses (pidfds, no polling)."""
        pc = self._pcontext
        if pc is None:
            super()._wait_for_workers(worker_group, timeout)
            return
        # Even with nothing to poll, wake every few seconds: a signal the kernel delivered to
        # another thread only reaches its Python handler once the main thread runs again.
        if pc.wait_any(_IDLE_WAKEUP if timeout is None else timeout):
            self._exits_pending = True

    def _membership_check_interval(self, spec: WorkerSpec) -> float | None:
        if self._uninterruptible_state_timeout > 0 or self._hang is not None:
            return spec.monitor_interval  # the D-state and hang checks need a periodic look
        return super()._membership_check_interval(spec)

    @prof
    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        self._enter_step(AgentState.STOPPING)
        if self._pcontext is not None:
            self._pcontext.close(signal.SIGTERM, self._shutdown_timeout)

    def _shutdown(self, death_sig: signal.Signals = signal.SIGTERM, timeout: int = 30) -> None:
        # Workers first (a second signal only hurries their SIGKILL; it is re-raised after
        # everything below ran), then the watchdog, then /health, which answers until the end.
        try:
            if self._pcontext is not None:
                self._pcontext.close(death_sig, timeout)
        finally:
            try:
                if self._worker_watchdog is not None:
                    watchdog, self._worker_watchdog = self._worker_watchdog, None
                    watchdog.stop()
            finally:
                if self._health_check_server is not None:
                    server, self._health_check_server = self._health_check_server, None
                    self._health_started = False
                    server.stop()
                if self._zygote is not None:
                    self._zygote.close()
                if self._hang is not None:
                    self._hang.close()
                if self._checkpoint is not None:
                    memory, self._checkpoint = self._checkpoint, None
                    memory.close()

    # ------------------------------------------------------------------ monitoring

    def _check_uninterruptible_state_timeout(
        self, worker_group: WorkerGroup, timeout: float
    ) -> RunResult | None:
        """UNHEALTHY (and no more restarts) once a worker sat in D-state for ``timeout`` s."""
        assert self._pcontext is not None
        states = self._pcontext.worker_states()  # {local_rank: psutil status} of live workers
        pids = self._pcontext.pids()
        now = time.monotonic()
        stuck = []
        seen = self._uninterruptible_state_first_seen
        for lr, status in states.items():
            pid = pids[lr]
            if status != "disk-sleep":
                seen.pop(pid, None)
                continue
            first = seen.setdefault(pid, now)
            if now - first >= timeout:
                stuck.append((lr, pid, now - first))
        for pid in [p for p in seen if p not in pids.values()]:
            del seen[pid]
        if not stuck:
            return None
        for lr, pid, elapsed in stuck:
            logger.error(
                "[%s] worker pid=%s stuck in uninterruptible sleep (D-state) for %.1fs"
                " (>= %.1fs); marking the group UNHEALTHY, no more restarts",
                worker_group.spec.role,
                pid,
                elapsed,
                timeout,
            )
            self._stuck[lr] = (
                f"stuck in uninterruptible sleep (D-state) for {elapsed:.1f} s{_wchan(pid)} "
                f"(>= {TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT}={timeout:g}); no restart: "
                "a wedged worker holds what a new one would need")
        self._remaining_restarts = 0  # a wedged worker holds a device a new one would need
        return RunResult(state=WorkerState.UNHEALTHY)

    def _stopped_failures(self, wg: WorkerGroup, state: WorkerState) -> dict[int, Any]:
        """The workers that made the run fail without exiting: those stuck in D-state, else
        the ranks the hang verdict blamed, each with why and where its stacks are."""
        from fastelastic.multiprocessing.errors import EXITCODE_UNKNOWN, ProcessFailure

        blamed: dict[int, tuple[str, str | None]] = {
            lr: (why, None) for lr, why in self._stuck.items()}
        if not blamed and self._hang is not None:
            blamed = dict(self._hang.blamed)
        if not blamed:
            return super()._stopped_failures(wg, state)
        pc = self._pcontext
        codes = pc.exitcodes() if pc is not None else {}
        pids = pc.pids() if pc is not None else {}
        out: dict[int, Any] = {}
        for lr, (why, stacks) in sorted(blamed.items()):
            code = codes.get(lr)
            out[wg.workers[lr].global_rank] = ProcessFailure(
                lr, int(pids.get(lr, wg.workers[lr].id or -1)),
                EXITCODE_UNKNOWN if code is None else code, "",
                unknown_exit="it outlived the agent's stop", stopped_for=why,
                stacks_file=stacks)
        return out

    @prof
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        self._enter_step(AgentState.RUNNING)
        result = self._check_workers(worker_group)
        if self._hang is None or result.state == WorkerState.SUCCEEDED:
            return result  # this node finished: it says so to the check (_mark_done)
        spec = worker_group.spec
        log_dir = getattr(self._logs_specs, "_run_log_dir", None)
        if self._store_gone or getattr(spec.rdzv_handler, "store_host_finished", False):
            # the store's host finished (its store goes with it): no peer can report, and
            # this node's stall is the job's
            if result.state != WorkerState.HEALTHY:
                return result
            action = self._hang.check_alone(log_dir, restarts_left=0)
            if action is not None:
                self._remaining_restarts = 0  # nothing is left to re-form with
        elif result.state != WorkerState.HEALTHY and not self._hang.pending:
            return result
        else:
            # a node that reported a stall finishes the verdict even once its workers failed:
            # a peer that restarted first breaks their collectives
            action = self._hang.check(
                worker_group.store, worker_group.group_rank or 0,
                worker_group.group_world_size or 1, log_dir,
                reused_store=spec.rdzv_handler.get_backend() == "static",
                restarts_left=self._remaining_restarts,
            )
        if action is None:
            return result
        put_metric(f"workers.{spec.role}.hang_verdicts", 1)
        self._record("HANG", events.EventSource.AGENT, raw_error=self._hang.last_verdict)
        if action is HangAction.END:
            return self._end_hung_run(worker_group)
        self._hang_action = action
        return RunResult(state=WorkerState.UNHEALTHY)

    def _end_hung_run(self, worker_group: WorkerGroup) -> RunResult:
        """A verdict at the end of the run: stops the workers still running and returns the
        workers' result, with no restart. A rank stopped after its program ended (hung in its
        atexit handlers, threads or teardown) finished its work: it counts as succeeded; one
        stopped before its end is a failure, as are the ranks that exited non-zero."""
        assert self._pcontext is not None and self._hang is not None
        pc = self._pcontext
        ended = self._hang.ended_ranks()
        before = pc.exitcodes()
        pc.close(signal.SIGTERM, self._shutdown_timeout)
        stopped_ended = {lr for lr in pc.pids() if lr not in before and lr in ended}
        result = pc.wait(0)
        failures = {lr: f for lr, f in (result.failures if result else {}).items()
                    if lr not in stopped_ended}
        for lr, f in failures.items():
            if lr not in before and lr in self._hang.blamed:  # stopped for the verdict
                why, stacks = self._hang.blamed[lr]
                failures[lr] = dataclasses.replace(f, stopped_for=why, stacks_file=stacks)
        for lr in sorted(stopped_ended):
            logger.warning("[%s] local_rank %s was stopped at the end of the run, after its "
                           "program ended: counted as succeeded", worker_group.spec.role, lr)
        if failures:
            self._remaining_restarts = 0  # the run is over: its end hung, nothing to re-run
            return RunResult(state=WorkerState.FAILED, failures={
                worker_group.workers[lr].global_rank: f for lr, f in failures.items()})
        return RunResult(state=WorkerState.SUCCEEDED, return_values={
            w.global_rank: None for w in worker_group.workers})

    def _mark_done(self, spec: WorkerSpec) -> None:
        super()._mark_done(spec)
        if self._hang is not None and self._worker_group.store is not None:
            self._hang.finished(self._worker_group.store, self._worker_group.group_rank or 0,
                                reused_store=spec.rdzv_handler.get_backend() == "static")

    def _decide(self, wg: WorkerGroup, state: WorkerState, check_due: bool) -> AgentAction:
        action, self._hang_action = self._hang_action, None
        if action is HangAction.RESTART:  # the verdict named a rank of another node
            return AgentAction.RESTART
        if action is HangAction.RETRY:  # this node's rank hung: a restart, as for a crash (a
            # peer that already restarted for the same verdict is no lost member)
            return AgentAction.RETRY if self._remaining_restarts > 0 else AgentAction.FAIL
        return super()._decide(wg, state, check_due)

    def _check_workers(self, worker_group: WorkerGroup) -> RunResult:
        if self._pcontext is None:
            raise RuntimeError("no workers to monitor: the group was not started")
        timeout = self._uninterruptible_state_timeout
        if not self._exits_pending:
            # Nothing exited since the last full check (pidfds would have said so).
            if timeout > 0:
                stuck = self._check_uninterruptible_state_timeout(worker_group, timeout)
                if stuck is not None:
                    return stuck
            return RunResult(state=WorkerState.HEALTHY)
        self._exits_pending = False
        role = worker_group.spec.role
        worker_pids = {w.id for w in worker_group.workers}
        pc_pids = set(self._pcontext.pids().values())
        if worker_pids != pc_pids:
            logger.error(
                "[%s] worker pids do not match process_context pids. Expected: %s, actual: %s",
                role,
                worker_pids,
                pc_pids,
            )
            return RunResult(state=WorkerState.UNKNOWN)
        result = self._pcontext.wait(0)
        if result:
            if result.is_failed():
                failures = {
                    worker_group.workers[lr].global_rank: f for lr, f in result.failures.items()
                }
                return RunResult(state=WorkerState.FAILED, failures=failures)
            values = {
                worker_group.workers[lr].global_rank: v for lr, v in result.return_values.items()
            }
            return RunResult(state=WorkerState.SUCCEEDED, return_values=values)
        if timeout > 0:
            stuck = self._check_uninterruptible_state_timeout(worker_group, timeout)
            if stuck is not None:
                return stuck
        return RunResult(state=WorkerState.HEALTHY)
