"""The rendezvous's sliced waits (``_store_ops``) on a real store: the same answers as one
long wait, and a frozen store host noticed within the reply deadline, not after the wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest

from fastelastic.errors import StoreConnectionError
from fastelastic.rendezvous.fast import _store_ops as ops
from fastelastic.store import TCPStore


@pytest.fixture
def client(server):
    c = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    yield c
    c.close()


@pytest.mark.parametrize("bounded", [0.0, 0.2])
def test_a_sliced_wait_sees_a_key_set_in_a_later_slice(server, client, bounded):
    setter = threading.Timer(0.5, lambda: server.set("k", b"v"))
    setter.start()
    try:
        assert ops.wait(client, ["k"], 10, bounded) is True
        assert ops.get(client, "k", 10, bounded) == b"v"
    finally:
        setter.cancel()


@pytest.mark.parametrize("bounded", [0.0, 0.2])
def test_a_sliced_wait_ends_after_its_own_time_not_a_slice(client, bounded):
    start = time.monotonic()
    assert ops.wait(client, ["never"], 0.7, bounded) is False
    assert ops.get(client, "never", 0.7, bounded) is None
    took = time.monotonic() - start
    assert 1.3 <= took < 5, took  # two waits of 0.7 s (the server times them to the ms)
    client.set("after", b"1")  # the connection is still in step
    assert client.get("after") == b"1"


def test_a_frozen_store_host_is_lost_within_the_reply_deadline(tmp_path):
    """A 60 s wait in 0.5 s slices, each reply due within 0.5 s: the host frozen (SIGSTOP),
    the wait fails within about two slices instead of sitting out its 60 s."""
    code = ("import sys, time; from datetime import timedelta; "
            "from fastelastic.store import TCPStore; "
            "s = TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False, "
            "timeout=timedelta(seconds=30)); print(s.port, flush=True); time.sleep(120)")
    host = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        c = TCPStore("127.0.0.1", port, timeout=timedelta(seconds=30))
        with ops.reply_deadline(c, 0.5, timedelta(seconds=30)) as store:
            assert store.timeout == timedelta(seconds=0.5)
            os.kill(host.pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(StoreConnectionError):
                ops.get(store, "never", 60, bounded=0.5)
            took = time.monotonic() - start
        assert took < 3, took
        assert c.timeout == timedelta(seconds=30)  # restored
        c.close()
    finally:
        os.kill(host.pid, signal.SIGCONT)
        host.kill()
        host.wait(10)


def test_every_typed_request_runs_on_a_real_store(server, client):
    from fastelastic.rendezvous.fast import _requests as rq

    assert ops.apply(client, rq.Add("n", 2)) == 2
    assert ops.apply(client, rq.Add("n", 0)) == 2
    ops.apply(client, rq.Set("a", b"1"))
    ops.apply(client, rq.Append("a", b"2"))
    ops.apply(client, rq.MultiSet(["b", "c"], [b"x", b"y"]))
    assert ops.apply(client, rq.MultiGet(["a", "b", "c"])) == [b"12", b"x", b"y"]
    assert ops.apply(client, rq.Check(["a", "c"])) is True
    assert ops.apply(client, rq.Check(["a", "nope"])) is False
    assert ops.apply(client, rq.Get("a", 0.05)) == b"12"
    assert ops.apply(client, rq.Get("nope", 0.05)) is None
    assert ops.apply(client, rq.Get("a", None)) == b"12"
    assert ops.apply(client, rq.Wait(["a", "b"], 0.05)) is True
    assert ops.apply(client, rq.Wait(["nope"], 0.05)) is False
    assert bytes(ops.apply(client, rq.CompareSet("d", "", b"v"))) == b"v"
    assert bytes(ops.apply(client, rq.CompareSet("d", b"other", b"w"))) == b"v"
    other = TCPStore("127.0.0.1", server.port, timeout=timedelta(seconds=10))
    ops.apply(other, rq.AppendOnDisconnect("e", b"1"))
    ops.apply(other, rq.OnDisconnect(["f", "g"], [b"2", b"3"]))
    assert not client.check(["e"])
    other.close()
    assert ops.wait(client, ["e", "f", "g"], 10)
    assert client.multi_get(["e", "f", "g"]) == [b"1", b"2", b"3"]


@pytest.mark.parametrize("op", [("add", "k", 1), "get", None])
def test_a_request_that_is_not_a_typed_op_is_a_type_error_naming_it(client, op):
    from fastelastic.rendezvous.fast import _requests as rq

    with pytest.raises(TypeError, match=r"not a rendezvous store request: .*" + type(op).__name__):
        ops.apply(client, op)
    with pytest.raises(TypeError, match="not a rendezvous store request"):
        ops.apply(client, rq.Beat("k"))  # the handler's own request, not the store's
