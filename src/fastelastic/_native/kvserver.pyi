"""Type stub for the native epoll key-value server."""

from typing import Sequence

from fastelastic._native.kvproto import KVProtocol

class KVServer(KVProtocol):
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
        max_actions: int = 65536,
        max_action_bytes: int = 16777216,
    ) -> None: ...
    def serve_forever(self) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...
