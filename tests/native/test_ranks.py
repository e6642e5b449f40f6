"""Native rank assignment agrees with a slow reference and with torch 2.13's agent."""

from __future__ import annotations

import json
import random
import threading
import types

import pytest

from fastelastic._native import ranks


def reference(layout: list[tuple[str, int]]) -> list[list[int]]:
    """Obviously-correct O(n^2) statement of torch's rule, agent by agent."""
    out = []
    total = sum(n for _, n in layout)
    for i, (role, _n) in enumerate(layout):
        base = sum(n for _, n in layout[:i])
        role_base = sum(n for r, n in layout[:i] if r == role)
        role_size = sum(n for r, n in layout if r == role)
        out.append([base, total, role_base, role_size])
    return out


def native(layout: list[tuple[str, int]]) -> list[list[int]]:
    infos = [ranks.encode_role_info(r, i, n) for i, (r, n) in enumerate(layout)]
    return [list(ranks.decode_assignment(v)) for v in ranks.assign_from_role_infos(infos)]


def torch_result(layout: list[tuple[str, int]]) -> list[list[int]]:
    """Runs torch's own ``_assign_worker_ranks`` for every agent on one in-memory store."""
    dist = pytest.importorskip("torch.distributed", reason="torch 2.13 is needed for this check")
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    store = dist.HashStore()
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def agent(i: int, role: str, n: int) -> None:
        spec = types.SimpleNamespace(role=role, local_world_size=n)
        try:
            ws = SimpleElasticAgent._assign_worker_ranks(None, store, i, len(layout), spec)
            w0 = ws[0]
            results[i] = [w0.global_rank, w0.world_size, w0.role_rank, w0.role_world_size]
            assert [w.global_rank for w in ws] == list(range(w0.global_rank, w0.global_rank + n))
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=agent, args=(i, r, n)) for i, (r, n) in enumerate(layout)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return [results[i] for i in range(len(layout))]


LAYOUTS = [
    [("trainer", 4)],
    [("trainer", 2), ("trainer", 2), ("trainer", 2)],
    [("trainer", 2), ("ps", 1), ("trainer", 3), ("ps", 2), ("eval", 1)],
    [("b", 1), ("a", 5), ("b", 2), ("a", 1)],
    [('é"role', 2), ("plain", 1), ('é"role', 3)],  # forces the json fallback
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_native_matches_reference_and_torch(layout):
    assert native(layout) == reference(layout)
    assert native(layout) == torch_result(layout)


def test_random_layouts_match_reference():
    rng = random.Random(1234)
    for _ in range(200):
        n = rng.randint(1, 40)
        layout = [(rng.choice(["a", "b", "c", "trainer"]), rng.randint(1, 9)) for _ in range(n)]
        assert native(layout) == reference(layout)


def test_random_layout_matches_torch():
    rng = random.Random(99)
    layout = [(rng.choice(["a", "b", "c"]), rng.randint(1, 8)) for _ in range(24)]
    assert native(layout) == torch_result(layout)


def test_encode_is_byte_identical_to_torch_serialize():
    for role in ["trainer", "é", 'q"uote', "back\\slash", ""]:
        expected = json.dumps({"role": role, "rank": 7, "local_world_size": 3}).encode()
        assert ranks.encode_role_info(role, 7, 3) == expected


def test_assignment_bytes_match_json_dumps():
    layout = [("x", 3), ("y", 1)]
    infos = [ranks.encode_role_info(r, i, n) for i, (r, n) in enumerate(layout)]
    out = ranks.assign_from_role_infos(infos)
    assert out == [json.dumps(v).encode() for v in reference(layout)]


def test_fallback_parser_accepts_other_json_layouts():
    info = json.dumps({"local_world_size": 2, "rank": 0, "role": "r"}, separators=(",", ":"))
    assert ranks.assign_from_role_infos([info.encode()]) == [b"[0, 2, 0, 2]"]
    assert ranks.decode_assignment(b"[ 1,2 , 3,4 ]") == (1, 2, 3, 4)


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"{",
        b'{"role": "r", "rank": 0}',
        b'{"role": 1, "rank": 0, "local_world_size": 1}',
        b'{"role": "r", "rank": 0, "local_world_size": 0}',
        b"[1, 2]",
    ],
)
def test_malformed_role_info_raises_clear_error(bad):
    with pytest.raises(ValueError, match="role info"):
        ranks.assign_from_role_infos([bad])


def test_non_bytes_role_info_raises_type_error():
    with pytest.raises(TypeError, match="must be bytes"):
        ranks.assign_from_role_infos(["text"])


@pytest.mark.parametrize("bad", [b"", b"[1, 2, 3]", b"[1, 2, 3, x]", b"{}", b"[1, 2, 3, 4.5]"])
def test_malformed_assignment_raises(bad):
    with pytest.raises(ValueError, match="rank assignment"):
        ranks.decode_assignment(bad)


def test_identical_fast_path_matches_slow_path():
    for gws in (1, 3, 8):
        for lws in (1, 4):
            slow = native([("trainer", lws)] * gws)
            fast = [list(ranks.identical_ranks(g, gws, lws)) for g in range(gws)]
            assert fast == slow


@pytest.mark.parametrize("args", [(0, 0, 1), (0, 1, 0), (2, 2, 1), (-1, 2, 1)])
def test_identical_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        ranks.identical_ranks(*args)


def test_empty_input():
    assert ranks.assign_from_role_infos([]) == []
