"""``fastelastic watch`` survives any message and never prints a control character from one."""

from __future__ import annotations

import io
import json
import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

zmq = pytest.importorskip("zmq", reason="!!! pyzmq (a fastelastic dependency) is not installed")

from run_testlib import free_port  # noqa: E402

from fastelastic.watch.view import JobView, printable, watch  # noqa: E402

HOSTILE = [
    b"[" * 100_000,                                   # RecursionError in json
    b"\xff\xfe not utf-8",
    b"[1, 2, 3]", b'"agent"', b"42", b"null", b"",
    b'{"agent": null}', b'{"agent": ["x"]}', b'{"agent": {"a": 1}}', b'{"agent": true}',
    json.dumps({"agent": "a:1", "seq": "9"}).encode(),           # seq of the wrong type
    json.dumps({"agent": "a:1", "seq": 10 ** 400}).encode(),     # huge int
    json.dumps({"agent": "a:1", "group_rank": "0", "pid": [1], "state": {"x": 1}}).encode(),
    b'{"agent": "a:1", "seq": NaN, "time": Infinity}',
    json.dumps({"agent": "x" * 100_000}).encode(),               # over MAX_MESSAGE
]
EVIL_TEXT = "\x1b[2J\x1b]0;pwned\x07\r\x08\x9b31m\u202eevil\u2066\x00"


def _has_controls(text: str) -> bool:
    return any(ord(c) < 0x20 and c != "\n" or 0x7F <= ord(c) < 0xA0 or c in "\u202e\u2066"
               for c in text)


def test_every_hostile_message_is_counted_not_fatal():
    v = JobView()
    for raw in HOSTILE:
        v.update(raw, now=1.0)
    assert v.bad_messages == len(HOSTILE)
    row = v.rows["a:1"]   # the well-formed parts of the mixed messages were kept
    assert "seq" not in row.fields and "group_rank" not in row.fields
    assert v.render(now=2.0).splitlines()[-1].endswith(f"{len(HOSTILE)} bad message(s)")


def test_control_characters_are_replaced():
    v = JobView()
    v.update(json.dumps({"agent": "h:1", "host": EVIL_TEXT, "state": EVIL_TEXT,
                         "last_event": EVIL_TEXT, "run_id": EVIL_TEXT, "seq": 1}).encode(),
             now=1.0)
    text = v.render(now=1.0)
    assert not _has_controls(text), repr(text)
    assert "evil" in text and "\ufffd" in text
    assert printable("plain text, ünïcode") == "plain text, ünïcode"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["agent", "seq", "state", "host", "group_rank",
                                       "world_size", "kind", "pid", "x"]), children,
                      max_size=6),
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json_is_safe(value):
    v = JobView()
    v.update(json.dumps(value).encode(), now=1.0)
    v.update(json.dumps({"agent": "ok", "seq": 1, "state": "INIT"}).encode(), now=1.0)
    text = v.render(now=5.0)
    assert not _has_controls(text)
    v.formed()
    v.all_done()


def test_watch_keeps_running_through_hostile_messages():
    port = free_port()
    endpoint = f"tcp://127.0.0.1:{port}"
    out = io.StringIO()
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(
        watch(endpoint, once=True, expect=1, timeout=30, out=out)))
    t.start()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)  # tells when the watcher's subscription arrived
    pub.setsockopt(zmq.LINGER, 0)
    try:
        pub.connect(endpoint)
        # a PUB drops what it sends before the subscription arrives: wait for it, then send
        # the hostile messages and, after them, the one good status (which ends the watch)
        # (an oversized message may end the connection: resend, bounded, until it is done)
        assert pub.poll(30_000), "the watcher never subscribed"
        pub.recv()
        for _ in range(600):
            for raw in HOSTILE[:-1]:
                pub.send(raw)
            pub.send(json.dumps({"agent": "n:1", "host": EVIL_TEXT, "state": "HEALTHY",
                                 "world_size": 2, "seq": 1}).encode())
            t.join(0.05)
            if not t.is_alive():
                break
        assert not t.is_alive(), "watch did not finish"
    finally:
        pub.close()
        ctx.term()
    assert rc == [0]
    text = out.getvalue()
    assert "HEALTHY" in text and "bad message(s)" in text
    assert not _has_controls(text), repr(text)
