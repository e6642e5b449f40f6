"""Type stub for the store server's state (connections, map, waits, buffer budget)."""

from typing import Optional

CONN_BYTES: int

class KVCore:
    ops: int
    accepted: int
    closed: int
    protocol_errors: int
    waiting: int
    refused_fds: int
    shed: int
    paused: int
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
    def fail_wakeup_reply(self, after: int = 0) -> None: ...
