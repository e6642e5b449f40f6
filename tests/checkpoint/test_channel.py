"""The agent's channel spoken by hand (no torch): requests, refusals, the seal, the close."""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import threading

import pytest

from fastelastic.checkpoint import _format
from fastelastic.checkpoint._format import HEADER_SIZE, Header
from fastelastic.checkpoint._owner import COMMITTED, SEALED, SOCKET_ENV, MemoryOwner

KEY = b"s" * 32


class Client:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.connect(path)

    def call(self, **req) -> tuple[dict, int | None]:
        req.setdefault("local_rank", 0)
        self.sock.sendall(json.dumps(req).encode())
        msg, fds, _f, _a = socket.recv_fds(self.sock, 65536, 4)
        return json.loads(msg), (fds[0] if fds else None)

    def save(self, step: int, body: bytes, maps: dict[int, mmap.mmap], wait: bool = True,
             ) -> dict:
        data_off = _format.align(HEADER_SIZE + 2)
        total = data_off + len(body)
        mapped = [len(maps[i]) if i in maps else 0 for i in (0, 1)]
        reply, fd = self.call(op="reserve", step=step, nbytes=total, mapped=mapped)
        assert "error" not in reply, reply
        if fd is not None:
            maps[reply["slot"]] = mmap.mmap(fd, reply["capacity"])
            os.close(fd)
        mm = maps[reply["slot"]]
        mm[HEADER_SIZE:HEADER_SIZE + 2] = b"[]"
        mm[data_off:total] = body
        _format.pack_header(mm, Header(step, reply["gen"], 0, 0, 2, 0, data_off, len(body),
                                       total))
        got, _ = self.call(op="commit", slot=reply["slot"], gen=reply["gen"], wait=wait)
        return got


@pytest.fixture
def owner():
    o = MemoryOwner(token=KEY)
    yield o
    o.close()


def test_save_seal_and_restore_by_hand(owner: MemoryOwner) -> None:
    owner.start_round(1)
    c, maps = Client(owner.path), {}
    for step in (1, 2, 3):
        assert c.save(step, bytes([step]) * 5000, maps)["step"] == step
    owner.wait_sealed()
    states = sorted((s, st) for st, s, _g, _m in owner.buffers(0))
    assert states == [(2, SEALED), (3, SEALED)]  # two buffers: the oldest step was saved over
    # the seal is the MAC of the shard under the token, in its header
    (mm,) = [m for st, s, _g, m in owner.buffers(0) if s == 3]
    assert mm is not None
    h = _format.unpack_header(mm, len(mm))
    assert h.mac == _format.compute_mac(KEY, mm, h.total)
    owner.start_round(1)
    assert owner.restore_step() == 3
    reply, fd = Client(owner.path).call(op="restore")
    assert reply["step"] == 3 and fd is not None
    with mmap.mmap(fd, reply["capacity"]) as got:
        assert got[h.data_off:h.total] == bytes([3]) * 5000
    os.close(fd)


def test_bad_requests_get_an_error_and_lose_nothing(owner: MemoryOwner) -> None:
    owner.start_round(2)
    c, maps = Client(owner.path), {}
    assert c.save(1, b"a" * 100, maps, wait=False) == {"step": 1}
    assert "unknown checkpoint request" in c.call(op="explode")[0]["error"]
    assert "bad checkpoint request" in c.call(op="reserve")[0]["error"]
    assert "not one of this node's 2 ranks" in c.call(
        op="reserve", local_rank=5, step=1, nbytes=10, mapped=[0, 0])[0]["error"]
    assert "commit of a buffer it does not hold" in c.call(op="commit", slot=0, gen=99)[0]["error"]
    # a commit whose header does not say what was reserved is refused, and the shard is bad
    reply, _fd = c.call(op="reserve", step=2, nbytes=1000, mapped=[len(maps[0]), 0])
    if _fd is not None:
        os.close(_fd)
    got, _ = c.call(op="commit", slot=reply["slot"], gen=reply["gen"])
    assert "malformed shard" in got["error"]
    # rank 1 never saved: the wait for step 1 names it
    assert "local ranks [1] did not save step 1" in c.call(op="wait", step=1, timeout=0.2)[0][
        "error"]
    owner.wait_sealed()
    assert [(s, st) for st, s, _g, _m in owner.buffers(0) if st == SEALED] == [(1, SEALED)]


def test_no_common_step_restores_nothing(owner: MemoryOwner) -> None:
    owner.start_round(2)
    a, b = Client(owner.path), Client(owner.path)
    maps_a: dict[int, mmap.mmap] = {}
    a.save(1, b"x" * 10, maps_a, wait=False)
    a.save(2, b"x" * 10, maps_a, wait=False)
    a.save(3, b"x" * 10, maps_a, wait=False)  # rank 0 holds 2 and 3
    b.sock.sendall(json.dumps({"op": "reserve", "local_rank": 1, "step": 1, "nbytes": 500,
                               "mapped": [0, 0]}).encode())
    socket.recv_fds(b.sock, 65536, 4)  # rank 1 holds only half a step 1
    owner.start_round(2)
    assert owner.restore_step() is None
    assert Client(owner.path).call(op="restore")[0] == {"step": None}


def test_close_frees_the_buffers_and_the_channel(owner: MemoryOwner) -> None:
    owner.start_round(1)
    c, maps = Client(owner.path), {}
    c.save(1, b"y" * 10, maps)
    fds = {b.fd for b in owner._ranks[0]}  # noqa: SLF001 - what close must release
    assert all(fd >= 0 for fd in fds)
    owner.close()
    with pytest.raises(ConnectionRefusedError):  # the name is free again
        Client(owner.path)
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    assert c.sock.recv(10) == b""  # the agent hung up


FIND = "from fastelastic.checkpoint._owner import find_agent; print(repr(find_agent()))"


def _find(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", FIND], env=env, capture_output=True,
                          text=True, timeout=60)


def test_a_worker_finds_its_ancestors_channel_and_no_other(owner: MemoryOwner) -> None:
    env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    r = _find(env)  # a child of this process (as a worker is of its agent)
    assert r.returncode == 0 and r.stdout.strip() == repr(owner.path), r.stderr
    r = subprocess.run(["sh", "-c", f"{sys.executable} -c '{FIND}'"], env=env,
                       capture_output=True, text=True, timeout=60)  # a grandchild (a zygote's)
    assert r.returncode == 0 and r.stdout.strip() == repr(owner.path), r.stderr
    other = MemoryOwner(name="fastelastic-ckpt-1")  # a channel not of an ancestor's pid
    try:
        r = _find(dict(env, **{SOCKET_ENV: "@fastelastic-ckpt-1"}))  # named: taken
        assert r.returncode == 0 and r.stdout.strip() == repr(other.path), r.stderr
    finally:
        other.close()
    owner.close()
    r = _find(env)
    assert r.returncode == 1
    assert "run the script under fastrun" in r.stderr.strip().splitlines()[-1]
    r = _find(dict(env, **{SOCKET_ENV: "@nobody-here"}))
    assert "no checkpoint channel of this user" in r.stderr.strip().splitlines()[-1]


def test_a_second_owner_in_one_process_is_refused(owner: MemoryOwner) -> None:
    with pytest.raises(OSError):
        MemoryOwner()
    c = Client(owner.path)  # the first one still serves
    assert "unknown checkpoint request" in c.call(op="nothing")[0]["error"]


def _hold_the_seal_thread(monkeypatch, hashed: list[str]) -> threading.Event:
    """The agent's MACs as before, but the seal thread's wait for the returned gate; the name
    of every thread that computes one goes to ``hashed``."""
    from fastelastic.checkpoint import _owner

    gate = threading.Event()
    real = _format.compute_mac

    def held_seal(key, buf, total, pool=None, stop=None):
        hashed.append(threading.current_thread().name)
        if threading.current_thread().name == "fe-ckpt-seal":
            assert gate.wait(60)
        return real(key, buf, total, pool, stop)

    monkeypatch.setattr(_owner._format, "compute_mac", held_seal)
    return gate


def test_a_save_never_waits_for_the_seal_of_an_older_step(monkeypatch) -> None:
    """Saves back to back outrun the seals: the buffer a save reuses holds an older step whose
    seal is still due; the save drops that seal instead of waiting for it (the newest step
    keeps its own), and the seals run niced, behind training."""
    from fastelastic.checkpoint import _owner

    real = _format.compute_mac
    gate = _hold_the_seal_thread(monkeypatch, [])
    owner = MemoryOwner(token=KEY)
    try:
        (seal,) = [t for t in threading.enumerate() if t.name == "fe-ckpt-seal"]
        assert seal.native_id is not None
        assert os.getpriority(os.PRIO_PROCESS, seal.native_id) == min(
            19, os.getpriority(os.PRIO_PROCESS, 0) + _owner._SEAL_NICE)
        owner.start_round(1)
        c, maps = Client(owner.path), {}
        c.sock.settimeout(30)  # a save that waited for the held seal would time out here
        for step in (1, 2, 3):
            assert c.save(step, bytes([step]) * 5000, maps)["step"] == step
        assert sorted((s, st) for st, s, _g, _m in owner.buffers(0)) == [
            (2, COMMITTED), (3, COMMITTED)]
        gate.set()
        owner.wait_sealed(30)
        assert sorted((s, st) for st, s, _g, _m in owner.buffers(0)) == [
            (2, SEALED), (3, SEALED)]
        for _st, _s, _g, mm in owner.buffers(0):
            assert mm is not None
            h = _format.unpack_header(mm, len(mm))
            assert h.mac == real(KEY, mm, h.total)
        owner.start_round(1)
        assert owner.restore_step() == 3
    finally:
        gate.set()
        owner.close()


def test_the_round_seals_its_step_itself_when_the_seal_thread_lags(monkeypatch) -> None:
    """A crash right after a save: the niced seal thread has not sealed the newest step yet.
    The round's fix seals the shards it needs at the agent's priority (that seal is their
    check) and does not wait for the seal thread; the older step stays due for it."""
    real = _format.compute_mac
    hashed: list[str] = []
    gate = _hold_the_seal_thread(monkeypatch, hashed)
    owner = MemoryOwner(token=KEY)
    try:
        owner.start_round(1)
        c, maps = Client(owner.path), {}
        for step in (1, 2):
            assert c.save(step, bytes([step]) * 5000, maps)["step"] == step
        owner.start_round(1)  # the worker died
        assert owner.restore_step(timeout=30) == 2  # the seal thread is still held
        assert sorted((s, st) for st, s, _g, _m in owner.buffers(0)) == [
            (1, COMMITTED), (2, SEALED)]
        assert hashed.count("fe-ckpt-fix") == 1  # step 2 hashed once: its seal is its check
        reply, fd = Client(owner.path).call(op="restore")
        assert reply["step"] == 2 and fd is not None
        os.close(fd)
        (mm,) = [m for st, s, _g, m in owner.buffers(0) if s == 2]
        assert mm is not None
        h = _format.unpack_header(mm, len(mm))
        assert h.mac == real(KEY, mm, h.total)
        gate.set()
        owner.wait_sealed(30)
        assert [st for st, _s, _g, _m in owner.buffers(0)] == [SEALED, SEALED]
    finally:
        gate.set()
        owner.close()
