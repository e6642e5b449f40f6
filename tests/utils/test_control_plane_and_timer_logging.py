"""``control_plane.worker_main`` and ``timer.debug_info_logging`` with torch's behaviour."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from fastelastic.control_plane import worker_main
from fastelastic.timer.debug_info_logging import log_debug_info_for_expired_timers

WORKER = textwrap.dedent(
    """
    import os, socket, sys
    from {mod} import worker_main

    @worker_main()
    def main():
        s = socket.socket(socket.AF_UNIX)
        s.connect(os.environ["TORCH_WORKER_SERVER_SOCKET"])
        s.sendall(b"GET /handler/ HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        print(data.split(b"\\r\\n\\r\\n", 1)[1].decode())

    main()
    """
)


@pytest.mark.torch
@pytest.mark.parametrize("mod", ["fastelastic.control_plane",
                                 "torch.distributed.elastic.control_plane"])
def test_worker_main_serves_the_worker_handlers(tmp_path, mod):
    pytest.importorskip("torch", reason="!!! torch is not installed: worker_main's server is "
                        "torch's, this test did not run")
    sock = str(tmp_path / "w.sock")
    env = {**os.environ, "TORCH_WORKER_SERVER_SOCKET": sock}
    r = subprocess.run([sys.executable, "-c", WORKER.format(mod=mod)], capture_output=True,
                       text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert '"ping"' in r.stdout and '"dump_traceback"' in r.stdout
    assert not os.path.exists(sock) or not _listening(sock)  # shut down on exit


def _listening(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def test_worker_main_without_socket_is_a_plain_wrapper(monkeypatch):
    monkeypatch.delenv("TORCH_WORKER_SERVER_SOCKET", raising=False)
    calls = []

    @worker_main()
    def main(x):
        calls.append(x)
        return x * 2

    assert main(21) == 42 and calls == [21]

    @worker_main()
    def failing():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        failing()


def test_expired_timers_are_logged_as_torch_does(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="fastelastic.timer.debug_info_logging")
    log_debug_info_for_expired_timers("run-7", {})
    assert caplog.records == []
    log_debug_info_for_expired_timers("run-7", {42: ['{"pid": 42}']})
    assert [r.getMessage() for r in caplog.records] == [
        "Timers expired for run:[run-7] [{42: ['{\"pid\": 42}']}]."
    ]
