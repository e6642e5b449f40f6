"""The agent side of ``--events-endpoint``: events and status snapshots as JSON over ZeroMQ PUB.

Topology: the watcher (``fastelastic watch tcp://HOST:PORT``) BINDS a SUB socket; every agent
CONNECTS a PUB socket to that address. So one endpoint serves every agent of a job (and of
several jobs), agents may start before or after the watcher (ZeroMQ reconnects in the
background), and a job with nobody watching costs nothing but a reconnect timer.

Because PUB drops what it sends before a subscriber's subscription arrives, a late watcher
would miss earlier events. Each agent therefore also publishes a full status snapshot (state,
world size, restarts, workers alive, last event) every ``interval`` seconds and at once after
every event, so a watcher's view is complete within one interval of it starting.

Wire format, one JSON object per single-frame message (``v`` is the format version)::

    {"v": 1, "kind": "status" | "event", "agent": "HOST:PID", "host": ..., "pid": ...,
     "run_id": ..., "role": ..., "group_rank": int|null, "state": "INIT"|"HEALTHY"|...,
     "world_size": int|null, "group_world_size": int|null, "local_world_size": int,
     "restarts": int, "max_restarts": int, "workers_alive": int, "last_event": str,
     "seq": int, "time": float (epoch seconds, for display), "event": {...} (kind=event only),
     "numa": "MODE: RANK->CPUS ..." (with --numa-binding only: each local rank's CPUs)}
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = ["EventPublisher", "PublishingHandler", "agent_status"]

logger = logging.getLogger(__name__)

_STOP = object()
_STICKY_S = 3.0


def _pid_alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie, i.e. exited but not reaped, counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    state = stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3]
    return state not in (b"Z", b"X", b"")


def agent_status(agent: Any, spec: Any = None) -> dict[str, Any]:
    """Reads an agent's state (torch-shaped ``SimpleElasticAgent`` attributes) into a dict.

    Args:
        agent: the agent, or None before it exists (then only ``spec`` is described).
        spec: the ``WorkerSpec`` (default: the agent's).
    """
    wg = getattr(agent, "_worker_group", None)
    spec = spec if spec is not None else getattr(wg, "spec", None)
    st: dict[str, Any] = {"state": "INIT"}
    if spec is not None:
        st["role"] = spec.role
        st["local_world_size"] = spec.local_world_size
        st["max_restarts"] = spec.max_restarts
        remaining = getattr(agent, "_remaining_restarts", spec.max_restarts)
        st["restarts"] = spec.max_restarts - remaining
        handler = getattr(spec, "rdzv_handler", None)
        if handler is not None:
            try:
                st["run_id"] = handler.get_run_id()
            except Exception:  # noqa: BLE001 - a status read must never break the agent
                pass
    if wg is not None:
        state = getattr(wg, "state", None)
        st["state"] = getattr(state, "value", state) or "INIT"
        st["group_rank"] = getattr(wg, "group_rank", None)
        st["group_world_size"] = getattr(wg, "group_world_size", None)
        workers = getattr(wg, "workers", None) or []
        sizes = [w.world_size for w in workers if getattr(w, "world_size", None) not in (None, -1)]
        st["world_size"] = sizes[0] if sizes else None
    alive = 0
    pctx = getattr(agent, "_pcontext", None)
    if pctx is not None and st.get("state") not in ("SUCCEEDED", "FAILED", "STOPPED"):
        try:
            alive = sum(1 for pid in pctx.pids().values() if _pid_alive(int(pid)))
        except Exception:  # noqa: BLE001
            alive = 0
    st["workers_alive"] = alive
    numa = getattr(agent, "numa_binding", None)
    if isinstance(numa, str):
        st["numa"] = numa
    st.update(_progress(agent))
    return st


def _progress(agent: Any) -> dict[str, Any]:
    """With ``--hang-timeout``: the node's fewest optimizer steps over its ranks, and the
    seconds since its newest progress (absent before the first)."""
    hang = getattr(agent, "_hang", None)
    if hang is None:
        return {}
    try:
        ranks = hang.progress()
    except Exception:  # noqa: BLE001 - a status read must never break the agent
        return {}
    if not ranks:
        return {}
    out: dict[str, Any] = {"steps": min(int(p["steps"]) for p in ranks.values())}
    idle = [p["since_progress_s"] for p in ranks.values() if p["since_progress_s"] is not None]
    if idle:
        out["idle_s"] = float(min(idle))
    return out


class EventPublisher:
    """Publishes events and periodic status snapshots of one agent to a ZeroMQ endpoint.

    All socket work happens on one background thread (ZeroMQ sockets are not thread safe);
    other threads only enqueue. ``close()`` flushes what is queued (bounded by ``linger``).

    Args:
        endpoint: ``tcp://HOST:PORT`` (or ``ipc://PATH``) where the watcher is bound.
        status: returns the agent's current status fields (see :func:`agent_status`).
        interval: seconds between status snapshots.
        linger: seconds ``close()`` may spend delivering queued messages.
    """

    _instances = itertools.count()

    def __init__(
        self,
        endpoint: str,
        status: Callable[[], dict[str, Any]] | None = None,
        interval: float = 0.5,
        linger: float = 1.0,
    ) -> None:
        import zmq

        self.endpoint = endpoint
        self._status = status or dict
        self._interval = interval
        self._linger = linger
        self._host = socket.gethostname()
        self._pid = os.getpid()
        n = next(EventPublisher._instances)
        # Two agents in one process (API users) must not share a row in the watcher.
        self._agent = f"{self._host}:{self._pid}" + (f"#{n}" if n else "")
        self._seq = 0
        self._last_event = "launcher started"
        self._final: dict[str, Any] = {}
        self._prev: dict[str, Any] = {}
        self._last_failure: str | None = None
        self._sticky_until = 0.0
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ctx = zmq.Context(io_threads=1)
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, 10000)
        self._sock.setsockopt(zmq.LINGER, int(linger * 1000))
        self._sock.connect(endpoint)
        self._thread = threading.Thread(target=self._loop, name="fastelastic-events", daemon=True)
        self._closed = False
        self._thread.start()

    def publish_event(self, payload: str | dict[str, Any]) -> None:
        """Queues one event (its JSON text or a dict) for publishing."""
        if self._closed:
            return
        self._q.put(payload)

    def set_final(self, **fields: Any) -> None:
        """Overrides status fields from now on (e.g. ``state="SUCCEEDED"`` once the run ended)."""
        self._final.update(fields)

    def close(self) -> None:
        """Sends a last status snapshot, delivers what is queued and closes the socket."""
        if self._closed:
            return
        self._closed = True
        self._q.put(_STOP)
        self._thread.join(self._linger + 2.0)
        if not self._thread.is_alive():  # else the socket is still open; term() would block
            self._ctx.term()

    def _message(self, kind: str, event: dict[str, Any] | None = None) -> bytes:
        self._seq += 1
        try:
            st = self._status()
        except Exception:  # noqa: BLE001 - status is best effort, events still go out
            st = {}
        st.update(self._final)
        change = _status_change(self._prev, st)
        if change:
            if change.startswith("restart") and self._last_failure:
                change += f" after {self._last_failure}"
                self._last_failure = None
            self._set_last(change, important=True)
        self._prev = st
        msg: dict[str, Any] = {
            "v": 1,
            "kind": kind,
            "agent": self._agent,
            "host": self._host,
            "pid": self._pid,
            "last_event": self._last_event,
            "seq": self._seq,
            "time": time.time(),
            **st,
        }
        if event is not None:
            msg["event"] = event
        return json.dumps(msg, default=str).encode()

    def _set_last(self, text: str, important: bool) -> None:
        """Routine lines (worker START, rendezvous progress) do not hide a recent failure,
        restart or membership change for ``_STICKY_S`` seconds."""
        now = time.monotonic()
        if important:
            self._last_event = text
            self._sticky_until = now + _STICKY_S
        elif now >= self._sticky_until:
            self._last_event = text

    def _on_event(self, payload: str | dict[str, Any]) -> bytes:
        if isinstance(payload, str):
            try:
                event = json.loads(payload)
            except ValueError:
                event = {"name": payload}
        else:
            event = payload
        if not isinstance(event, dict):
            event = {"name": str(event)}
        md = event.get("metadata")
        # Phase timings (RENDEZVOUS, ASSIGN_WORKER_RANKS...) are published but would hide a
        # restart or a failure in the one-line "last event".
        if not (isinstance(md, dict) and md.get("duration_ms") is not None):
            name = str(event.get("name", ""))
            failed = name == "fastelastic.worker.failed"
            self._set_last(_describe(event), important=failed or not name.endswith(".START")
                           and "next_rendezvous" not in name)
            if failed:
                self._last_failure = self._last_event
        return self._message("event", event)

    def _loop(self) -> None:
        import zmq

        next_status = time.monotonic()
        try:
            while True:
                now = time.monotonic()
                if now >= next_status:
                    self._sock.send(self._message("status"), zmq.NOBLOCK)
                    next_status = now + self._interval
                try:
                    item = self._q.get(timeout=max(0.0, next_status - time.monotonic()))
                except queue.Empty:
                    continue
                if item is _STOP:
                    self._sock.send(self._message("status"), zmq.NOBLOCK)
                    break
                self._sock.send(self._on_event(item), zmq.NOBLOCK)
                next_status = time.monotonic()  # a fresh snapshot right after every event
        except zmq.ZMQError as e:
            logger.warning("events publisher to %s stopped: %s", self.endpoint, e)
        finally:
            self._sock.close()


def _status_change(prev: dict[str, Any], cur: dict[str, Any]) -> str | None:
    """A 'last event' line for what changed between two snapshots (restart, membership, state).

    The agent records no event for a worker-group failure or a restart, so the publisher
    derives them from its snapshots of the agent.
    """
    if not prev:
        return None
    if (cur.get("restarts") or 0) > (prev.get("restarts") or 0):
        return f"restart {cur['restarts']}/{cur.get('max_restarts')}"
    pw, cw = prev.get("world_size"), cur.get("world_size")
    if pw is not None and cw is not None and pw != cw:
        return f"membership change: world size {pw} -> {cw}"
    ps, cs = prev.get("state"), cur.get("state")
    pa, ca = prev.get("workers_alive") or 0, cur.get("workers_alive") or 0
    if ps == cs == "HEALTHY" and ca < pa:
        return f"worker exited: {ca}/{cur.get('local_world_size')} alive"
    if ps != cs and cs in ("UNHEALTHY", "FAILED", "SUCCEEDED", "STOPPED"):
        return f"group {cs.lower()}"
    return None


def _describe(event: dict[str, Any]) -> str:
    """A short human line for an event (torch ``Event`` or ``RdzvEvent`` JSON)."""
    name = str(event.get("name", "?"))
    md = event.get("metadata")
    if name == "fastelastic.worker.failed" and isinstance(md, dict):
        how = f"killed by {md['signal']}" if md.get("signal") else f"exit {md.get('exit_code')}"
        return f"rank {md.get('global_rank')} failed: {how}"
    if isinstance(md, dict):
        parts = [name.removeprefix("torchelastic.worker.status.")]
        if md.get("global_rank") is not None:
            parts.append(f"rank {md['global_rank']}")
        inner = md.get("metadata")
        if isinstance(inner, str):
            try:
                inner = json.loads(inner)
            except ValueError:
                inner = None
        if isinstance(inner, dict):
            code = inner.get("exit_code")
            if isinstance(code, (list, tuple)):
                code = code[0] if code else None
            if code is not None:
                parts.append(f"exit {code}")
        return " ".join(parts)
    if "node_state" in event:
        msg = str(event.get("message", ""))
        return f"{name.split(':')[-1]}: {msg}"[:120]
    return name[:120]


class PublishingHandler(logging.Handler):
    """A logging handler (an events destination) that publishes and forwards to another one.

    Args:
        publisher: where events go.
        inner: the destination's previous handler, which keeps receiving every record.
    """

    def __init__(self, publisher: EventPublisher, inner: logging.Handler | None = None) -> None:
        super().__init__(level=logging.NOTSET)
        self._publisher = publisher
        self._inner = inner

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self._publisher.publish_event(record.getMessage())
        except Exception:  # noqa: BLE001 - logging handlers must not raise
            self.handleError(record)
        inner = self._inner
        if inner is not None and not isinstance(inner, logging.NullHandler):
            inner.handle(record)
