"""``fastelastic watch``: binds the events endpoint and shows every agent, live or as a snapshot."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["AgentRow", "JobView", "watch"]

_COLUMNS = ("NODE", "PID", "RUN", "GROUP", "STATE", "WORLD", "RESTARTS", "ALIVE", "LAST EVENT")
_FINAL = ("SUCCEEDED", "FAILED")


@dataclass
class AgentRow:
    """What the watcher knows about one agent."""

    agent: str
    fields: dict[str, Any] = field(default_factory=dict)
    seen: float = 0.0  # time.monotonic() of the last message
    events: int = 0

    def cells(self, now: float, stale_after: float) -> tuple[str, ...]:
        f = self.fields

        def show(v: Any) -> str:
            return "-" if v is None else str(v)

        state = show(f.get("state"))
        if state not in _FINAL and now - self.seen > stale_after:
            state += " (silent %.0fs)" % (now - self.seen)
        restarts = f"{show(f.get('restarts'))}/{show(f.get('max_restarts'))}"
        alive = f"{f.get('workers_alive', 0)}/{show(f.get('local_world_size'))}"
        run = show(f.get("run_id"))
        if len(run) > 12:
            run = run[:11] + "…"
        return (
            show(f.get("host")),
            show(f.get("pid")),
            run,
            show(f.get("group_rank")),
            state,
            show(f.get("world_size")),
            restarts,
            alive,
            show(f.get("last_event"))[:60],
        )


class JobView:
    """Folds published messages into one row per agent and renders them as a table.

    Args:
        stale_after: seconds without a message after which a running agent is marked silent.
    """

    def __init__(self, stale_after: float = 3.0) -> None:
        self.rows: dict[str, AgentRow] = {}
        self.stale_after = stale_after
        self.bad_messages = 0

    def update(self, raw: bytes, now: float | None = None) -> AgentRow | None:
        """Applies one message; a malformed one is counted and ignored."""
        try:
            msg = json.loads(raw)
            agent = str(msg["agent"])
        except (ValueError, KeyError, TypeError):
            self.bad_messages += 1
            return None
        row = self.rows.get(agent)
        if row is None:
            row = self.rows[agent] = AgentRow(agent)
        if msg.get("seq", 0) >= row.fields.get("seq", 0):
            row.fields.update({k: v for k, v in msg.items() if k != "event"})
        if msg.get("kind") == "event":
            row.events += 1
        row.seen = time.monotonic() if now is None else now
        return row

    def formed(self) -> int:
        """How many agents run workers after a rendezvous, or reached a final state."""
        return sum(
            1 for r in self.rows.values()
            if (r.fields.get("world_size") is not None and r.fields.get("state") != "INIT")
            or r.fields.get("state") in _FINAL
        )

    def all_done(self) -> bool:
        """True when at least one agent is known and every agent reached a final state."""
        return bool(self.rows) and all(
            r.fields.get("state") in _FINAL for r in self.rows.values()
        )

    def render(self, now: float | None = None) -> str:
        """The table (header plus one line per agent, ordered by run, group rank, host)."""
        now = time.monotonic() if now is None else now

        def key(r: AgentRow) -> tuple[str, int, str]:
            g = r.fields.get("group_rank")
            return (str(r.fields.get("run_id")), g if isinstance(g, int) else 1 << 30, r.agent)

        body = [r.cells(now, self.stale_after) for r in sorted(self.rows.values(), key=key)]
        widths = [max(len(c[i]) for c in [_COLUMNS, *body]) for i in range(len(_COLUMNS))]
        out = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [_COLUMNS, *body]
        ]
        bad = f", {self.bad_messages} bad message(s)" if self.bad_messages else ""
        out.append(f"{len(body)} agent(s){bad}")
        return "\n".join(out)


def _bind(sock: Any, endpoint: str) -> None:
    import zmq

    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        if e.errno == zmq.EADDRINUSE:
            raise OSError(
                e.errno,
                f"cannot bind {endpoint}: address already in use (is another "
                "`fastelastic watch` running on it? pick another port for --events-endpoint)",
            ) from None
        raise OSError(e.errno, f"cannot bind {endpoint}: {e.strerror}") from None


def watch(
    endpoint: str,
    once: bool = False,
    expect: int = 0,
    timeout: float | None = None,
    refresh: float = 0.25,
    out: TextIO | None = None,
    until_done: bool = False,
) -> int:
    """Binds ``endpoint`` (SUB) and shows the agents publishing to it.

    Args:
        endpoint: ``tcp://HOST:PORT`` (``HOST`` an interface address or ``*``) or ``ipc://PATH``.
        once: print one snapshot and return: as soon as ``expect`` agents have joined the
            job (finished a rendezvous, so their world size is known) if ``expect`` > 0,
            else after ``timeout`` seconds.
        expect: number of agents to wait for in ``once`` mode.
        timeout: the longest ``once`` waits (default 2 s; 60 s when ``expect`` is set); in live
            mode, stop after that many seconds (default: never).
        refresh: the live view redraws at most this often (seconds).
        out: where to write (default stdout). Redraws in place when it is a terminal.
        until_done: live mode ends once every known agent reached SUCCEEDED or FAILED.

    Returns:
        Exit status: 0, or 1 when ``once`` saw fewer agents than expected (or none).
    """
    import zmq

    out = out or sys.stdout
    view = JobView()
    ctx = zmq.Context(io_threads=1)
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    tty = out.isatty()
    last_text = ""
    try:
        _bind(sock, endpoint)
        print(f"watching {endpoint}", file=sys.stderr, flush=True)
        if timeout is None and once:
            timeout = 60.0 if expect else 2.0
        deadline = None if timeout is None else time.monotonic() + timeout
        next_draw = 0.0
        dirty = False
        while True:
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                break
            if once and expect and view.formed() >= expect:
                break
            if until_done and view.all_done():
                break
            wait = refresh if deadline is None else min(refresh, deadline - now)
            if sock.poll(max(1, int(wait * 1000))):
                while True:
                    try:
                        view.update(sock.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                    dirty = True
            if not once and (dirty or tty) and time.monotonic() >= next_draw:
                text = view.render()
                if tty or text != last_text:  # a log (not a terminal) gets changes only
                    _draw(out, text, tty)
                    last_text = text
                dirty = False
                next_draw = time.monotonic() + refresh
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
        ctx.term()
    if once:
        print(view.render(), file=out, flush=True)
        return 0 if view.rows and view.formed() >= expect else 1
    if tty or view.render() != last_text:
        _draw(out, view.render(), tty)
    return 0


def _draw(out: TextIO, text: str, tty: bool) -> None:
    if tty:
        out.write("\x1b[H\x1b[2J" + text + "\n")  # home + clear: redraw in place
    else:
        out.write(text + "\n\n")
    out.flush()
