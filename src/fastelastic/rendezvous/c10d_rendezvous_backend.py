"""torch-shaped :class:`C10dRendezvousBackend`: the dynamic-rendezvous state in one store key."""

from __future__ import annotations

import binascii
import logging
import os
import tempfile
from base64 import b64decode, b64encode
from datetime import timedelta
from typing import Any

from fastelastic.errors import (
    RendezvousConnectionError,
    RendezvousError,
    RendezvousStateError,
    StoreTimeoutError,
)
from fastelastic.store._torch import maybe_torch_store

from .api import RendezvousParameters
from .dynamic_rendezvous import RendezvousBackend, Token
from .fast._store_hosting import host_store, token_from
from .fast.fast_rendezvous import DEFAULT_PORT
from .utils import parse_rendezvous_endpoint

__all__ = ["C10dRendezvousBackend", "create_backend"]

log = logging.getLogger(__name__)


class C10dRendezvousBackend(RendezvousBackend):
    """A rendezvous backend on a TCPStore (ours or torch's).

    The state is kept base64-encoded under ``torch.rendezvous.<run_id>`` and replaced with
    ``compare_set`` (the fencing token is the stored value). Every successful write also bumps
    ``<key>/v`` and sets ``<key>/v/<n>``, so a node can block until the state changes instead
    of polling.

    Args:
        store: The store to keep the state in.
        run_id: The run id of the rendezvous.

    Raises:
        ValueError: ``run_id`` is empty.
    """

    _NULL_SENTINEL = "Y2FuaW1hZGFt"

    def __init__(self, store: Any, run_id: str) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._store = store
        self._key = "torch.rendezvous." + run_id
        self._call("compare_set", self._key, "", self._NULL_SENTINEL)

    @property
    def name(self) -> str:
        """See base class."""
        return "c10d"

    def get_state(self) -> tuple[bytes, Token] | None:
        """See base class."""
        return self._decode(self._call("get", self._key))

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        """See base class."""
        encoded = b64encode(state).decode()
        if token:
            if not isinstance(token, bytes):
                current = self.get_state()
                return None if current is None else (*current, False)
            expected = token.decode()
        else:
            expected = self._NULL_SENTINEL
        stored = bytes(self._call("compare_set", self._key, expected, encoded))
        pair = self._decode(stored)
        if pair is None:
            return None
        won = pair[0] == state
        if won:
            n = int(self._call("add", self._key + "/v", 1))
            self._call("set", f"{self._key}/v/{n}", b"1")
        return pair[0], pair[1], won

    def wait_for_change(self, token: Token | None, timeout: float) -> None:
        """Blocks until the state differs from the one ``token`` fenced, or ``timeout`` passes."""
        n = int(self._call("add", self._key + "/v", 0))
        if bytes(self._call("get", self._key)) != (token or self._NULL_SENTINEL.encode()):
            return
        if timeout <= 0:
            return
        try:
            self._store.wait([f"{self._key}/v/{n + 1}"], timedelta(seconds=timeout))
        except StoreTimeoutError:
            return
        except (RuntimeError, ValueError) as e:
            if "timeout" in str(e).lower():  # torch's DistStoreError on a wait timeout
                return
            raise RendezvousConnectionError(
                "The connection to the C10d store has failed. See inner exception for details."
            ) from e

    def _call(self, op: str, *args: Any) -> Any:
        try:
            return getattr(self._store, op)(*args)
        except (ValueError, RuntimeError, TimeoutError) as e:
            raise RendezvousConnectionError(
                "The connection to the C10d store has failed. See inner exception for details."
            ) from e

    def _decode(self, raw: bytes) -> tuple[bytes, Token] | None:
        raw = bytes(raw)
        if raw == self._NULL_SENTINEL.encode():
            return None
        try:
            return b64decode(raw, validate=True), raw
        except binascii.Error as e:
            raise RendezvousStateError(
                "The state object is corrupt. See inner exception for details."
            ) from e


def _create_file_store(params: RendezvousParameters) -> Any:
    """A :class:`~fastelastic.store.file_store.FileStore` on the endpoint's path, or on a new
    private (0600) temporary file when the endpoint is empty, as torch builds its FileStore."""
    from fastelastic.store.file_store import FileStore

    if params.endpoint:
        path = params.endpoint
    else:
        try:
            fd, path = tempfile.mkstemp(prefix="fastelastic-rdzv-")
            os.close(fd)
        except OSError as e:
            raise RendezvousError(
                "The file creation for C10d store has failed. See inner exception for details."
            ) from e
    try:
        return FileStore(path)
    except (ValueError, RuntimeError, OSError) as e:
        raise RendezvousConnectionError(
            "The connection to the C10d store has failed. See inner exception for details."
        ) from e


def create_backend(params: RendezvousParameters) -> tuple[C10dRendezvousBackend, Any]:
    """Create a :class:`C10dRendezvousBackend` and its store from the parameters.

    ``rdzv_conf`` keys: ``store_type`` (``tcp``, default, or ``file``: a FileStore in torch's
    format on the file the endpoint names, or on a new temporary file if the endpoint is empty),
    ``read_timeout`` (seconds, default 60; TCP only), ``is_host`` (TCP only; default: the
    endpoint names this machine), ``token_file`` (TCP only: a shared secret guarding the store;
    default ``$FASTELASTIC_STORE_TOKEN_FILE``).

    Raises:
        ValueError: An unsupported store type or a non-positive read timeout.
        RendezvousConnectionError: The store cannot be hosted, reached or opened.
    """
    store_type = str(params.get("store_type", "tcp")).strip().lower()
    if store_type == "file":
        store = maybe_torch_store(_create_file_store(params))
        return C10dRendezvousBackend(store, params.run_id), store
    if store_type != "tcp":
        raise ValueError("Invalid store type given. Currently only supports file and tcp.")
    host, port = parse_rendezvous_endpoint(params.endpoint, DEFAULT_PORT)
    read_timeout = params.get_as_int("read_timeout", 60)
    if read_timeout is None or read_timeout <= 0:
        raise ValueError("The read timeout must be a positive integer.")
    store, _server = host_store(host, port, params.get_as_bool("is_host"),
                                 timedelta(seconds=read_timeout), token_from(params))
    store = maybe_torch_store(store)  # accepted by torch wherever it takes a Store
    return C10dRendezvousBackend(store, params.run_id), store
