"""A tiny, obviously-correct encoder/decoder of the TCPStore wire protocol, for raw-socket tests."""

from __future__ import annotations

import socket
import struct
import threading
import time

VALIDATE, SET, COMPARE_SET, GET, ADD, CHECK, WAIT, GETNUMKEYS, DELETE_KEY, APPEND = range(10)
MULTI_GET, MULTI_SET, CANCEL_WAIT, PING, QUEUE_PUSH, QUEUE_POP, QUEUE_LEN = range(10, 17)
LIST_KEYS, BARRIER = 0x11, 0x12
EXT_WAIT_GET, EXT_TRY_MULTI_GET, EXT_ON_DISCONNECT_APPEND = 0x40, 0x41, 0x42
MAGIC = 0x3C85F7CE
EXT_NONCE = 0x7E57FA57
HANDSHAKE = struct.pack("<BIBI", VALIDATE, MAGIC, PING, 4242)
EXT_HANDSHAKE = struct.pack("<BIBI", VALIDATE, MAGIC, PING, EXT_NONCE)


def blob(b: bytes | str) -> bytes:
    if isinstance(b, str):
        b = b.encode()
    return struct.pack("<Q", len(b)) + b


def u64(n: int) -> bytes:
    return struct.pack("<Q", n & 0xFFFFFFFFFFFFFFFF)


def req(cmd: int, *parts: bytes) -> bytes:
    return bytes([cmd]) + b"".join(parts)


class Raw:
    """One raw connection; reads with a bounded timeout so a test never hangs."""

    def __init__(self, port: int, handshake: bool = True, timeout: float = 5.0,
                 ext: bool = False, host: str = "127.0.0.1") -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.timeout = timeout
        if handshake and ext:   # our capability PING: extensions allowed from now on
            self.sock.sendall(EXT_HANDSHAKE)
            assert self.recv(4) == struct.pack("<I", ~EXT_NONCE & 0xFFFFFFFF)
        elif handshake:
            self.sock.sendall(HANDSHAKE)
            assert self.recv(4) == struct.pack("<I", 4242)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def recv(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"closed after {len(out)} of {n} bytes")
            out += chunk
        return out

    def recv_u8(self) -> int:
        return self.recv(1)[0]

    def recv_i64(self) -> int:
        return struct.unpack("<q", self.recv(8))[0]

    def recv_blob(self) -> bytes:
        (n,) = struct.unpack("<Q", self.recv(8))
        return self.recv(n)

    def nothing_pending(self, within: float = 0.05) -> bool:
        """True if no byte arrives within `within` seconds (used only to check for silence)."""
        self.sock.settimeout(within)
        try:
            data = self.sock.recv(1)
        except socket.timeout:
            return True
        finally:
            self.sock.settimeout(self.timeout)
        return False if data else True

    def is_closed_by_peer(self, within: float = 5.0) -> bool:
        deadline = time.monotonic() + within
        self.sock.settimeout(within)
        try:
            while time.monotonic() < deadline:
                data = self.sock.recv(65536)
                if not data:
                    return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except socket.timeout:
            return False
        finally:
            self.sock.settimeout(self.timeout)
        return False

    def close(self) -> None:
        self.sock.close()


class FakeServer:
    """A listener whose behaviour per accepted connection is scripted (a broken server)."""

    def __init__(self, *scripts) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._run, args=(scripts,), daemon=True)
        self._thread.start()

    def _run(self, scripts) -> None:
        for script in scripts:
            c, _ = self.sock.accept()
            self.conns.append(c)
            script(c)

    def close(self) -> None:
        self._thread.join(10)
        for c in self.conns:
            c.close()
        self.sock.close()


def read_exact(c: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = c.recv(n - len(out))
        assert chunk
        out += chunk
    return out


def reset(c: socket.socket) -> None:
    c.recv(1)
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    c.close()


def answer_handshake(c: socket.socket) -> bytes:
    data = read_exact(c, 10)
    (nonce,) = struct.unpack("<I", data[6:10])
    c.sendall(struct.pack("<I", ~nonce & 0xFFFFFFFF))
    return data
