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


# --------------------------------------------------------------------------- multiprocessing


class SignalException(FastElasticError):
    """Raised in the agent process by its termination handler when it receives a death signal.

    torch: ``torch.distributed.elastic.multiprocessing.api.SignalException``; ``sigval`` is the
    ``signal.Signals`` received.
    """

    def __init__(self, msg: str, sigval: object) -> None:
        super().__init__(msg)
        self.sigval = sigval
