"""The store's optional shared secret: challenge-response in the capability handshake."""

from __future__ import annotations

import hmac
import os
import socket
import struct
import subprocess
import sys
import threading
from datetime import timedelta

import pytest

from fastelastic._native.kvproto import hmac_sha256
from fastelastic.errors import StoreConnectionError, StoreError
from fastelastic.store import TCPStore
from fastelastic.store.auth import TOKEN_FILE_ENV, read_token

from ._wire import EXT_HANDSHAKE, EXT_NONCE, GET, HANDSHAKE, SET, Raw, blob, req

TOKEN = b"k3y-" + os.urandom(24).hex().encode()
EXT_AUTH, EXT_AUTH_NONCE = 0x43, 0x5EC2E7ED
CONTEXT = b"fastelastic-store-auth-v1"


@pytest.fixture
def token_file(tmp_path):
    p = tmp_path / "token"
    p.write_bytes(TOKEN + b"\n")
    p.chmod(0o600)
    return str(p)


@pytest.fixture
def guarded(token_file):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastelastic.store", "--host", "127.0.0.1", "--port", "0",
         "--token-file", token_file], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert "listening on" in line, proc.stderr.read() if proc.poll() is not None else line
    yield int(line.rsplit(":", 1)[1])
    proc.terminate()
    assert proc.wait(10) == 0


def test_server_hmac_matches_the_standard_library():
    for klen in (0, 16, 64, 65, 300):
        for n in (0, 1, 55, 56, 64, 119, 1000):
            k, a, b = os.urandom(klen), os.urandom(n), os.urandom(32)
            assert hmac_sha256(k, a, b) == hmac.new(k, a + b, "sha256").digest(), (klen, n)


def test_clients_with_the_token_are_served(guarded):
    c = TCPStore("127.0.0.1", guarded, timeout=5, wait_for_workers=False, token=TOKEN)
    c.set("a", "1")
    assert c.get("a") == b"1" and c.supports_extensions
    c.append_on_disconnect("gone", "x")   # extensions work after the proof
    c.close()


def test_the_env_variable_gives_clients_the_token(guarded, token_file, monkeypatch):
    monkeypatch.setenv(TOKEN_FILE_ENV, token_file)
    c = TCPStore("127.0.0.1", guarded, timeout=5, wait_for_workers=False)
    assert c.add("n", 1) == 1
    c.close()


def test_without_or_with_a_wrong_token_nothing_is_served(guarded):
    with pytest.raises(StoreConnectionError, match="requires a token"):
        TCPStore("127.0.0.1", guarded, timeout=5, wait_for_workers=False)
    with pytest.raises(StoreConnectionError, match="rejected this client's token"):
        TCPStore("127.0.0.1", guarded, timeout=5, wait_for_workers=False,
                 token=b"not-the-token-at-all")
    # A torch-style client: the handshake itself is answered, every request after it refused.
    r = Raw(guarded)
    r.send(req(SET, blob("/forged"), blob("1")))
    assert r.is_closed_by_peer()
    r2 = Raw(guarded, handshake=False)
    r2.send(HANDSHAKE[:5] + req(GET, blob("/a")))
    assert r2.is_closed_by_peer()
    check = TCPStore("127.0.0.1", guarded, timeout=5, wait_for_workers=False, token=TOKEN)
    assert not check.check(["forged"])
    check.close()


def _challenge(port: int) -> tuple[Raw, bytes]:
    r = Raw(port, handshake=False)
    r.send(EXT_HANDSHAKE)
    assert struct.unpack("<I", r.recv(4))[0] == EXT_AUTH_NONCE
    return r, r.recv(32)


def test_a_proof_answers_only_its_own_challenge(guarded):
    a, ca = _challenge(guarded)
    b, cb = _challenge(guarded)
    assert ca != cb
    b.send(bytes([EXT_AUTH]) + hmac.new(TOKEN, CONTEXT + ca, "sha256").digest())   # replayed
    assert b.is_closed_by_peer()
    a.send(bytes([EXT_AUTH]) + hmac.new(TOKEN, CONTEXT + ca, "sha256").digest())
    assert a.recv_u8() == 0
    a.send(req(SET, blob("/ok"), blob("1")) + req(GET, blob("/ok")))
    assert a.recv_blob() == b"1"
    a.close()


def test_the_token_never_crosses_the_wire():
    """A scripted server records every byte our client sends while it proves the token."""
    challenge = os.urandom(32)
    seen = bytearray()
    sock = socket.create_server(("127.0.0.1", 0))

    def serve():
        c, _ = sock.accept()
        with c:
            seen.extend(c.recv(10))
            c.sendall(struct.pack("<I", EXT_AUTH_NONCE) + challenge)
            while len(seen) < 10 + 33:
                seen.extend(c.recv(64))
            c.sendall(b"\x00")
            c.recv(1)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    store = TCPStore("127.0.0.1", sock.getsockname()[1], timeout=5, wait_for_workers=False,
                     token=TOKEN)
    store.close()
    t.join(5)
    sock.close()
    assert bytes(seen[:10]) == EXT_HANDSHAKE and struct.unpack("<I", seen[6:10])[0] == EXT_NONCE
    assert bytes(seen[10:]) == bytes([EXT_AUTH]) + hmac.new(TOKEN, CONTEXT + challenge,
                                                            "sha256").digest()
    assert TOKEN not in bytes(seen)


def test_rendezvous_store_hosting_uses_the_token(token_file):
    from fastelastic.rendezvous.fast._store_hosting import host_store

    token = read_token(token_file)
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    client, server = host_store("127.0.0.1", free, True, timedelta(seconds=5), token)
    try:
        assert server is not None and server.server.requires_token
        with pytest.raises(StoreConnectionError, match="requires a token"):
            TCPStore("127.0.0.1", free, timeout=5, wait_for_workers=False)
        peer, _ = host_store("127.0.0.1", free, False, timedelta(seconds=5), token)
        peer.set("k", "v")
        assert client.get("k") == b"v"
        peer.close()
    finally:
        server.shutdown_server()


def test_bad_token_files_are_clear_errors(tmp_path):
    with pytest.raises(StoreError, match="cannot read"):
        read_token(str(tmp_path / "missing"))
    short = tmp_path / "short"
    short.write_bytes(b"abc\n")
    with pytest.raises(StoreError, match="at least 16"):
        read_token(str(short))


@pytest.mark.torch
def test_torch_clients_are_refused_by_a_guarded_store(guarded, torch_dist):
    with pytest.raises(RuntimeError):   # DistNetworkError or DistStoreError
        s = torch_dist.TCPStore("127.0.0.1", guarded, is_master=False,
                                timeout=timedelta(seconds=3), wait_for_workers=False)
        s.set("forged", "1")
        s.get("forged")
    check = TCPStore("127.0.0.1", guarded, timeout=5, wait_for_workers=False, token=TOKEN)
    assert not check.check(["forged"])
    check.close()


def test_the_c10d_v2_backend_hosts_a_guarded_store_too(token_file):
    """torch's DynamicRendezvousHandler over the c10d backend (``c10d-v2``): its store takes
    the same ``token_file``, and refuses clients without it."""
    from fastelastic.rendezvous import RendezvousParameters
    from fastelastic.rendezvous.c10d_rendezvous_backend import create_backend

    with socket.create_server(("127.0.0.1", 0)) as s:
        free = s.getsockname()[1]
    params = RendezvousParameters("c10d", f"127.0.0.1:{free}", "guarded", 1, 1, is_host=True,
                                  token_file=token_file)
    backend, store = create_backend(params)
    try:
        assert backend.get_state() is None
        with pytest.raises(StoreConnectionError, match="requires a token"):
            TCPStore("127.0.0.1", free, timeout=5, wait_for_workers=False)
        peer, _ = create_backend(RendezvousParameters("c10d", f"127.0.0.1:{free}", "guarded",
                                                      1, 1, is_host=False,
                                                      token_file=token_file))
        peer.set_state(b"state-1")
        assert backend.get_state()[0] == b"state-1"
    finally:
        getattr(store, "shutdown_server", lambda: None)()
