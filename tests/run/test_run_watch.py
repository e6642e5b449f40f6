"""The ZeroMQ event publisher, the watcher's job view, and the launcher's event tap."""

from __future__ import annotations

import json
import logging
import time

import pytest

zmq = pytest.importorskip("zmq", reason="!!! pyzmq (a fastelastic dependency) is not installed")

from run_testlib import free_port  # noqa: E402

from fastelastic.watch.publisher import EventPublisher, PublishingHandler, _describe  # noqa: E402
from fastelastic.watch.view import JobView, watch  # noqa: E402


def _msg(agent="h:1", **kw) -> bytes:
    return json.dumps({"v": 1, "kind": "status", "agent": agent, "seq": 1, **kw}).encode()


def test_view_folds_messages_and_ignores_bad_ones():
    v = JobView(stale_after=3.0)
    assert v.update(b"not json") is None
    assert v.update(b'{"no_agent": 1}') is None
    assert v.bad_messages == 2
    v.update(_msg("a:1", host="a", pid=1, group_rank=1, state="HEALTHY", world_size=4,
                  local_world_size=2, workers_alive=2, restarts=0, max_restarts=3, seq=5,
                  run_id="r", last_event="START rank 2"), now=100.0)
    v.update(_msg("b:2", host="b", pid=2, group_rank=0, state="INIT", seq=1), now=100.0)
    # an older (reordered) message does not roll the row back
    v.update(_msg("a:1", state="INIT", seq=4), now=100.5)
    assert v.rows["a:1"].fields["state"] == "HEALTHY"
    assert v.formed() == 1 and not v.all_done()
    text = v.render(now=101.0).splitlines()
    assert text[0].split()[:5] == ["NODE", "PID", "RUN", "GROUP", "STATE"]
    assert text[1].split()[:6] == ["b", "2", "-", "0", "INIT", "-"]  # group rank order
    assert text[2].split()[:8] == ["a", "1", "r", "1", "HEALTHY", "4", "0/3", "2/2"]
    assert text[-1] == "2 agent(s), 2 bad message(s)"
    # silence is shown, final states are not "silent"
    assert "(silent 10s)" in v.render(now=110.5)
    v.update(_msg("a:1", state="SUCCEEDED", seq=9), now=111.0)
    v.update(_msg("b:2", state="FAILED", seq=9), now=111.0)
    assert v.all_done() and "silent" not in v.render(now=200.0)


def test_describe_torch_events():
    ev = {"name": "torchelastic.worker.status.FAILED", "source": "WORKER",
          "metadata": {"global_rank": 3, "metadata": json.dumps({"exit_code": [1]})}}
    assert _describe(ev) == "FAILED rank 3 exit 1"
    rdzv = {"name": "fast_rendezvous.py:next_rendezvous", "node_state": "RUNNING",
            "message": "joined round 2"}
    assert _describe(rdzv) == "next_rendezvous: joined round 2"


def _sub(port: int):
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.setsockopt(zmq.LINGER, 0)
    s.bind(f"tcp://127.0.0.1:{port}")
    return ctx, s


def _recv_until(sock, pred, timeout=10.0) -> list[dict]:
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sock.poll(100):
            m = json.loads(sock.recv())
            got.append(m)
            if pred(m):
                return got
    raise AssertionError(f"condition not met in {timeout}s; got {got[-3:]}")


def test_publisher_sends_status_events_and_final_state():
    port = free_port()
    ctx, sub = _sub(port)
    state = {"state": "HEALTHY", "world_size": 4}
    pub = EventPublisher(f"tcp://127.0.0.1:{port}", status=lambda: dict(state), interval=0.05)
    try:
        _recv_until(sub, lambda m: m["kind"] == "status" and m["state"] == "HEALTHY")
        pub.publish_event(json.dumps({"name": "torchelastic.worker.status.START",
                                      "source": "WORKER", "metadata": {"global_rank": 2}}))
        got = _recv_until(sub, lambda m: m["kind"] == "event")
        ev = got[-1]
        assert ev["event"]["metadata"]["global_rank"] == 2
        assert ev["last_event"] == "START rank 2" and ev["world_size"] == 4
        assert ev["agent"].endswith(f":{ev['pid']}") or "#" in ev["agent"]
        pub.set_final(state="SUCCEEDED", workers_alive=0)
    finally:
        pub.close()
    last = _recv_until(sub, lambda m: m["state"] == "SUCCEEDED")[-1]
    assert last["workers_alive"] == 0
    seqs = [m["seq"] for m in [ev, last]]
    assert seqs == sorted(seqs)
    sub.close()
    ctx.term()


def test_publishing_handler_forwards_to_inner_destination():
    port = free_port()
    ctx, sub = _sub(port)
    seen: list[str] = []

    class Inner(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    pub = EventPublisher(f"tcp://127.0.0.1:{port}", interval=0.05)
    try:
        _recv_until(sub, lambda m: m["kind"] == "status")  # connected and subscribed
        h = PublishingHandler(pub, Inner())
        log = logging.getLogger("fe-test-publishing-handler")
        log.propagate = False
        log.addHandler(h)
        log.warning('{"name": "x-event"}')
        assert seen == ['{"name": "x-event"}']
        _recv_until(sub, lambda m: m["kind"] == "event" and m["event"]["name"] == "x-event")
        log.removeHandler(h)
    finally:
        pub.close()
        sub.close()
        ctx.term()


def test_watch_once_times_out_with_status_1(capsys):
    t0 = time.monotonic()
    rc = watch(f"tcp://127.0.0.1:{free_port()}", once=True, expect=1, timeout=0.3)
    assert rc == 1 and time.monotonic() - t0 < 5
    assert capsys.readouterr().out.strip().endswith("0 agent(s)")


def test_watch_address_in_use_is_clear():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(OSError, match="address already in use"):
            watch(f"tcp://127.0.0.1:{port}", once=True, timeout=0.2)


def test_status_changes_become_last_event_lines():
    from fastelastic.watch.publisher import _status_change

    base = {"state": "HEALTHY", "restarts": 0, "max_restarts": 2, "world_size": 4,
            "workers_alive": 2, "local_world_size": 2}
    assert _status_change({}, base) is None
    assert _status_change(base, dict(base)) is None
    assert _status_change(base, {**base, "restarts": 1, "state": "STOPPED"}) == "restart 1/2"
    assert _status_change(base, {**base, "world_size": 6}) == (
        "membership change: world size 4 -> 6")
    assert _status_change(base, {**base, "state": "FAILED"}) == "group failed"
    assert _status_change(base, {**base, "workers_alive": 1}) == "worker exited: 1/2 alive"


@pytest.mark.timeout(60)
def test_live_view_redraws_in_place_on_a_terminal():
    import os
    import pty
    import subprocess
    import sys

    port = free_port()
    master, slave = pty.openpty()
    p = subprocess.Popen(
        [sys.executable, "-m", "fastelastic", "watch", f"tcp://127.0.0.1:{port}", "--timeout",
         "30", "--refresh", "0.1", "--until-done"],
        stdout=slave, stderr=subprocess.PIPE, text=True,
    )
    os.close(slave)
    assert p.stderr is not None and p.stderr.readline().startswith("watching")
    state = {"state": "HEALTHY", "group_rank": 0, "world_size": 2}
    pub = EventPublisher(f"tcp://127.0.0.1:{port}", status=lambda: dict(state), interval=0.05)
    out = b""
    try:
        deadline = time.monotonic() + 20
        while (b"HEALTHY" not in out or out.count(b"\x1b[H\x1b[2J") < 2) and (
            time.monotonic() < deadline
        ):
            out += os.read(master, 65536)
        state["state"] = "SUCCEEDED"  # --until-done: the watcher ends by itself
        assert p.wait(timeout=20) == 0
    finally:
        pub.close()
        if p.poll() is None:
            p.kill()
        try:
            while True:
                chunk = os.read(master, 65536)
                if not chunk:
                    break
                out += chunk
        except OSError:
            pass  # EIO once the child's side is closed
        os.close(master)
    assert out.count(b"\x1b[H\x1b[2J") >= 2  # home + clear: redrawn in place, several times
    assert b"HEALTHY" in out and b"SUCCEEDED" in out


def test_failure_and_restart_stay_visible_over_routine_events():
    port = free_port()
    ctx, sub = _sub(port)
    state = {"state": "HEALTHY", "restarts": 0, "max_restarts": 2}
    pub = EventPublisher(f"tcp://127.0.0.1:{port}", status=lambda: dict(state), interval=0.05)
    try:
        _recv_until(sub, lambda m: m["kind"] == "status")
        pub.publish_event({"name": "fastelastic.worker.failed", "source": "AGENT",
                           "metadata": {"global_rank": 1, "exit_code": -9, "signal": "SIGKILL"}})
        _recv_until(sub, lambda m: m["last_event"] == "rank 1 failed: killed by SIGKILL")
        state.update(restarts=1)
        pub.publish_event({"name": "torchelastic.worker.status.START", "source": "WORKER",
                           "metadata": {"global_rank": 0}})
        got = _recv_until(sub, lambda m: m.get("restarts") == 1 and m["kind"] == "event")
        assert got[-1]["last_event"] == "restart 1/2 after rank 1 failed: killed by SIGKILL"
    finally:
        pub.close()
        sub.close()
        ctx.term()
