"""``multiprocessing.tail_log``, ``redirects`` and ``subprocess_handler`` with torch's names,
compared with torch's own modules where torch is installed."""

from __future__ import annotations

import io
import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fastelastic.multiprocessing.redirects import redirect_stderr, redirect_stdout
from fastelastic.multiprocessing.tail_log import TailLog


def _torch_mp():
    try:
        import torch.distributed.elastic.multiprocessing.tail_log as tl
    except ImportError as e:
        pytest.skip(f"!!! torch 2.13 is not importable ({e}); the comparison did not run")
    return tl


class _Sink(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            return super().write(s)


def _tail(cls, files, **kw):
    sink = _Sink()
    tailer = cls("trainer", files, sink, interval_sec=0.01, **kw).start()
    return tailer, sink


@pytest.mark.torch
def test_tail_log_matches_torch(tmp_path):
    tl = _torch_mp()
    files = {0: str(tmp_path / "0.log"), 1: str(tmp_path / "1.log")}
    ours, our_sink = _tail(TailLog, files, log_line_prefixes={1: "[custom]:"},
                           log_line_filter=lambda line: "skip" not in line)
    theirs, their_sink = _tail(tl.TailLog, files, log_line_prefixes={1: "[custom]:"},
                               log_line_filter=lambda line: "skip" not in line)
    # the files appear after start(), and grow while tailed
    for rank, path in files.items():
        with open(path, "w") as f:
            for i in range(50):
                f.write(f"line {i} of {rank}{' skip' if i % 10 == 0 else ''}\n")
                f.flush()
    ours.stop()
    theirs.stop()
    assert ours.stopped() and theirs.stopped()
    got, expected = sorted(our_sink.getvalue().splitlines()), sorted(
        their_sink.getvalue().splitlines())
    assert got == expected and len(got) == 90
    assert "[trainer0]:line 1 of 0" in got and "[custom]:line 1 of 1" in got


def test_tail_log_stop_without_files_and_partial_lines(tmp_path):
    missing = {0: str(tmp_path / "never.log")}
    tailer, sink = _tail(TailLog, missing)
    tailer.stop()  # the file never appeared: returns, writes nothing
    assert sink.getvalue() == "" and tailer.stopped()
    path = tmp_path / "p.log"
    tailer, sink = _tail(TailLog, {3: str(path)})
    with open(path, "w") as f:
        f.write("half")
        f.flush()
        f.write(" and rest\nno newline at the end")
    tailer.stop()
    # a line is written whole, never split by a read racing the writer
    assert sink.getvalue() == "[trainer3]:half and rest\n[trainer3]:no newline at the end"


REDIRECT = textwrap.dedent(
    """
    import ctypes, os, sys
    from {mod} import redirect_stdout, redirect_stderr
    libc = ctypes.CDLL("libc.so.6")
    with redirect_stdout(sys.argv[1]), redirect_stderr(sys.argv[2]):
        print("python out")
        libc.printf(b"c out\\n")
        os.system("echo child out; echo child err >&2")
        print("python err", file=sys.stderr)
    print("restored")
    """
)


@pytest.mark.parametrize("mod", [
    "fastelastic.multiprocessing.redirects",
    pytest.param("torch.distributed.elastic.multiprocessing.redirects", marks=pytest.mark.torch),
])
def test_redirects_catch_python_c_and_children(tmp_path, mod):
    if mod.startswith("torch"):
        _torch_mp()
    out, err = tmp_path / "out", tmp_path / "err"
    r = subprocess.run([sys.executable, "-c", REDIRECT.format(mod=mod), str(out), str(err)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout == "restored\n"
    assert sorted(out.read_text().splitlines()) == ["c out", "child out", "python out"]
    assert sorted(err.read_text().splitlines()) == ["child err", "python err"]


def test_redirect_rejects_unknown_streams(tmp_path):
    from fastelastic.multiprocessing.redirects import redirect

    with pytest.raises(ValueError, match="unknown standard stream"):
        with redirect("stdin", str(tmp_path / "x")):
            pass
    assert callable(redirect_stdout) and callable(redirect_stderr)


def test_subprocess_handler_modules_have_torchs_names(tmp_path):
    from fastelastic.multiprocessing.subprocess_handler import (
        SubprocessHandler,
        get_subprocess_handler,
    )
    from fastelastic.multiprocessing.subprocess_handler.handlers import (
        get_subprocess_handler as from_handlers,
    )
    from fastelastic.multiprocessing.subprocess_handler.subprocess_handler import (
        SubprocessHandler as from_module,
    )

    assert from_handlers is get_subprocess_handler and from_module is SubprocessHandler
    out = tmp_path / "out"
    h = get_subprocess_handler(
        entrypoint=sys.executable,
        args=("-c", "import os, time; print(os.environ['FE_X'], flush=True); time.sleep(60)"),
        env={"FE_X": "hello"}, stdout=str(out), stderr="", local_rank_id=0,
    )
    assert isinstance(h, SubprocessHandler) and h.local_rank_id == 0
    pidfd = os.pidfd_open(h.proc.pid)
    try:
        assert os.getpgid(h.proc.pid) == h.proc.pid  # its own process group, as torch's
        deadline = time.monotonic() + 30
        while out.read_text() != "hello\n":  # the worker is up and has written
            assert time.monotonic() < deadline, "the worker wrote nothing within 30 s"
            assert select.select([pidfd], [], [], 0.01)[0] == [], "the worker died"
        h.close()  # SIGTERM to the group
        assert h.proc.wait(30) == -signal.SIGTERM
    finally:
        os.close(pidfd)
    assert out.read_text() == "hello\n"
