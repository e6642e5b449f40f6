"""The server, byte for byte, against the protocol note (raw sockets, no client library)."""

from __future__ import annotations

import struct

import pytest

from ._wire import (
    ADD,
    APPEND,
    BARRIER,
    CANCEL_WAIT,
    CHECK,
    COMPARE_SET,
    DELETE_KEY,
    GET,
    GETNUMKEYS,
    HANDSHAKE,
    LIST_KEYS,
    MAGIC,
    MULTI_GET,
    MULTI_SET,
    PING,
    QUEUE_LEN,
    QUEUE_POP,
    QUEUE_PUSH,
    SET,
    VALIDATE,
    WAIT,
    blob,
    req,
    u64,
)
from .conftest import wait_until


def set_(k, v):
    return req(SET, blob(k), blob(v))


def get(c, k):
    c.send(req(GET, blob(k)))
    return c.recv_blob()


def add(c, k, d):
    c.send(req(ADD, blob(k), u64(d)))
    return c.recv_i64()


def test_handshake_echoes_nonce_and_validate_gets_no_reply(raw):
    c = raw(handshake=False)
    c.send(struct.pack("<BI", VALIDATE, MAGIC))
    assert c.nothing_pending()
    c.send(struct.pack("<BI", PING, 123456))
    assert c.recv(4) == struct.pack("<I", 123456)


@pytest.mark.parametrize("first", [
    struct.pack("<BI", VALIDATE, 0xDEADBEEF),        # wrong magic
    req(GETNUMKEYS),                                 # not VALIDATE first
])
def test_bad_first_message_closes(raw, first):
    c = raw(handshake=False)
    c.send(first)
    assert c.is_closed_by_peer()


def test_second_validate_closes(raw):
    c = raw()
    c.send(struct.pack("<BI", VALIDATE, MAGIC))
    assert c.is_closed_by_peer()


def test_split_and_coalesced_requests(raw):
    c = raw(handshake=False)
    stream = (HANDSHAKE + set_("/a", "1" * 1000) + req(GET, blob("/a"))
              + req(ADD, blob("/n"), u64(5)))
    for i in range(len(stream)):      # one byte per segment
        c.send(stream[i:i + 1])
    assert c.recv(4) == HANDSHAKE[6:]
    assert c.recv_blob() == b"1" * 1000
    assert c.recv_i64() == 5
    d = raw()
    d.send(set_("/x", "1") + set_("/y", "2") + req(MULTI_GET, u64(2), blob("/x"), blob("/y")))
    assert [d.recv_blob(), d.recv_blob()] == [b"1", b"2"]


def test_fire_and_forget_commands_get_no_reply(raw):
    c = raw()
    c.send(set_("/a", "1") + req(APPEND, blob("/a"), blob("2"))
           + req(MULTI_SET, u64(1), blob("/m"), blob("v")) + req(QUEUE_PUSH, blob("q"), blob("i")))
    assert c.nothing_pending()
    assert get(c, "/a") == b"12"
    assert get(c, "/m") == b"v"


def test_get_missing_replies_empty_blob(raw):
    c = raw()
    assert get(c, "/missing") == b""
    c.send(req(MULTI_GET, u64(2), blob("/missing"), blob("/missing")))
    assert [c.recv_blob(), c.recv_blob()] == [b"", b""]


def test_binary_keys_and_values(raw):
    c = raw()
    key = b"/k\x00\xff"
    val = bytes(range(256)) * 3
    c.send(req(SET, blob(key), blob(val)))
    assert get(c, key) == val
    c.send(req(SET, blob("/empty"), blob(b"")))
    c.send(req(CHECK, u64(1), blob("/empty")))
    assert c.recv_u8() == 0


@pytest.mark.parametrize("stored,delta,result", [
    (None, 0, 0), (None, 7, 7), ("12abc", 1, 13), (" 7", 1, 8), ("-2", -1, -3), ("+4", 1, 5),
    (str(2**63 - 1), 1, -2**63), (str(-2**63), -1, 2**63 - 1),
])
def test_add_parsing_and_wrap(raw, stored, delta, result):
    c = raw()
    if stored is not None:
        c.send(set_("/n", stored))
    assert add(c, "/n", delta) == result
    assert get(c, "/n") == str(result).encode()


@pytest.mark.parametrize("stored", ["", "abc", "99999999999999999999", "-"])
def test_add_on_unparseable_value_closes_only_that_client(raw, stored):
    c, other = raw(), raw()
    other.send(set_("/n", stored))
    assert get(other, "/n") == stored.encode()
    c.send(req(ADD, blob("/n"), u64(1)))
    assert c.is_closed_by_peer()
    assert get(other, "/n") == stored.encode()      # unchanged, server alive


def test_compare_set_four_cases(raw):
    c = raw()
    c.send(req(COMPARE_SET, blob("/k"), blob(""), blob("new")))       # missing, expected empty
    assert c.recv_blob() == b"new" and get(c, "/k") == b"new"
    c.send(req(COMPARE_SET, blob("/m"), blob("exp"), blob("des")))    # missing, expected set
    assert c.recv_blob() == b"exp"
    c.send(req(CHECK, u64(1), blob("/m")))
    assert c.recv_u8() == 1                                          # nothing created
    c.send(req(COMPARE_SET, blob("/k"), blob("new"), blob("v2")))    # present and equal
    assert c.recv_blob() == b"v2"
    c.send(req(COMPARE_SET, blob("/k"), blob("zzz"), blob("v3")))    # present, different
    assert c.recv_blob() == b"v2" and get(c, "/k") == b"v2"
    c.send(set_("/e", ""))
    c.send(req(COMPARE_SET, blob("/e"), blob(""), blob("filled")))   # existing empty matches
    assert c.recv_blob() == b"filled"


def test_check_numkeys_delete_listkeys(raw):
    c = raw()
    c.send(req(CHECK, u64(0)))
    assert c.recv_u8() == 0
    c.send(set_("/a", "1") + set_("/b", "2"))
    add(c, "init/", 1)
    c.send(req(CHECK, u64(2), blob("/a"), blob("/b")))
    assert c.recv_u8() == 0
    c.send(req(CHECK, u64(2), blob("/a"), blob("/zz")))
    assert c.recv_u8() == 1
    c.send(req(GETNUMKEYS))
    assert c.recv_i64() == 3
    c.send(req(LIST_KEYS))
    n = c.recv_i64()
    assert sorted(c.recv_blob() for _ in range(n)) == [b"/a", b"/b", b"init/"]
    c.send(req(DELETE_KEY, blob("/a")))
    assert c.recv_i64() == 1
    c.send(req(DELETE_KEY, blob("/a")))
    assert c.recv_i64() == 0


def test_wait_immediate_and_deferred(raw, master):
    waiter, writer = raw(), raw()
    waiter.send(req(WAIT, u64(0)))
    assert waiter.recv_u8() == 0
    writer.send(set_("/here", "1"))
    assert get(writer, "/here") == b"1"
    waiter.send(req(WAIT, u64(1), blob("/here")))
    assert waiter.recv_u8() == 0
    waiter.send(req(WAIT, u64(3), blob("/w1"), blob("/w2"), blob("/w1")))
    wait_until(lambda: master.server.waiting == 1, what="the wait registered")
    writer.send(set_("/w1", "x"))
    assert get(writer, "/w1") == b"x"
    assert waiter.nothing_pending()
    writer.send(req(APPEND, blob("/w2"), blob("y")))
    assert waiter.recv_u8() == 0


@pytest.mark.parametrize("wake", ["set", "add", "append", "multi_set", "compare_set", "barrier"])
def test_every_write_kind_wakes_waiters(raw, master, wake):
    waiters = [raw() for _ in range(3)]
    writer = raw()
    for w in waiters:
        w.send(req(WAIT, u64(1), blob("/k")))
    wait_until(lambda: master.server.waiting == 3, what="three waits registered")
    writer.send({
        "set": set_("/k", "1"),
        "add": req(ADD, blob("/k"), u64(1)),
        "append": req(APPEND, blob("/k"), blob("1")),
        "multi_set": req(MULTI_SET, u64(1), blob("/k"), blob("1")),
        "compare_set": req(COMPARE_SET, blob("/k"), blob(""), blob("1")),
        "barrier": req(BARRIER, blob("/k"), u64(1)),
    }[wake])
    for w in waiters:
        assert w.recv_u8() == 0


def test_delete_wakes_nobody(raw, master):
    waiter, writer = raw(), raw()
    waiter.send(req(WAIT, u64(1), blob("/k")))
    wait_until(lambda: master.server.waiting == 1, what="the wait registered")
    writer.send(req(DELETE_KEY, blob("/k")))
    assert writer.recv_i64() == 0
    assert waiter.nothing_pending()


def test_cancel_wait_then_no_late_wakeup(raw, master):
    waiter, writer = raw(), raw()
    waiter.send(req(CANCEL_WAIT))                     # answered even with nothing pending
    assert waiter.recv_u8() == 1
    waiter.send(req(WAIT, u64(1), blob("/k")))
    waiter.send(req(CANCEL_WAIT))
    assert waiter.recv_u8() == 1
    assert master.server.waiting == 0
    writer.send(set_("/k", "1"))
    assert get(writer, "/k") == b"1"
    assert waiter.nothing_pending()
    assert get(waiter, "/k") == b"1"                  # connection still in step


def test_waiter_disconnect_then_write_is_harmless(raw, master):
    for _ in range(50):
        w = raw()
        w.send(req(WAIT, u64(1), blob("/gone")))
        w.close()
    wait_until(lambda: master.server.num_connections == 1 and master.server.waiting == 0,
               what="the 50 waiters to be gone")
    writer = raw()
    writer.send(set_("/gone", "1"))
    assert get(writer, "/gone") == b"1"
    assert master.server.protocol_errors == 0


def test_queue_semantics(raw, master):
    c, consumer1, consumer2, producer = raw(), raw(), raw(), raw()
    c.send(req(QUEUE_POP, blob("q")))
    assert c.recv_i64() == 0
    c.send(req(QUEUE_LEN, blob("nope")))
    assert c.recv_i64() == 0
    c.send(req(QUEUE_PUSH, blob("q"), blob("a")) + req(QUEUE_PUSH, blob("q"), blob("b")))
    c.send(req(QUEUE_LEN, blob("q")))
    assert c.recv_i64() == 2
    c.send(req(CHECK, u64(1), blob("q")))              # a non-empty queue counts as present
    assert c.recv_u8() == 0
    c.send(req(GETNUMKEYS))
    assert c.recv_i64() == 0                           # queues are not keys
    c.send(req(QUEUE_POP, blob("q")))
    assert c.recv_i64() == 2 and c.recv_blob() == b"a"
    c.send(req(QUEUE_POP, blob("q")))
    assert c.recv_i64() == 1 and c.recv_blob() == b"b"
    # one push releases exactly one blocked consumer
    consumer1.send(req(WAIT, u64(1), blob("q2")))
    consumer2.send(req(WAIT, u64(1), blob("q2")))
    wait_until(lambda: master.server.waiting == 2, what="both consumers waiting")
    producer.send(req(QUEUE_PUSH, blob("q2"), blob("x")))
    got = []
    for cons in (consumer1, consumer2):
        got.append(not cons.nothing_pending(0.3))
    assert sorted(got) == [False, True]


def test_barrier_counts_and_survives_timeout(raw, master):
    a, b, c = raw(), raw(), raw()
    a.send(req(BARRIER, blob("/bar"), u64(3)))
    b.send(req(BARRIER, blob("/bar"), u64(3)))
    wait_until(lambda: master.server.waiting == 2, what="two barrier arrivals")
    assert get(c, "/bar") == b"2" and a.nothing_pending()
    b.send(req(CANCEL_WAIT))                           # b times out; its arrival still counts
    assert b.recv_u8() == 1
    c.send(req(BARRIER, blob("/bar"), u64(3)))
    assert c.recv_u8() == 0
    assert a.recv_u8() == 0
    assert b.nothing_pending()


@pytest.mark.parametrize("payload", [
    req(0x7F),                                                     # unknown command
    req(GET, u64(8193), b"k" * 8193),                              # key over the limit
    req(SET, blob("/k"), u64(8 * 1024 * 1024 + 1)),                # value over the limit
    req(MULTI_GET, u64(131073)),                                   # too many keys
    req(MULTI_SET, u64(2**63)),                                    # negative count as i64
])
def test_bad_frames_close_only_that_connection(raw, master, payload):
    bad, good = raw(), raw()
    good.send(set_("/keep", "v"))
    bad.send(payload)
    assert bad.is_closed_by_peer()
    assert get(good, "/keep") == b"v"
    assert master.server.protocol_errors >= 1


def test_limits_are_inclusive(raw):
    c = raw()
    key = b"/" + b"k" * 8191
    val = b"v" * (8 * 1024 * 1024)
    c.send(req(SET, blob(key), blob(val)))
    assert get(c, key) == val


def test_ext_capability_ping_and_wait_get(raw, master):
    c, writer = raw(handshake=False), raw()
    ext_nonce = 0x7E57FA57
    c.send(struct.pack("<BIBI", 0, 0x3C85F7CE, PING, ext_nonce))
    assert c.recv(4) == struct.pack("<I", ~ext_nonce & 0xFFFFFFFF)   # our server answers
    writer.send(set_("/here", "v"))
    assert get(writer, "/here") == b"v"
    c.send(req(0x40, blob("/here")))                      # EXT_WAIT_GET, key present
    assert c.recv_u8() == 2 and c.recv_blob() == b"v"
    c.send(req(0x40, blob("/later")))                     # key missing: answered when set
    wait_until(lambda: master.server.waiting == 1, what="the wait_get registered")
    writer.send(set_("/later", "w"))
    assert c.recv_u8() == 2 and c.recv_blob() == b"w"
    c.send(req(0x40, blob("/never")) + req(CANCEL_WAIT))
    assert c.recv_u8() == 1 and c.nothing_pending()
    writer.send(set_("/never", "x"))
    assert get(writer, "/never") == b"x" and c.nothing_pending()


def test_ext_on_disconnect_append(raw, master):
    c, observer = raw(ext=True), raw()
    c.send(req(0x42, blob("/dead"), blob("n1;")))
    assert c.recv_u8() == 0
    observer.send(req(WAIT, u64(1), blob("/dead")))
    wait_until(lambda: master.server.waiting == 1, what="the observer waiting")
    c.close()
    assert observer.recv_u8() == 0
    assert get(observer, "/dead") == b"n1;"
