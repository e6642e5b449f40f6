"""``store_type=file``: the c10d backend over a FileStore in torch's file format."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import uuid
from datetime import timedelta

import pytest

from fastelastic.errors import StoreTimeoutError
from fastelastic.rendezvous import RendezvousParameters
from fastelastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend, create_backend
from fastelastic.store.file_store import FileStore

AGENT = textwrap.dedent(
    """
    import json, sys
    from datetime import timedelta
    from fastelastic.rendezvous import RendezvousParameters
    from fastelastic.rendezvous.registry import get_rendezvous_handler
    path, run_id, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
    params = RendezvousParameters("c10d", path, run_id, n, n, store_type="file",
                                  join_timeout=60, last_call_timeout=1)
    handler = get_rendezvous_handler(params)
    info = handler.next_rendezvous()
    info.store.set(f"hello/{info.rank}", str(info.rank))
    info.store.wait([f"hello/{r}" for r in range(info.world_size)], timedelta(seconds=60))
    boot = info.bootstrap_store_info
    print(json.dumps({"rank": info.rank, "world": info.world_size,
                      "backend": handler.get_backend(), "torch": "torch" in sys.modules,
                      "master": [boot.master_addr, boot.master_port]}), flush=True)
    handler.shutdown()
    """
)


@pytest.mark.timeout(120)
def test_three_agents_rendezvous_on_one_file(tmp_path, outputs_of):
    path, run_id, n = str(tmp_path / "rdzv"), uuid.uuid4().hex, 3
    procs = [
        subprocess.Popen([sys.executable, "-c", AGENT, path, run_id, str(n)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(n)
    ]
    results = [json.loads(out.strip().splitlines()[-1]) for out in outputs_of(procs, 100)]
    assert sorted(r["rank"] for r in results) == list(range(n))
    assert {r["world"] for r in results} == {n}
    assert {r["backend"] for r in results} == {"c10d"}
    assert not any(r["torch"] for r in results), "the file store imported torch"
    assert len({tuple(r["master"]) for r in results}) == 1  # one bootstrap address for all


def test_file_store_semantics(tmp_path):
    path = str(tmp_path / "s")
    a, b = FileStore(path), FileStore(path)
    a.set("k", "v")
    assert b.get("k") == b"v"
    assert a.add("n", 2) == 2 and b.add("n", 5) == 7
    assert b.compare_set("c", "", "x") == b"x"
    assert a.compare_set("c", "nope", "y") == b"x"
    assert a.compare_set("c", "x", "y") == b"y"
    assert a.compare_set("missing", "e", "d") == b"e"  # torch returns expected for a missing key
    a.append("k", "+")
    assert b.get("k") == b"v+"
    assert b.delete_key("k") and not a.check(["k"]) and not a.delete_key("k")
    a.multi_set(["m1", "m2"], ["1", "2"])
    assert b.multi_get(["m1", "m2"]) == [b"1", b"2"]
    assert sorted(b.list_keys()) == ["c", "m1", "m2", "n"]
    b.set_timeout(timedelta(milliseconds=100))
    with pytest.raises(StoreTimeoutError):
        b.get("never")
    threading.Timer(0.05, lambda: a.set("late", "1")).start()
    b.wait(["late"], timedelta(seconds=10))
    a.close()
    b.close()


def test_last_of_num_workers_removes_the_file(tmp_path):
    path = str(tmp_path / "s")
    a, b = FileStore(path, 2), FileStore(path, 2)
    a.close()
    assert os.path.exists(path)
    b.close()
    assert not os.path.exists(path)


@pytest.mark.torch
def test_same_file_as_torchs_file_store(tmp_path):
    try:
        import torch.distributed as dist
    except ImportError as e:
        pytest.skip(f"!!! torch is not installed ({e}); the FileStore interop test did not run")
    path = str(tmp_path / "s")
    ours = FileStore(path)
    theirs = dist.FileStore(path, -1)
    theirs.set("t", "from torch")
    ours.set("o", b"\x00from us")
    assert ours.get("t") == b"from torch" and theirs.get("o") == b"\x00from us"
    assert theirs.add("n", 3) == 3 and ours.add("n", 4) == 7 and theirs.add("n", 0) == 7
    assert ours.compare_set("t", "from torch", "cas") == b"cas"
    assert theirs.get("t") == b"cas"
    assert theirs.delete_key("o") and not ours.check(["o"])
    assert ours.num_keys() == theirs.num_keys()
    ours.close()


def test_create_backend_file_store_and_errors(tmp_path):
    params = RendezvousParameters("c10d", str(tmp_path / "f"), "r", 1, 1, store_type="file")
    backend, store = create_backend(params)
    assert isinstance(backend, C10dRendezvousBackend) and isinstance(store, FileStore)
    assert backend.get_state() is None
    # empty endpoint: a private temporary file, as torch's mkstemp
    _, tmp_store = create_backend(RendezvousParameters("c10d", "", "r", 1, 1, store_type="file"))
    assert os.stat(tmp_store.path).st_mode & 0o777 == 0o600
    os.remove(tmp_store.path)
    with pytest.raises(ValueError, match="only supports file and tcp"):
        create_backend(RendezvousParameters("c10d", "x", "r", 1, 1, store_type="hash"))


@pytest.mark.timeout(180)
def test_two_fastrun_nodes_on_a_file_store(tmp_path, outputs_of):
    script = tmp_path / "w.py"
    script.write_text("import os\nprint('RANK', os.environ['RANK'], os.environ['WORLD_SIZE'])\n")
    cmd = [sys.executable, "-m", "fastelastic.run", "--nnodes", "2", "--nproc-per-node", "1",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", str(tmp_path / "rdzv"),
           "--rdzv-conf", "store_type=file", "--rdzv-id", uuid.uuid4().hex, str(script)]
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    lines = [ln.split()[-2:] for out in outputs_of(procs, 150)
             for ln in out.splitlines() if "RANK" in ln]
    assert sorted(lines) == [["0", "2"], ["1", "2"]]
