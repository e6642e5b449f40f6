"""Session setup shared by ``tests/`` and ``benchmarks/``.

torch's TCPStore makes a reverse-DNS lookup of its peer on every connect. Where the resolver
drops queries each connect stalls for seconds and the query leaves the machine. Before any test
runs we move this pytest process (and so every process it starts) into a private mount namespace
whose ``/etc/resolv.conf`` names 127.0.0.1, where nothing answers and lookups fail at once.
"""

from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import warnings

_CLONE_NEWNS = 0x00020000
_MS_BIND = 4096
_MS_REC = 16384
_MS_PRIVATE = 1 << 18


def _private_resolver() -> str | None:
    """Returns None on success, else the reason it could not be done."""
    if os.environ.get("FASTELASTIC_RESOLV_ISOLATED") == "1":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    if libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None) != 0:
        return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
    fd, path = tempfile.mkstemp(prefix="fastelastic-resolv-")
    os.write(fd, b"nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    os.close(fd)
    if libc.mount(path.encode(), b"/etc/resolv.conf", None, _MS_BIND, None) != 0:
        return f"bind mount over /etc/resolv.conf: {os.strerror(ctypes.get_errno())}"
    os.environ["FASTELASTIC_RESOLV_ISOLATED"] = "1"
    return None


def pytest_configure(config):
    reason = _private_resolver()
    if reason is not None:
        msg = (
            "!!! could not isolate the resolver (" + reason + "); torch's TCPStore clients may "
            "stall on reverse-DNS lookups. Run as root, or under `unshare -m` with "
            "/etc/resolv.conf bound to a file naming 127.0.0.1."
        )
        warnings.warn(msg)
        print(msg, file=sys.stderr)
