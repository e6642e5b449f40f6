"""Owns the output pump: one thread copying workers' pipes to log files, console and tails.

One thread per process context blocks in epoll on every pipe (no sleeps, no tailing of files).
Each pipe is a stream of one local rank; its bytes go to the rank's log file, optionally to the
console (line by line with a header when tee'd, raw otherwise) and to a filtered-lines file; for
stderr the last ``TAIL_BYTES`` are kept in memory so a failure can always show the traceback.
"""

from __future__ import annotations

import codecs
import logging
import os
import selectors
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, BinaryIO, TextIO

if TYPE_CHECKING:
    from fastelastic.multiprocessing.logs import LogsDest

logger = logging.getLogger(__name__)

TAIL_BYTES = 64 * 1024
_CHUNK = 65536


class StreamSink:
    """Where one pipe's bytes go."""

    def __init__(
        self,
        rank: int,
        file: BinaryIO | None,
        console: TextIO | None,
        header: str,
        filtered: TextIO | None = None,
        line_filter: Callable[[str], bool] | None = None,
        keep_tail: bool = False,
    ) -> None:
        self.rank = rank
        self.file = file
        self.console = console
        self.header = header
        self.filtered = filtered
        self.line_filter = line_filter
        self.tail = bytearray() if keep_tail else None
        self.eof = threading.Event()
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._partial = ""

    def feed(self, data: bytes) -> None:
        if self.file is not None:
            self.file.write(data)
            self.file.flush()
        if self.tail is not None:
            self.tail += data
            if len(self.tail) > TAIL_BYTES:
                del self.tail[: len(self.tail) - TAIL_BYTES]
        if self.console is None and self.filtered is None:
            return
        text = self._decoder.decode(data, final=not data)
        if self.header or self.filtered is not None:
            text = self._partial + text
            lines = text.split("\n")
            self._partial = lines.pop() if data else ""
            if not data and self._partial == "" and lines and lines[-1] == "":
                lines.pop()
            self._emit_lines(lines)
        elif text and self.console is not None:
            self.console.write(text)
            self.console.flush()

    def _emit_lines(self, lines: list[str]) -> None:
        if not lines:
            return
        if self.console is not None:
            if self.header:
                self.console.write("".join(f"{self.header}{ln}\n" for ln in lines))
            else:
                self.console.write("".join(f"{ln}\n" for ln in lines))
            self.console.flush()
        if self.filtered is not None and self.line_filter is not None:
            hits = [f"{self.header}{ln}\n" for ln in lines if self.line_filter(ln)]
            if hits:
                self.filtered.write("".join(hits))
                self.filtered.flush()

    def finish(self) -> None:
        """Flushes a last unterminated line and closes the log file."""
        if self._partial:
            self._emit_lines([self._partial])
            self._partial = ""
        if self.file is not None:
            self.file.close()
            self.file = None
        self.eof.set()

    def tail_text(self, max_lines: int = 60) -> str:
        """The last ``max_lines`` lines kept, decoded."""
        if not self.tail:
            return ""
        lines = bytes(self.tail).decode("utf-8", errors="replace").rstrip("\n").split("\n")
        return "\n".join(lines[-max_lines:])


class OutputPump:
    """Copies every registered pipe to its sink until EOF, in one background thread."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._sel = selectors.DefaultSelector()
        self._sinks: dict[int, StreamSink] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._sel.register(self._wake_r, selectors.EVENT_READ)
        self._stop = False
        self._thread: threading.Thread | None = None

    def add(self, fd: int, sink: StreamSink) -> None:
        """Registers the read end ``fd`` (the pump owns and closes it); call before start()."""
        os.set_blocking(fd, False)
        self._sinks[fd] = sink
        self._sel.register(fd, selectors.EVENT_READ)

    def sinks(self) -> list[StreamSink]:
        return list(self._sinks.values())

    def start(self) -> None:
        if not self._sinks:
            self._release()
            return
        self._thread = threading.Thread(target=self._run, name=f"fe-pump-{self._name}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while self._sinks and not self._stop:
                for key, _ in self._sel.select():
                    fd = key.fd
                    if fd == self._wake_r:
                        continue
                    self._read(fd)
        except Exception:
            logger.exception("output pump %s failed", self._name)
        finally:
            for fd in list(self._sinks):
                self._drop(fd)
            self._release()

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        sink = self._sinks[fd]
        try:
            sink.feed(data)
        except (OSError, ValueError):  # console closed or log file gone: keep draining
            logger.debug("output sink of rank %s failed", sink.rank, exc_info=True)
        if not data:
            self._drop(fd)

    def _drop(self, fd: int) -> None:
        sink = self._sinks.pop(fd)
        self._sel.unregister(fd)
        os.close(fd)
        try:
            sink.finish()
        except (OSError, ValueError):
            sink.eof.set()

    def _release(self) -> None:
        if self._wake_w >= 0:
            self._sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_w = -1

    def drain(self, timeout: float) -> bool:
        """Waits up to ``timeout`` s for EOF on every pipe; True if all reached EOF."""
        thread = self._thread
        if thread is None:
            self._release()
            return True
        thread.join(timeout)
        return not thread.is_alive()

    def stop(self) -> None:
        """Stops pumping now (pipes still held open, e.g. by escaped grandchildren, are closed)."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._stop = True
            try:
                os.write(self._wake_w, b"x")
            except OSError:
                pass
            thread.join(5)


class _ContainsAny:
    """Line filter of the duplicated logs: the line contains any of the words."""

    def __init__(self, words: list[str]) -> None:
        self._words = list(words)

    def __call__(self, line: str) -> bool:
        return any(word in line for word in self._words)


class StdioRouter:
    """Decides each worker's stdout/stderr from the log destinations and wires the pipes.

    stdout: inherited when not redirected; written straight to its file when only redirected;
    through the pump when tee'd (file + console with the line header + filtered copy).
    stderr: always through the pump, so its tail is kept: to the console raw when not
    redirected (plus a copy in ``<rank dir>/stderr.log``), to its file when redirected, and
    also to the console with the header when tee'd.
    """

    def __init__(
        self,
        pump: OutputPump,
        dest: LogsDest,
        prefixes: dict[int, str],
        name: str,
        filtered_out: tuple[TextIO | None, list[str] | None],
        filtered_err: tuple[TextIO | None, list[str] | None],
    ) -> None:
        self._pump = pump
        self._dest = dest
        self._prefixes = prefixes
        self._name = name
        self._filtered_out = filtered_out
        self._filtered_err = filtered_err
        self.stderr_sinks: dict[int, StreamSink] = {}

    def _header(self, rank: int) -> str:
        return self._prefixes.get(rank, f"[{self._name}{rank}]:")

    def child_fds(self, rank: int) -> tuple[int | None, int]:
        """Returns (stdout fd or None to inherit, stderr fd); the caller closes them after fork."""
        out_fd: int | None = None
        out_path = self._dest.stdouts[rank]
        if out_path and rank in self._dest.tee_stdouts:
            out_fd = self._pipe(
                rank, out_path, sys.stdout, self._header(rank), self._filtered_out, False
            )
        elif out_path:
            out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        err_path = self._dest.stderrs[rank]
        tee = rank in self._dest.tee_stderrs
        if err_path == "":
            err_fd = self._pipe(rank, self._capture_path(rank), sys.stderr, "", (None, None), True)
        else:
            err_fd = self._pipe(
                rank,
                err_path,
                sys.stderr if tee else None,
                self._header(rank) if tee else "",
                self._filtered_err if tee else (None, None),
                True,
            )
        return out_fd, err_fd

    def _capture_path(self, rank: int) -> str | None:
        err = self._dest.error_files.get(rank, "")
        if err and err != os.devnull and os.path.isdir(os.path.dirname(err)):
            return os.path.join(os.path.dirname(err), "stderr.log")
        return None

    def _pipe(
        self,
        rank: int,
        path: str | None,
        console: TextIO | None,
        header: str,
        filtered: tuple[TextIO | None, list[str] | None],
        keep_tail: bool,
    ) -> int:
        r, w = os.pipe()
        file = open(path, "wb") if path and path != os.devnull else None  # noqa: SIM115
        out, needles = filtered
        line_filter: Callable[[str], bool] | None = None
        if out is not None and needles:
            line_filter = _ContainsAny(needles)
        else:
            out = None
        sink = StreamSink(rank, file, console, header, out, line_filter, keep_tail)
        self._pump.add(r, sink)
        if keep_tail:
            self.stderr_sinks[rank] = sink
        return w
