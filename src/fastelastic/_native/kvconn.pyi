"""Type stub for the native store client's connection (the base of ``KVClient``)."""

from fastelastic.errors import StoreConnectionError

class HandshakeReset(StoreConnectionError): ...

class KVConn:
    timeout_ms: int
    def __init__(
        self, fd: int, peer: str, timeout: float, *, spin_us: int = 0, token: bytes = b""
    ) -> None: ...
    def close(self) -> None: ...
    @property
    def supports_extensions(self) -> bool: ...
