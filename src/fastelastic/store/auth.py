"""The store's optional shared secret: where it comes from, and what makes a good one.

A store hosted with a token serves only clients that prove they know it: the server answers the
capability PING with a random challenge and the client returns HMAC-SHA256(token, context +
challenge) (``kvclient.pyx``); the token never crosses the network. torch's clients cannot
answer, so only the control-plane (rendezvous) store is hosted with one; see docs/store.md.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Optional

from fastelastic.errors import StoreError

__all__ = ["TOKEN_FILE_ENV", "MIN_TOKEN_BYTES", "read_token", "token_from_env"]

log = logging.getLogger("fastelastic.store")

TOKEN_FILE_ENV = "FASTELASTIC_STORE_TOKEN_FILE"
MIN_TOKEN_BYTES = 16
_MAX_TOKEN_BYTES = 4096


def read_token(path: str) -> bytes:
    """The token in the file at path (surrounding whitespace stripped).

    Raises:
        StoreError: the file is missing, unreadable, too short (under 16 bytes) or too long.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(_MAX_TOKEN_BYTES + 1)
            mode = os.fstat(f.fileno()).st_mode
    except OSError as e:
        raise StoreError(f"cannot read the store token file {path!r}: {e.strerror}") from e
    token = raw.strip()
    if len(raw) > _MAX_TOKEN_BYTES:
        raise StoreError(f"store token file {path!r} is over {_MAX_TOKEN_BYTES} bytes")
    if len(token) < MIN_TOKEN_BYTES:
        raise StoreError(
            f"store token file {path!r} holds {len(token)} bytes; use at least "
            f"{MIN_TOKEN_BYTES} random ones (e.g. `head -c 32 /dev/urandom | base64 > FILE`)")
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("store token file %s is readable by other users (chmod 600 it)", path)
    return token


def token_from_env() -> Optional[bytes]:
    """The token named by ``FASTELASTIC_STORE_TOKEN_FILE``, or None when it is not set."""
    path = os.environ.get(TOKEN_FILE_ENV, "").strip()
    return read_token(path) if path else None
