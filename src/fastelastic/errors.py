"""Every exception fastelastic raises, under one root: :class:`FastElasticError`.

The names mirror torch's where torch has one, and the bases are chosen so that code written
against torch keeps catching what it caught before: store errors are ``RuntimeError`` (as
torch's ``DistStoreError``), timeouts are also ``TimeoutError``.
"""

from __future__ import annotations


class FastElasticError(Exception):
    """Root of every fastelastic exception."""


# --------------------------------------------------------------------------- store


class StoreError(FastElasticError, RuntimeError):
    """A key-value store operation failed (torch: ``DistStoreError``)."""


class StoreTimeoutError(StoreError, TimeoutError):
    """A wait, get or barrier on the store did not complete within its timeout."""


class StoreConnectionError(StoreError, ConnectionError):
    """The connection to the store could not be made or was lost (torch: ``DistNetworkError``)."""


class QueueEmptyError(StoreError):
    """``queue_pop`` found the queue empty (torch: ``QueueEmptyError``)."""


# --------------------------------------------------------------------------- rendezvous


class RendezvousError(FastElasticError, Exception):
    """Represents the base type for rendezvous errors."""


class RendezvousClosedError(RendezvousError):
    """Raised when a rendezvous is closed."""


class RendezvousTimeoutError(RendezvousError):
    """Raised when a rendezvous did not complete on time."""


class RendezvousConnectionError(RendezvousError):
    """Raised when the connection to a rendezvous backend has failed."""


class RendezvousStateError(RendezvousError):
    """Raised when the state of a rendezvous is corrupt."""


class RendezvousMemberLostError(RendezvousError):
    """Raised when a member of this node's round was lost (dead, cut off or silent).

    ``lost`` lists ``(rank, why)`` of the lost members; the agent re-joins the next round.
    """

    def __init__(self, lost: list[tuple[int, str]]) -> None:
        self.lost = list(lost)
        super().__init__("; ".join(f"rank {r}: {why}" for r, why in self.lost))


class RendezvousGracefulExitError(RendezvousError):
    """Raised when node wasn't included in rendezvous and gracefully exits.

    This is an expected condition, not an error; the agent exits cleanly.
    """


# --------------------------------------------------------------------------- timer


class TimerError(FastElasticError):
    """The watchdog timer could not be set up or a request was refused."""


# --------------------------------------------------------------------------- launcher


class LaunchError(FastElasticError):
    """The launcher was given a configuration it cannot run."""


class NumaBindingError(FastElasticError, RuntimeError):
    """``--numa-binding`` / ``numa_options`` cannot bind a worker (its text is one line).

    torch fails in the same cases (a ``RuntimeError``, ``AssertionError`` or ``ValueError`` from
    ``torch.numa.binding``); with ``should_fall_back_if_binding_fails`` the worker runs unbound.
    """


# --------------------------------------------------------------------------- multiprocessing


class SignalException(FastElasticError):
    """Raised in the agent process by its termination handler when it receives a death signal.

    torch: ``torch.distributed.elastic.multiprocessing.api.SignalException``; ``sigval`` is the
    ``signal.Signals`` received.
    """

    def __init__(self, msg: str, sigval: object) -> None:
        super().__init__(msg)
        self.sigval = sigval


_FAILURE_FMT = """[{idx}]:
  time      : {time}
  host      : {host}
  rank      : {rank} (local_rank: {local_rank})
  exitcode  : {exitcode} (pid: {pid}) {signal}
  error_file: {error_file}
  traceback : {traceback}"""


class ChildFailedError(FastElasticError):
    """One or more worker processes failed; names the root cause (first observed failure).

    Same shape as torch's ``ChildFailedError``: ``name`` and ``failures`` (global rank ->
    :class:`fastelastic.multiprocessing.errors.ProcessFailure`). Raising it from a function
    decorated with ``@record`` copies the root cause's error file into this process's own
    ``TORCHELASTIC_ERROR_FILE``, so the traceback travels up to the scheduler.

    Args:
        name: what failed (the entrypoint name).
        failures: the failures by global rank; must not be empty.

    Raises:
        ValueError: ``failures`` is empty.
    """

    def __init__(self, name: str, failures: dict) -> None:
        if not failures:
            raise ValueError("ChildFailedError needs at least one failure")
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple:
        """Returns ``(global_rank, failure)`` of the earliest failure (ties: first inserted)."""
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        """Formats the report the way torch does: a root-cause block and the other failures."""
        import socket

        host = socket.gethostname()  # never getfqdn: a reverse lookup may stall
        title = f"{self.name} FAILED"
        root_rank, _ = self.get_first_failure()
        root_fmt = ""
        others: list[str] = []
        width = len(title)
        for idx, (rank, failure) in enumerate(self.failures.items()):
            fmt = self._format_failure(idx, rank, failure, host)
            width = max(width, *(len(line) for line in fmt.split("\n")))
            if rank == root_rank:
                root_fmt = fmt
            else:
                others.append(fmt)
        width = min(width, 60)
        return "\n".join(
            [
                "",
                boarder_delim * width,
                title,
                section_delim * width,
                "Failures:",
                "\n".join(others or ["  <NO_OTHER_FAILURES>"]),
                section_delim * width,
                "Root Cause (first observed failure):",
                root_fmt,
                boarder_delim * width,
            ]
        )

    @staticmethod
    def _format_failure(idx: int, rank: int, failure, host: str) -> str:
        msg = failure.message
        if isinstance(msg, dict):
            msg = msg.get("extraInfo", {}).get("py_callstack", msg.get("message", "<N/A>"))
        msg = str(msg).replace("\n", "\n  ")
        signal_name = failure.signal_name()
        return _FAILURE_FMT.format(
            idx=idx,
            time=failure.timestamp_isoformat(),
            host=host,
            rank=rank,
            local_rank=failure.local_rank,
            exitcode=failure.exitcode,
            pid=failure.pid,
            signal=f" ({signal_name})" if signal_name != "<N/A>" else "",
            error_file=failure.error_file,
            traceback=msg,
        )
