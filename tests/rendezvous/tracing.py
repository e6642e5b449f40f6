"""Records every simulated request of the rendezvous, to show that a change of the code's layout
changes no behaviour: the traces of the scenarios are identical before and after.

What runs: every scenario of ``test_round`` (one store, ``simstore``), every pinned schedule of
``test_prop_failover`` (its tests, run as they are) and the property schedules of ``SEEDS``
(several candidate stores, ``multisim``). What is recorded, per request a node's driver answers
(``Sim._apply``): the simulated time, the node, its round (the last it was seated in: round,
rank, world), the phase it was in, the request with its store, and the answer; per step of a
node's generator: the reply sent in and the error it raised, if any. Each scenario's trace is
hashed (sha256). The nonces of world ids and proof names are drawn from a counter while it
records (``_Drawn``), so a trace is the same from one run to the next. ``traces.sha256``
holds the digests of the tree they were taken on.

Run ``python3 tests/rendezvous/tracing.py`` to print the digests, ``--write`` to rewrite
``traces.sha256`` (only on a tree whose behaviour is the reference), ``--diff NAME`` to print
one scenario's trace.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script: the helpers import each other by name
    sys.path.insert(0, str(HERE))

import multisim  # noqa: E402
import simstore  # noqa: E402

DIGESTS = HERE / "traces.sha256"
SEEDS = range(1000, 1200)  # property schedules (racks and lost proof fences among them)


class _Drawn:
    """A module's ``time`` or ``os`` whose draws (``time_ns``, ``urandom``) count from 1: a
    world's id and a proof's name take a wall-clock or random nonce, the same from one run
    to the next only so."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._n = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def time_ns(self) -> int:
        self._n += 1
        return self._n

    def urandom(self, size: int) -> bytes:
        self._n += 1
        return (self._n % 256**size).to_bytes(size, "big")


class Recorder:
    """Patches the simulations' request and step methods while installed (``record``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._depth = 0  # MultiSim._apply calls Sim._apply: record the outermost call only

    def _where(self, sim: simstore.Sim, node: simstore.Node) -> str:
        seat = node.seats[-1][1] if node.seats else None
        held = f"r{seat.round}/k{seat.rank}/w{seat.world}" if seat is not None else "-"
        phase = node.m.path[-1].name if node.m.path else "-"
        return f"{sim.clock.t!r} n{node.id} {held} {phase}"

    def _add(self, line: str) -> None:
        if " at 0x" in line:  # an address: not the same from one run to the next
            raise AssertionError(f"a trace line that is not reproducible: {line}")
        self.lines.append(line)

    def wrap_apply(self, orig: Callable[..., tuple[str, Any]]) -> Callable[..., tuple[str, Any]]:
        def _apply(sim: simstore.Sim, node: simstore.Node, op: Any) -> tuple[str, Any]:
            self._depth += 1
            try:
                kind, value = orig(sim, node, op)
            except BaseException as e:
                if self._depth == 1:
                    self._add(f"{self._where(sim, node)} {_op(op)} !! {type(e).__name__}: {e}")
                raise
            finally:
                self._depth -= 1
            if self._depth == 0:
                self._add(f"{self._where(sim, node)} {_op(op)} -> {kind} {_value(value)}")
            return kind, value
        return _apply

    def wrap_step(self, orig: Callable[..., None]) -> Callable[..., None]:
        def _step(sim: simstore.Sim, node: simstore.Node) -> None:
            before = node.error
            self._add(f"{self._where(sim, node)} step <- {_value(node.reply)}")
            orig(sim, node)
            if node.error is not before:
                self._add(f"{self._where(sim, node)} error {type(node.error).__name__}: "
                          f"{node.error}")
        return _step

    @contextlib.contextmanager
    def record(self) -> Iterator[Recorder]:
        saved = [(cls, name, cls.__dict__[name]) for cls in (simstore.Sim, multisim.MultiSim)
                 for name in ("_apply", "_step") if name in cls.__dict__]
        drawn = [(multisim.sc, "time"), (multisim.sc, "os")]  # world ids, proof names
        real = [getattr(mod, name) for mod, name in drawn]
        try:
            for (mod, name), was in zip(drawn, real, strict=True):
                setattr(mod, name, _Drawn(was))
            for cls, name, fn in saved:
                setattr(cls, name, (self.wrap_apply if name == "_apply" else self.wrap_step)(fn))
            yield self
        finally:
            for cls, name, fn in saved:
                setattr(cls, name, fn)
            for (mod, name), was in zip(drawn, real, strict=True):
                setattr(mod, name, was)


def _op(op: Any) -> str:
    if isinstance(op, multisim.Peek):  # its read is a function: named by the store only
        return f"Peek({op.store})"
    return repr(op)


def _value(value: Any) -> str:
    return "DOWN" if value is multisim.DOWN else repr(value)


def _digest(lines: list[str]) -> str:
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def scenarios() -> Iterator[tuple[str, Callable[[], str]]]:
    """(name, run): each run plays one scenario and says how it ended."""
    import test_prop_failover as prop
    import test_round

    for i, case in enumerate(test_round.CASES):
        def play_case(case: Any = case) -> str:
            sim = test_round._run(case)
            return f"rounds {sim.rounds()}"
        yield f"round/{i:02d}", play_case
    for name in sorted(n for n in vars(prop) if n.startswith("test_")):
        fn = getattr(prop, name)
        if name.startswith("test_random_schedules"):
            continue  # time-boxed, from a seed of the clock: SEEDS stand for it
        for suffix, kwargs in _parameters(fn):
            def play_test(fn: Any = fn, kwargs: dict[str, Any] = kwargs) -> str:
                try:
                    fn(**kwargs)
                except AssertionError as e:
                    return f"failed: {str(e).splitlines()[0] if str(e) else ''}"
                return "passed"
            yield f"failover/{name}{suffix}", play_test
    for seed in SEEDS:
        def play_seed(seed: int = seed) -> str:
            try:
                return prop.check(prop.schedule(seed)) or "ok"
            except Exception as e:  # a crash of the sim or the machine is a trace too
                return f"crashed: {type(e).__name__}: {e}"
        yield f"seed/{seed}", play_seed


def _parameters(fn: Any) -> list[tuple[str, dict[str, Any]]]:
    """The calls pytest makes of test ``fn``: ("[<values>]", its arguments) for each row of its
    ``parametrize`` marks (crossed, as pytest does), or ("", {}) for a plain test."""
    calls: list[tuple[str, dict[str, Any]]] = [("", {})]
    for mark in getattr(fn, "pytestmark", []):
        if mark.name != "parametrize":
            continue
        names = [n.strip() for n in mark.args[0].split(",")] if isinstance(
            mark.args[0], str) else list(mark.args[0])
        rows = [row if len(names) > 1 else (row,) for row in mark.args[1]]
        calls = [(f"{sfx}[{'-'.join(map(str, row))}]", {**kw, **dict(zip(names, row,
                                                                        strict=True))})
                 for sfx, kw in calls for row in rows]
    return calls


def trace(run: Callable[[], str]) -> list[str]:
    rec = Recorder()
    with rec.record():
        end = run()
    return [*rec.lines, f"end {end}"]


def digests(part: int = 0, parts: int = 1) -> dict[str, str]:
    """Each scenario's name -> its number of trace lines and the sha256 of its trace; of the
    scenarios ``part``, ``part + parts``, ``part + 2 * parts``... only (every one by default:
    each trace is of its scenario alone, whatever ran before it in the process)."""
    logging.disable(logging.WARNING)  # the machine's warnings: thousands, each normal
    try:
        out = {}
        for i, (name, run) in enumerate(scenarios()):
            if i % parts != part:
                continue
            lines = trace(run)
            out[name] = f"{len(lines)} {_digest(lines)}"
        return out
    finally:
        logging.disable(logging.NOTSET)


def read_digests(path: Path = DIGESTS) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        if line and not line.startswith("#"):
            name, rest = line.split(" ", 1)
            out[name] = rest
    return out


def write_digests(found: dict[str, str], path: Path = DIGESTS) -> None:
    head = ("# tests/rendezvous/tracing.py: scenario, trace lines, sha256 of the trace. "
            "Rewrite (--write) only on a tree whose behaviour is the reference.\n")
    path.write_text(head + "".join(f"{k} {v}\n" for k, v in found.items()))


def main(argv: list[str]) -> int:
    if argv[:1] == ["--diff"]:
        runs = dict(scenarios())
        print("\n".join(trace(runs[argv[1]])))
        return 0
    found = digests()
    if argv[:1] == ["--write"]:
        write_digests(found)
        print(f"wrote {len(found)} digests to {DIGESTS}")
        return 0
    want = read_digests() if DIGESTS.exists() else {}
    differ = [k for k in found.keys() | want.keys() if found.get(k) != want.get(k)]
    for k, v in found.items():
        print(k, v, "" if want.get(k) == v else "DIFFERS")
    print(f"{len(found)} scenarios, {len(differ)} differ from {DIGESTS.name}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
