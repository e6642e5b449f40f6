"""Tests for the rendezvous API types, parameter parsing and the handler registry."""

from __future__ import annotations

import pytest

from fastelastic import errors
from fastelastic import rendezvous as rdzv
from fastelastic.rendezvous.utils import (
    _parse_rendezvous_config,
    parse_rendezvous_endpoint,
)


class _DictStore:
    """Minimal in-memory store for RendezvousStoreInfo.build (set/get only)."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.data[key] = value

    def get(self, key: str) -> bytes:
        return self.data[key]


class _Handler(rdzv.RendezvousHandler):
    def __init__(self, name: str) -> None:
        self.name = name

    def get_backend(self) -> str:
        return self.name

    def next_rendezvous(self) -> rdzv.RendezvousInfo:
        return rdzv.RendezvousInfo(None, 0, 1, rdzv.RendezvousStoreInfo("h", 1))

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        return None

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return "r"

    def shutdown(self) -> bool:
        return True


def _params(**kw):
    return rdzv.RendezvousParameters("b", "localhost:1", "run", 1, 2, **kw)


def test_error_family_is_shared_with_errors_module():
    assert rdzv.RendezvousClosedError is errors.RendezvousClosedError
    assert issubclass(rdzv.RendezvousTimeoutError, rdzv.RendezvousError)
    assert issubclass(rdzv.RendezvousGracefulExitError, errors.FastElasticError)


@pytest.mark.parametrize(
    ("raw", "expected"),
    [("1", True), ("TRUE", True), ("y", True), ("No", False), ("0", False), (1, True),
     (0, False), (True, True), (None, None)],
)
def test_get_as_bool(raw, expected):
    assert _params(k=raw).get_as_bool("k") is expected


@pytest.mark.parametrize("raw", ["maybe", 2, "", 1.5])
def test_get_as_bool_rejects(raw):
    with pytest.raises(ValueError, match="'k' does not represent a valid boolean"):
        _params(k=raw).get_as_bool("k")


def test_get_as_int_and_defaults():
    p = _params(n="42")
    assert p.get_as_int("n") == 42
    assert p.get_as_int("missing", 7) == 7
    assert p.get_as_int("missing") is None
    assert p.get("missing", "d") == "d"
    assert p.get_as_bool("missing", True) is True
    with pytest.raises(ValueError, match="valid integer"):
        _params(n="x").get_as_int("n")


def test_parameters_validation():
    with pytest.raises(ValueError, match="non-empty"):
        rdzv.RendezvousParameters("", "e", "r", 1, 1)
    with pytest.raises(ValueError, match="greater than zero"):
        rdzv.RendezvousParameters("b", "e", "r", 0, 1)
    with pytest.raises(ValueError, match="greater than or equal"):
        rdzv.RendezvousParameters("b", "e", "r", 3, 2)
    p = rdzv.RendezvousParameters("b", "e", "r", 1, 2, local_addr="a", x=1)
    assert (p.backend, p.endpoint, p.run_id, p.min_nodes, p.max_nodes, p.local_addr, p.config) == (
        "b", "e", "r", 1, 2, "a", {"x": 1})


def test_store_info_build_rank0_publishes_others_read():
    store = _DictStore()
    info0 = rdzv.RendezvousStoreInfo.build(0, store, "10.1.2.3", server_port=4242)
    assert info0 == rdzv.RendezvousStoreInfo("10.1.2.3", 4242)
    info1 = rdzv.RendezvousStoreInfo.build(1, store, "ignored")
    assert info1 == info0
    fresh = _DictStore()
    info_free = rdzv.RendezvousStoreInfo.build(0, fresh, "a")
    assert 0 < info_free.master_port < 65536


def test_registry_register_create_and_conflicts():
    reg = rdzv.RendezvousHandlerRegistry()

    def creator(params):
        return _Handler(params.backend)

    reg.register("b", creator)
    reg.register("b", creator)  # same creator again is fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("b", lambda p: _Handler("b"))
    with pytest.raises(ValueError, match="non-empty"):
        reg.register("", creator)
    handler = reg.create_handler(_params())
    assert handler.get_backend() == "b" and handler.use_agent_store is False
    with pytest.raises(ValueError, match="not registered"):
        reg.create_handler(rdzv.RendezvousParameters("nope", "", "r", 1, 1))
    reg.register("liar", lambda p: _Handler("other"))
    with pytest.raises(RuntimeError, match="does not match"):
        reg.create_handler(rdzv.RendezvousParameters("liar", "", "r", 1, 1))


def test_default_registry_names():
    for name in ("static", "c10d", "fastelastic", "etcd", "etcd-v2", "c10d-v2"):
        assert name in rdzv.rendezvous_handler_registry._registry


def test_handler_is_abstract():
    with pytest.raises(TypeError):
        rdzv.RendezvousHandler()  # type: ignore[abstract]


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [("", ("localhost", 29400)), ("host", ("host", 29400)), ("h.x:12", ("h.x", 12)),
     ("[::1]:5", ("::1", 5)), ("[::1]", ("::1", 29400)), ("1.2.3.4:0", ("1.2.3.4", 0))],
)
def test_parse_endpoint(endpoint, expected):
    assert parse_rendezvous_endpoint(endpoint, 29400) == expected


@pytest.mark.parametrize("endpoint", ["h:70000", "h:x", "bad host:1"])
def test_parse_endpoint_rejects(endpoint):
    with pytest.raises(ValueError):
        parse_rendezvous_endpoint(endpoint, 1)


def test_parse_config():
    assert _parse_rendezvous_config(" a=1, b = x=y ") == {"a": "1", "b": "x=y"}
    assert _parse_rendezvous_config("") == {}
    with pytest.raises(ValueError, match="must have a value"):
        _parse_rendezvous_config("a=")
    with pytest.raises(ValueError, match="format"):
        _parse_rendezvous_config("=1")


@pytest.mark.parametrize("store_type", ["tcp", "file"])
def test_c10d_v2_handler_answers_to_its_name(tmp_path, store_type):
    """``c10d-v2`` (torch's dynamic rendezvous over our backend) passes the registry's check."""
    from fastelastic.rendezvous import RendezvousParameters, get_rendezvous_handler

    endpoint = str(tmp_path / "rdzv") if store_type == "file" else "127.0.0.1:0"
    params = RendezvousParameters("c10d-v2", endpoint, "v2name", 1, 1, is_host="true",
                                  store_type=store_type)
    handler = get_rendezvous_handler(params)
    try:
        assert handler.get_backend() == "c10d-v2"
    finally:
        handler.shutdown()


def test_each_rendezvous_module_logs_under_a_child_of_fast_rendezvous_logger():
    """A logger per module (their records tell where they come from), each a child of the
    name they all used before, so users' logging configs for that name keep working."""
    import importlib
    import logging

    parent = "fastelastic.rendezvous.fast_rendezvous"
    names = set()
    for mod in ("fast.failover._failover", "fast._liveness", "fast._round", "fast._store_hosting",
                "fast._worker_store"):
        log = importlib.import_module(f"fastelastic.rendezvous.{mod}").log
        assert log.name.startswith(parent + "."), log.name
        assert log.parent is logging.getLogger(parent) and log.propagate
        names.add(log.name)
    assert len(names) == 5
