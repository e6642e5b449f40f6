"""Type stub for the native epoll key-value server."""

from typing import Optional, Sequence

class KVServer:
    ops: int
    accepted: int
    closed: int
    protocol_errors: int
    waiting: int
    def __init__(
        self,
        listen_fds: Sequence[int],
        *,
        max_key: int = 8192,
        max_value: int = 8388608,
        max_keys: int = 131072,
        spin_us: int = 0,
    ) -> None: ...
    def serve_forever(self) -> None: ...
    def stop(self) -> None: ...
    def close(self) -> None: ...
    @property
    def num_connections(self) -> int: ...
    @property
    def num_keys(self) -> int: ...
    @property
    def last_error(self) -> Optional[str]: ...
