"""``fastelastic.utils`` against ``torch.distributed.elastic.utils``: same names, same results."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta

import pytest

from fastelastic.errors import StoreTimeoutError
from fastelastic.store import TCPStore
from fastelastic.utils import get_env_variable_or_raise, macros
from fastelastic.utils.data import CyclingIterator
from fastelastic.utils.distributed import create_c10d_store, get_free_port, get_socket_with_port
from fastelastic.utils.logging import get_logger
from fastelastic.utils.store import barrier, get_all, store_timeout, synchronize


def _torch_utils():
    try:
        import torch.distributed.elastic.utils as tu
        import torch.distributed.elastic.utils.data  # noqa: F401
        import torch.distributed.elastic.utils.distributed  # noqa: F401
        import torch.distributed.elastic.utils.logging  # noqa: F401
        import torch.distributed.elastic.utils.store  # noqa: F401
    except ImportError as e:
        pytest.skip(f"!!! torch 2.13 is not importable ({e}); the comparison did not run")
    return tu


@pytest.fixture
def master():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=30)
    yield s
    s.shutdown_server()


def _clients(master, n):
    return [TCPStore("127.0.0.1", master.port, wait_for_workers=False, timeout=30)
            for _ in range(n)]


def test_importing_utils_never_imports_torch():
    code = textwrap.dedent(
        """
        import sys
        import fastelastic.utils, fastelastic.utils.data, fastelastic.utils.store
        import fastelastic.utils.distributed, fastelastic.utils.logging
        assert "torch" not in sys.modules, "fastelastic.utils imported torch"
        print(list(fastelastic.utils.data.CyclingIterator(2, lambda e: iter([e]))))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 1]"


def test_free_ports_are_bindable():
    sock = get_socket_with_port()
    try:
        host, port = sock.getsockname()[:2]
        assert port > 0 and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    finally:
        sock.close()
    port = get_free_port()
    with socket.socket() as s:
        s.bind(("localhost", port))  # free a moment ago, and still free
    s = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    s.shutdown_server()


@pytest.mark.torch
def test_api_helpers_match_torch(monkeypatch):
    tu = _torch_utils()
    args = ["--rank=${local_rank}", 3, "${other}", "x${local_rank}y"]
    assert macros.substitute(args, "7") == tu.macros.substitute(args, "7")
    assert macros.local_rank == tu.macros.local_rank
    monkeypatch.setenv("FE_TEST_VAR", "v")
    assert get_env_variable_or_raise("FE_TEST_VAR") == tu.get_env_variable_or_raise("FE_TEST_VAR")
    monkeypatch.delenv("FE_TEST_VAR")
    with pytest.raises(ValueError) as ours:
        get_env_variable_or_raise("FE_TEST_VAR")
    with pytest.raises(ValueError) as theirs:
        tu.get_env_variable_or_raise("FE_TEST_VAR")
    assert str(ours.value) == str(theirs.value)


@pytest.mark.torch
def test_get_logger_matches_torch(monkeypatch):
    tu = _torch_utils()
    monkeypatch.delenv("LOGLEVEL", raising=False)
    ours, theirs = get_logger(), tu.logging.get_logger()
    assert ours.name == theirs.name == __name__
    assert ours.level == theirs.level == logging.WARNING
    monkeypatch.setenv("LOGLEVEL", "DEBUG")
    assert get_logger("fe.x").level == tu.logging.get_logger("fe.y").level == logging.DEBUG


@pytest.mark.torch
@pytest.mark.parametrize("n,start", [(1, 0), (3, 0), (3, 2), (2, 5)])
def test_cycling_iterator_matches_torch(n, start):
    tu = _torch_utils()

    def gen(epoch):
        return iter([f"{epoch}-{i}" for i in range(epoch % 3)])  # some epochs are empty

    assert list(CyclingIterator(n, gen, start)) == list(tu.data.CyclingIterator(n, gen, start))


@pytest.mark.torch
@pytest.mark.parametrize(
    "size,replicas,start,epoch",
    [(10, 1, 0, 0), (10, 3, 0, 1), (101, 4, 17, 5), (8, 8, 0, 2), (1000, 7, 999, 3)],
)
def test_elastic_sampler_matches_torch(size, replicas, start, epoch):
    tu = _torch_utils()
    from fastelastic.utils.data import ElasticDistributedSampler

    dataset = list(range(size))
    for rank in range(replicas):
        theirs = tu.data.ElasticDistributedSampler(dataset, replicas, rank, start)
        ours = ElasticDistributedSampler(dataset, replicas, rank, start)
        theirs.set_epoch(epoch)
        ours.set_epoch(epoch)
        assert isinstance(ours, sys.modules["torch.utils.data"].DistributedSampler)
        assert len(ours) == len(theirs)
        try:
            expected = list(theirs)
        except AssertionError:  # torch cannot pad when more ranks than samples remain
            assert len(list(ours)) == len(ours)
            continue
        assert list(ours) == expected
    with pytest.raises(ValueError):
        ElasticDistributedSampler(dataset, replicas, 0, size)
    with pytest.raises(TypeError):
        ElasticDistributedSampler(iter(dataset), 1, 0)


def test_barrier_and_synchronize_across_clients(master):
    n = 4
    stores = _clients(master, n)
    results: dict[int, object] = {}

    def member(rank):
        try:
            barrier(stores[rank], n, "job/b1", barrier_timeout=30)
            results[rank] = synchronize(stores[rank], f"d{rank}".encode(), rank, n, "job/s/", 30)
        except Exception as e:  # reported below
            results[rank] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert all(results[r] == [b"d0", b"d1", b"d2", b"d3"] for r in range(n)), results
    assert master.get("job/b1/num_members") == str(n).encode()  # torch's key layout
    assert stores[0].timeout == timedelta(seconds=30)  # store_timeout restored it


def test_barrier_timeout_names_missing_ranks(master):
    stores = _clients(master, 2)
    errors: dict[int, BaseException] = {}

    def member(rank):
        try:
            barrier(stores[rank], 3, "late", barrier_timeout=0.3, rank=rank,
                    rank_tracing_decoder=lambda r: f"host{r}", trace_timeout=0.2)
        except StoreTimeoutError as e:
            errors[rank] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert "missing_ranks=[host2]" in str(errors[0]), errors
    assert "check rank 0 (host0)" in str(errors[1]), errors
    with pytest.raises(AssertionError):
        barrier(stores[0], 1, "x", rank_tracing_decoder=str)


def test_store_timeout_restores(master):
    with store_timeout(master, 1.5):
        assert master.timeout == timedelta(seconds=1.5)
        with pytest.raises(StoreTimeoutError):
            with store_timeout(master, 0.05):
                master.get("never")
        assert master.timeout == timedelta(seconds=1.5)
    assert master.timeout == timedelta(seconds=30)
    master.multi_set(["p0", "p1"], ["a", "b"])
    done = threading.Thread(target=lambda: get_all(_clients(master, 1)[0], 1, "p", 2))
    done.start()
    assert get_all(master, 0, "p", 2) == [b"a", b"b"]  # rank 0 waits for rank 1 to read
    done.join(10)
    assert not done.is_alive()


@pytest.mark.torch
def test_torch_helpers_and_ours_meet_in_one_barrier(master):
    tu = _torch_utils()
    import torch.distributed as dist

    theirs = dist.TCPStore("127.0.0.1", master.port, is_master=False,
                           timeout=timedelta(seconds=30), wait_for_workers=False)
    ours = _clients(master, 1)[0]
    t = threading.Thread(target=tu.store.barrier, args=(theirs, 2, "mixed", 30))
    t.start()
    barrier(ours, 2, "mixed", 30)
    t.join(30)
    assert not t.is_alive()


def test_create_c10d_store_waits_for_members():
    port = get_free_port()
    got: dict[int, object] = {}

    def member(rank):
        try:
            got[rank] = create_c10d_store(rank == 0, "127.0.0.1", port, 3, timeout=30)
        except Exception as e:  # reported below
            got[rank] = e

    threads = [threading.Thread(target=member, args=(r,)) for r in range(3)]
    threads[0].start()
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(60)
    assert all(isinstance(got[r], TCPStore) for r in range(3)), got
    got[1].set("k", "v")
    assert got[2].get("k") == b"v"
    with pytest.raises(ValueError):
        create_c10d_store(True, "127.0.0.1", -1, 2)
    got[0].shutdown_server()
