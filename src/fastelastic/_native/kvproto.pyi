"""Type stub for the store's wire protocol, without sockets."""

from typing import Optional

from fastelastic._native.kvcore import KVCore

def hmac_sha256(key: bytes, a: bytes, b: bytes) -> bytes: ...

class KVProtocol(KVCore):
    def __init__(
        self,
        *,
        max_key: int = 8192,
        max_value: int = 8388608,
        max_keys: int = 131072,
        max_reply: int = 67108864,
        max_unsent: int = 1048576,
        buffer_budget: int = 268435456,
        handshake_ms: int = 1000,
        token: bytes = b"",
        max_actions: int = 65536,
        max_action_bytes: int = 16777216,
    ) -> None: ...
    def execute_socketless(
        self, frames: bytes, *, handshaken: bool = True
    ) -> tuple[bytes, int, Optional[str]]: ...
