"""Type stub for the native epoll key-value server."""

from typing import Optional, Sequence

CONN_BYTES: int

def hmac_sha256(key: bytes, a: bytes, b: bytes) -> bytes: ...

class KVServer:
    ops: int
    accepted: int
    closed: int
    protocol_errors: int
    waiting: int
    refused_fds: int
    shed: int
    paused: int
    def __init__(
        self,
        listen_fds: Sequence[int],
        *,
        max_key: int = 8192,
        max_value: int = 8388608,
        max_keys: int = 131072,
        spin_us: int = 0,
        max_reply: int = 67108864,
        max_unsent: int = 1048576,
        buffer_budget: int = 268435456,
        handshake_ms: int = 1000,
        token: bytes = b"",
        keepalive_s: int = 0,
    ) -> None: ...
    def serve_forever(self) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...
    def execute_socketless(
        self, frames: bytes, *, handshaken: bool = True
    ) -> tuple[bytes, int, Optional[str]]: ...
    @property
    def num_connections(self) -> int: ...
    @property
    def num_keys(self) -> int: ...
    @property
    def last_error(self) -> Optional[str]: ...
    @property
    def buffered(self) -> int: ...
    @property
    def requires_token(self) -> bool: ...
