"""``TailLog``: copies lines of log files, as they are written, to one stream with a header.

torch's workers write to files that the agent tails; ours pipe their output straight to the
agent (``_pump``), so fastelastic itself does not need this. It is here for code that imports it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["TailLog", "tail_logfile"]

logger = logging.getLogger(__name__)

_MAX_PARTIAL = 1 << 20  # a "line" this long without a newline is written out as it is


def tail_logfile(
    header: str,
    file: str,
    dst: TextIO,
    finished: threading.Event,
    interval_sec: float,
    log_line_filter: Callable[[str], bool] | None = None,
) -> None:
    """Writes each line of ``file`` to ``dst`` prefixed by ``header`` until ``finished`` is set
    and the file has been read to its end; waits for the file to appear (returns if it never
    does before ``finished``). Lines ``log_line_filter`` rejects are skipped.

    A line is written once it is complete (or when ``finished`` is set), never in pieces.
    """
    while not os.path.exists(file):
        if finished.wait(interval_sec):
            if not os.path.exists(file):
                return
            break
    partial = ""
    with open(file, errors="replace") as fp:
        while True:
            chunk = fp.readline()
            if chunk:
                partial += chunk
                if not partial.endswith("\n") and len(partial) < _MAX_PARTIAL:
                    continue
                line, partial = partial, ""
                if log_line_filter is None or log_line_filter(line):
                    dst.write(f"{header}{line}")
                continue
            if finished.is_set():
                rest = fp.read()  # written between the last read and the stop
                if rest:
                    partial += rest
                    continue
                if partial and (log_line_filter is None or log_line_filter(partial)):
                    dst.write(f"{header}{partial}")
                return
            time.sleep(interval_sec)


class TailLog:
    """Tails ``log_files`` (local rank -> path) into ``dst``, each line prefixed by
    ``[{name}{local_rank}]:`` or by ``log_line_prefixes[local_rank]``.

    The files need not exist at ``start()``; ``stop()`` writes what is left and joins the
    threads (one per file).

    Args:
        name: the header's name part.
        log_files: local rank -> file to tail.
        dst: where lines go (``None`` or no files: ``start`` does nothing).
        log_line_prefixes: per-rank headers replacing the default one.
        interval_sec: how long to sleep when a file has nothing new.
        log_line_filter: only lines for which it returns True are written.
    """

    def __init__(
        self,
        name: str,
        log_files: dict[int, str],
        dst: TextIO,
        log_line_prefixes: dict[int, str] | None = None,
        interval_sec: float = 0.1,
        log_line_filter: Callable[[str], bool] = (lambda _: True),
    ) -> None:
        self._name = name
        self._dst = dst
        self._log_files = log_files
        self._log_line_prefixes = log_line_prefixes or {}
        self._interval_sec = interval_sec
        self._log_line_filter = log_line_filter
        self._finished = {rank: threading.Event() for rank in log_files}
        self._threads: list[tuple[int, threading.Thread]] = []
        self._errors: dict[int, BaseException] = {}
        self._stopped = False

    def _tail(self, rank: int, header: str, file: str) -> None:
        try:
            tail_logfile(
                header, file, self._dst, self._finished[rank], self._interval_sec,
                self._log_line_filter,
            )
        except Exception as e:
            self._errors[rank] = e

    def start(self) -> TailLog:
        """Starts one tailing thread per file; returns ``self``."""
        if not self._log_files or not self._dst:
            return self
        for rank, file in self._log_files.items():
            header = self._log_line_prefixes.get(rank, f"[{self._name}{rank}]:")
            t = threading.Thread(
                target=self._tail, args=(rank, header, file), daemon=True,
                name=f"TailLog_{self._name}{rank}",
            )
            t.start()
            self._threads.append((rank, t))
        return self

    def stop(self) -> None:
        """Lets every thread finish its file, then joins them; errors are logged."""
        for finished in self._finished.values():
            finished.set()
        for rank, t in self._threads:
            t.join()
            if rank in self._errors:
                e = self._errors[rank]
                logger.error(
                    "error in log tailer for %s%s. %s", self._name, rank,
                    type(e).__qualname__, exc_info=e,
                )
        self._stopped = True

    def stopped(self) -> bool:
        """Whether ``stop()`` has completed."""
        return self._stopped
