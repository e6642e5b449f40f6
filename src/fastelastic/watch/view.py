"""``fastelastic watch``: binds the events endpoint and shows every agent, live or as a snapshot."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["AgentRow", "JobView", "watch"]

_COLUMNS = ("NODE", "PID", "RUN", "GROUP", "STATE", "WORLD", "RESTARTS", "ALIVE", "STEPS",
            "NUMA", "LAST EVENT")
_FINAL = ("SUCCEEDED", "FAILED")

# The message schema (publisher.py): field -> accepted types. A field of another type is dropped
# (the message counts as bad); unknown fields are ignored, so nothing unbounded is kept.
_NUM = (int, float)
_SCHEMA: dict[str, tuple[type, ...]] = {
    "v": (int,), "kind": (str,), "host": (str,), "pid": (int,), "run_id": (str,),
    "role": (str,), "group_rank": (int, type(None)), "state": (str,),
    "world_size": (int, type(None)), "group_world_size": (int, type(None)),
    "local_world_size": (int,), "restarts": (int,), "max_restarts": (int,),
    "workers_alive": (int,), "last_event": (str,), "seq": (int,), "time": _NUM, "numa": (str,),
    "steps": (int,), "idle_s": _NUM,  # --hang-timeout: fewest steps, newest progress age
}
MAX_MESSAGE = 64 * 1024       # bytes; longer messages are dropped by the socket
MAX_AGENTS = 200_000          # rows kept; messages from further agents count as bad
_MAX_TEXT = 256               # characters kept of any string field

# Terminal control characters (C0, DEL, C1) and bidi/format overrides, shown as U+FFFD: a
# message from the network must not move the cursor, clear the screen or reorder the text.
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0), 0x200E, 0x200F,
                                   *range(0x202A, 0x202F), *range(0x2066, 0x206A), 0xFEFF]}


def printable(text: str) -> str:
    """text with every terminal control character replaced (see _CONTROLS)."""
    return text.translate(_CONTROLS)


def _conforming(msg: Any) -> tuple[dict[str, Any], bool] | None:
    """The schema's fields of a decoded message (and whether all were well-typed), or None if
    it is not an agent's message at all."""
    if not isinstance(msg, dict):
        return None
    agent = msg.get("agent")
    if not isinstance(agent, (str, int)) or isinstance(agent, bool):
        return None
    fields: dict[str, Any] = {"agent": str(agent)[:_MAX_TEXT]}
    ok = True
    for k, types in _SCHEMA.items():
        if k not in msg:
            continue
        v = msg[k]
        if (not isinstance(v, types) or (isinstance(v, bool) and bool not in types)
                or (isinstance(v, int) and not -(1 << 63) <= v < 1 << 63)):
            ok = False
            continue
        fields[k] = v[:_MAX_TEXT] if isinstance(v, str) else v
    return fields, ok


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
            return "-" if v is None else printable(str(v))

        state = show(f.get("state"))
        if state not in _FINAL and now - self.seen > stale_after:
            state += " (silent %.0fs)" % (now - self.seen)
        restarts = f"{show(f.get('restarts'))}/{show(f.get('max_restarts'))}"
        alive = f"{f.get('workers_alive', 0)}/{show(f.get('local_world_size'))}"
        steps = "-"
        if isinstance(f.get("steps"), int):
            idle = f.get("idle_s")
            steps = str(f["steps"]) + ("" if idle is None else " (%.1fs ago)" % idle)
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
            steps,
            show(f.get("numa")),
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
        """Applies one message. Any message is safe: one that is not JSON or not an agent's is
        counted as bad and ignored; a field of the wrong type is dropped (and counted)."""
        try:
            checked = None if len(raw) > MAX_MESSAGE else _conforming(json.loads(raw))
        except (ValueError, RecursionError, TypeError):   # not JSON, too deep, not bytes
            checked = None
        if checked is None:
            self.bad_messages += 1
            return None
        msg, ok = checked
        if not ok:
            self.bad_messages += 1
        agent = msg["agent"]
        row = self.rows.get(agent)
        if row is None:
            if len(self.rows) >= MAX_AGENTS:
                self.bad_messages += 1
                return None
            row = self.rows[agent] = AgentRow(agent)
        if msg.get("seq", 0) >= row.fields.get("seq", 0):
            row.fields.update(msg)
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

        rows = sorted(self.rows.values(), key=key)
        body = [r.cells(now, self.stale_after) for r in rows]
        head: tuple[str, ...] = _COLUMNS
        if not any("numa" in r.fields for r in rows):  # the column only with --numa-binding
            drop = _COLUMNS.index("NUMA")
            head, body = _without(head, drop), [_without(c, drop) for c in body]
        widths = [max(len(c[i]) for c in [head, *body]) for i in range(len(head))]
        out = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in [head, *body]
        ]
        bad = f", {self.bad_messages} bad message(s)" if self.bad_messages else ""
        out.append(f"{len(body)} agent(s){bad}")
        return "\n".join(out)


def _without(cells: tuple[str, ...], i: int) -> tuple[str, ...]:
    return cells[:i] + cells[i + 1 :]


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
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)   # a larger one drops its sender, not us
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
