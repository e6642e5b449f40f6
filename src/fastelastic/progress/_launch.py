"""The agent's side of the progress slots: making them, reading them, stack dumps, injection.

One slot file per worker and attempt in a private directory (``mkdtemp``, mode 0700); the
worker maps it (``fastelastic.progress._worker``) and the agent maps it read-only, so a look
at every rank is a few memory loads, no syscall and no socket.
"""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from fastelastic.progress import _worker as w

PROGRESS_ENV = w.PROGRESS_ENV
_SAVED_PYTHONPATH = "FASTELASTIC_PROGRESS_PYTHONPATH"
SITE_DIR = str(Path(__file__).resolve().with_name("_site"))
_DUMP_WAIT_S = 2.0  # the longest a stack dump is waited for (faulthandler writes in ~1 ms)
_DUMP_QUIET_S = 0.05  # a dump that grew nothing for this long is complete


@dataclass(frozen=True)
class SlotView:
    """One rank's marks as read at one instant (times on CLOCK_MONOTONIC, in ns)."""

    pid: int
    steps: int
    last_ns: int
    suspend: int
    suspend_ns: int
    suspend_kind: int
    eval_ns: int
    main_tid: int
    dump_sig: int
    hooked: bool
    end_ns: int = 0  # when its program ended (main code returned), 0 while it runs


    def suspend_names(self) -> list[str]:
        """What suspends the check on this rank (``torch.save``, ``evaluation``...)."""
        out = [name for bit, name in w.KIND_NAMES.items() if self.suspend_kind & bit]
        if self.eval_ns:
            out.append("evaluation")
        if self.end_ns:
            out.append("exiting")
        return out


def plain_start_env(env: dict[str, str], inherited: dict[str, str]) -> dict[str, str]:
    """``env`` plus the bootstrap ``sitecustomize`` for a worker started plainly.

    Only when ``env`` asks for progress reports (the zygote's workers need none of this: the
    zygote arms them after its fork, and a changed ``PYTHONPATH`` would make it refuse them).
    ``inherited`` is the environment the worker would otherwise get ``PYTHONPATH`` from.
    """
    if PROGRESS_ENV not in env:
        return env
    out = dict(env)
    base = env["PYTHONPATH"] if "PYTHONPATH" in env else inherited.get("PYTHONPATH")
    if base is None:
        out.pop(_SAVED_PYTHONPATH, None)
        out["PYTHONPATH"] = SITE_DIR
    else:
        out[_SAVED_PYTHONPATH] = base
        out["PYTHONPATH"] = SITE_DIR + (os.pathsep + base if base else "")
    return out


class ProgressSlots:
    """The progress slots of one agent: a directory, and one slot per worker per attempt."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="fastelastic-progress-")
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self.paths: dict[int, str] = {}
        self._attempt = 0

    def prepare(self, local_ranks: list[int]) -> dict[int, str]:
        """Fresh zeroed slots for a new attempt; returns ``{local_rank: path}``."""
        self._release()
        self._attempt += 1
        for lr in local_ranks:
            path = os.path.join(self.dir, f"slot.{self._attempt}.{lr}")
            with open(path, "wb") as f:
                f.write(b"\0" * w.SLOT_SIZE)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            try:
                mm = mmap.mmap(fd, w.SLOT_SIZE)
            finally:
                os.close(fd)
            view = memoryview(mm).cast("q")
            view[w.F_MAGIC] = w.MAGIC
            self._maps[lr] = (mm, view)
            self.paths[lr] = path
        return dict(self.paths)

    def read(self, lr: int) -> SlotView | None:
        got = self._maps.get(lr)
        if got is None:
            return None
        v = got[1]
        return SlotView(
            pid=v[w.F_PID], steps=v[w.F_STEPS], last_ns=v[w.F_LAST_NS],
            suspend=v[w.F_SUSPEND], suspend_ns=v[w.F_SUSPEND_NS],
            suspend_kind=v[w.F_SUSPEND_KIND], eval_ns=v[w.F_EVAL_NS],
            main_tid=v[w.F_MAIN_TID], dump_sig=v[w.F_DUMP_SIG], hooked=bool(v[w.F_HOOKED]),
            end_ns=v[w.F_END_NS],
        )

    def read_all(self) -> dict[int, SlotView]:
        out = {}
        for lr in self._maps:
            view = self.read(lr)
            if view is not None:
                out[lr] = view
        return out

    def dump_stacks(self, pids: dict[int, int]) -> dict[int, str]:
        """Every thread's Python stack of each rank that armed its dump, as faulthandler wrote
        it (from its C signal handler: a thread holding the GIL in a C call does not stop
        it); ``{local_rank: text}`` ('' when a rank could not dump)."""
        asked: dict[int, str] = {}
        out: dict[int, str] = {}
        for lr, pid in pids.items():
            view = self.read(lr)
            path = self.paths.get(lr, "") + ".stacks"
            out[lr] = ""
            if view is None or not view.dump_sig or view.pid != pid:
                continue  # an unarmed process would die of the signal
            try:
                with open(path, "r+b") as f:
                    f.truncate(0)
                os.kill(pid, view.dump_sig)
            except OSError:
                continue
            asked[lr] = path
        deadline = time.monotonic() + _DUMP_WAIT_S
        sizes = {lr: -1 for lr in asked}
        quiet_since = {lr: 0.0 for lr in asked}
        while asked and time.monotonic() < deadline:
            for lr in list(asked):
                size = _size(asked[lr])
                now = time.monotonic()
                if size != sizes[lr] or size <= 0:
                    sizes[lr], quiet_since[lr] = size, now
                elif now - quiet_since[lr] >= _DUMP_QUIET_S:
                    out[lr] = _read(asked.pop(lr))
            if asked:
                time.sleep(0.01)  # bounded poll of another process's file (2 s at most)
        for lr, path in asked.items():
            out[lr] = _read(path)
        return out

    def _release(self) -> None:
        for lr, (mm, view) in self._maps.items():
            view.release()
            mm.close()
            path = self.paths.get(lr)
            for p in (path, f"{path}.stacks"):
                try:
                    if p:
                        os.unlink(p)
                except OSError:
                    pass
        self._maps.clear()
        self.paths.clear()

    def close(self) -> None:
        self._release()
        shutil.rmtree(self.dir, ignore_errors=True)


PYSPY_ENV = "FASTELASTIC_HANG_PYSPY"  # "0": no native frames even when py-spy is installed
_PYSPY_TIMEOUT_S = 10.0


class NativeDumps:
    """``py-spy dump --native`` of a node's ranks (in parallel, 10 s at most), when py-spy is
    installed (``fastelastic[debug]``) and not turned off. Begun at the verdict, in the
    background while the nodes exchange frames; the caller says how long to wait for the rest
    (``collect``'s ``until``)."""

    def __init__(self, pids: dict[int, int], out_dir: str) -> None:
        self.local_ranks = set(pids)
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self._files: dict[int, str] = {}
        self._errors: dict[int, str] = {}
        self._deadline = time.monotonic() + _PYSPY_TIMEOUT_S
        exe = shutil.which("py-spy")
        if exe is None or os.environ.get(PYSPY_ENV) == "0":
            return
        for lr, pid in pids.items():
            path = os.path.join(out_dir, f"native.{lr}.txt")
            try:
                with open(path, "wb") as f:  # a file, not a pipe: a long dump never blocks
                    self._procs[lr] = subprocess.Popen(
                        [exe, "dump", "--native", "--pid", str(pid)],
                        stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
                self._files[lr] = path
            except OSError as e:
                self._errors[lr] = f"py-spy could not start: {e}"

    def collect(self, local_ranks: set[int], until: float | None = None) -> dict[int, str]:
        """The dumps of ``local_ranks``, waiting for what is left of them until ``until``
        (``time.monotonic()``; at most the dumps' own 10 s); the rest are dropped. ``{}``
        without py-spy."""
        out = {lr: e for lr, e in self._errors.items() if lr in local_ranks}
        deadline = self._deadline if until is None else min(until, self._deadline)
        for lr in sorted(local_ranks & set(self._procs)):
            try:
                self._procs[lr].wait(timeout=max(0.0, deadline - time.monotonic()))
                out[lr] = _read(self._files[lr])
            except subprocess.TimeoutExpired:
                out[lr] = (f"py-spy did not answer within {_PYSPY_TIMEOUT_S:g} s"
                           if deadline == self._deadline else
                           "py-spy had not finished when the restart was due: not waited for"
                           " (the Python stack above is the rank's own)")
        self.cancel()
        return out

    def cancel(self) -> None:
        """Ends the dumps still running and removes their files."""
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
            p.wait()
        for path in self._files.values():
            try:
                os.unlink(path)
            except OSError:
                pass
        self._procs.clear()
        self._files.clear()
        self._errors.clear()


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _read(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""

