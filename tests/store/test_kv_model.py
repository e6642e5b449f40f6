"""The server's key-value map against a dict, through the wire.

Random sequences of writes, deletes and reads over a small key space: the map grows from its
first 64 slots, keys collide and share probe runs, deletes shift entries back, values shrink
and grow in place or move. After every step the store must agree with the dict.
"""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastelastic.store import TCPStore

KEYS = [f"k{i}" for i in range(300)]
key = st.sampled_from(KEYS)
value = st.one_of(st.binary(max_size=40), st.binary(min_size=200, max_size=3000))
op = st.one_of(
    st.tuples(st.just("set"), key, value),
    st.tuples(st.just("append"), key, value),
    st.tuples(st.just("delete"), key),
    st.tuples(st.just("cas"), key, st.binary(max_size=4), value),
    st.tuples(st.just("add"), st.sampled_from(KEYS[:20]), st.integers(-5, 5)),
    st.tuples(st.just("multi_set"), st.lists(st.tuples(key, value), max_size=60)),
    st.tuples(st.just("get_all")),
)


@pytest.fixture(scope="module")
def server():
    master = TCPStore("127.0.0.1", 0, is_master=True, timeout=10)
    yield master
    master.shutdown_server()


def _check(c: TCPStore, model: dict[str, bytes]) -> None:
    assert c.num_keys() == len(model)
    assert sorted(c.list_keys()) == sorted(model)
    present = sorted(model)
    if present:
        assert c.multi_get(present) == [model[k] for k in present]
    for k in KEYS[:40]:
        assert c.check([k]) == (k in model)


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(op, min_size=1, max_size=120))
def test_map_agrees_with_a_dict(server, ops):
    with contextlib.closing(TCPStore("127.0.0.1", server.port, timeout=10)) as c:
        for k in c.list_keys():
            c.delete_key(k)
        model: dict[str, bytes] = {}
        for o in ops:
            kind = o[0]
            if kind == "set":
                c.set(o[1], o[2])
                model[o[1]] = o[2]
            elif kind == "append":
                c.append(o[1], o[2])
                model[o[1]] = model.get(o[1], b"") + o[2]
            elif kind == "delete":
                assert c.delete_key(o[1]) == (o[1] in model)
                model.pop(o[1], None)
            elif kind == "cas":
                _, k, expected, desired = o
                got = c.compare_set(k, expected, desired)
                if (k not in model and expected == b"") or model.get(k) == expected:
                    model[k] = desired
                    assert got == desired
                else:
                    assert got == model.get(k, expected)
            elif kind == "add":
                _, k, delta = o
                try:
                    old = int(model.get(k, b"0"))
                except ValueError:
                    continue  # the server would close the connection; covered elsewhere
                assert c.add(k, delta) == old + delta
                model[k] = str(old + delta).encode()
            elif kind == "multi_set":
                pairs = o[1]
                c.multi_set([k for k, _ in pairs], [v for _, v in pairs])
                model.update(dict(pairs))  # the last write of a repeated key wins
            else:
                _check(c, model)
        _check(c, model)


def test_many_keys_then_delete_every_other(server):
    """Deletes across long probe runs leave every survivor reachable."""
    with contextlib.closing(TCPStore("127.0.0.1", server.port, timeout=30)) as c:
        for k in c.list_keys():
            c.delete_key(k)
        keys = [f"bulk/{i}" for i in range(20_000)]
        c.multi_set(keys, [str(i).encode() for i in range(len(keys))])
        assert c.num_keys() == len(keys)
        for k in keys[::2]:
            assert c.delete_key(k)
        assert c.num_keys() == len(keys) // 2
        assert c.multi_get(keys[1::2]) == [str(i).encode() for i in range(1, len(keys), 2)]
        assert not any(c.check([k]) for k in keys[:2000:2])
        c.multi_set(keys[::2], [b"again"] * (len(keys) // 2))
        assert c.multi_get(keys[:6]) == [b"again", b"1", b"again", b"3", b"again", b"5"]
