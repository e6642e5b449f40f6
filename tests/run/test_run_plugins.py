"""Third-party rendezvous backends from ``torchrun.handlers`` entry points, as torchrun loads them.

The plugin is a real installed distribution: a package and its ``.dist-info`` (METADATA and
entry_points.txt) in a temporary directory put on ``sys.path`` / ``PYTHONPATH``.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
from run_testlib import DUMP, base_env, free_port, read_dumps, run_launcher

from fastelastic.rendezvous import (
    RendezvousParameters,
    get_rendezvous_handler,
    rendezvous_handler_registry,
)

PLUGIN = '''
"""A rendezvous plugin written for torchrun (imports rewritten to fastelastic)."""
import os

from fastelastic.rendezvous import RendezvousHandler, RendezvousParameters, get_rendezvous_handler

LOADED = []


class RecordingHandler(RendezvousHandler):
    """Delegates to the c10d handler and records every round in the ``marker`` file."""

    def __init__(self, params):
        conf = {k: v for k, v in params.config.items() if k != "marker"}
        self._marker = params.config.get("marker")
        self._inner = get_rendezvous_handler(RendezvousParameters(
            "c10d", params.endpoint, params.run_id, params.min_nodes, params.max_nodes,
            local_addr=params.local_addr, **conf))

    def get_backend(self):
        return "recording"

    @property
    def use_agent_store(self):
        return self._inner.use_agent_store

    def next_rendezvous(self):
        info = self._inner.next_rendezvous()
        if self._marker:
            with open(self._marker, "a") as f:
                f.write(f"round rank={info.rank} world={info.world_size} pid={os.getpid()}\\n")
        return info

    def is_closed(self):
        return self._inner.is_closed()

    def set_closed(self):
        self._inner.set_closed()

    def num_nodes_waiting(self):
        return self._inner.num_nodes_waiting()

    def get_run_id(self):
        return self._inner.get_run_id()

    def shutdown(self):
        return self._inner.shutdown()


def handler_generator():
    LOADED.append("recording")
    return RecordingHandler


def clashing_generator():
    LOADED.append("c10d")
    return RecordingHandler


def broken_generator():
    raise RuntimeError("this plugin cannot be loaded")
'''

ENTRY_POINTS = """\
[torchrun.handlers]
recording = fe_test_rdzv_plugin:handler_generator
c10d = fe_test_rdzv_plugin:clashing_generator
broken = fe_test_rdzv_plugin:broken_generator
"""


def install_plugin(root: Path) -> Path:
    """Installs the plugin distribution into ``root`` (a directory for sys.path)."""
    (root / "fe_test_rdzv_plugin").mkdir(parents=True)
    (root / "fe_test_rdzv_plugin" / "__init__.py").write_text(PLUGIN)
    info = root / "fe_test_rdzv_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: fe-test-rdzv-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINTS)
    return root


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    root = install_plugin(tmp_path / "site")
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name in ("recording", "broken"):
        rendezvous_handler_registry._registry.pop(name, None)
    sys.modules.pop("fe_test_rdzv_plugin", None)


def _params(backend, port, **conf):
    return RendezvousParameters(backend, f"127.0.0.1:{port}", "plugin-job", 1, 1,
                                local_addr="127.0.0.1", **conf)


def test_registry_loads_a_plugin_backend_on_demand(plugin, tmp_path):
    marker = tmp_path / "rounds"
    assert "recording" not in rendezvous_handler_registry._registry
    handler = get_rendezvous_handler(_params("recording", free_port(), marker=str(marker)))
    assert handler.get_backend() == "recording"
    info = handler.next_rendezvous()
    assert (info.rank, info.world_size) == (0, 1)
    assert marker.read_text().startswith("round rank=0 world=1")
    handler.shutdown()
    # registered once, like torchrun's registry after loading it
    mod = sys.modules["fe_test_rdzv_plugin"]
    assert rendezvous_handler_registry._registry["recording"] is mod.RecordingHandler
    assert mod.LOADED == ["recording"]  # the other entry points were never loaded


def test_built_in_names_win_and_a_broken_plugin_is_a_warning(plugin, caplog):
    from fastelastic.rendezvous.fast.fast_rendezvous import FastRendezvousHandler

    handler = get_rendezvous_handler(_params("c10d", free_port()))
    assert type(handler) is FastRendezvousHandler
    handler.shutdown()
    with caplog.at_level(logging.WARNING, logger="fastelastic.rendezvous.registry"):
        with pytest.raises(ValueError, match="'broken' is not registered"):
            get_rendezvous_handler(_params("broken", free_port()))
    assert any("out of tree plugin broken" in r.getMessage() for r in caplog.records)
    assert "fe_test_rdzv_plugin" not in sys.modules or \
        sys.modules["fe_test_rdzv_plugin"].LOADED == []


@pytest.mark.timeout(120)
def test_fastrun_runs_a_job_on_a_plugin_backend(tmp_path):
    root = install_plugin(tmp_path / "site")
    marker, dumps = tmp_path / "rounds", tmp_path / "dumps"
    dumps.mkdir()
    env = base_env(DUMP_DIR=str(dumps))
    env["PYTHONPATH"] = f"{root}:{env['PYTHONPATH']}"
    r = run_launcher("fastrun", [
        "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "recording",
        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "plugin-job",
        "--rdzv-conf", f"marker={marker}", str(DUMP)], env, timeout=100)
    assert r.returncode == 0, r.stderr[-3000:]
    got = read_dumps(dumps)
    assert sorted(got) == [0, 1]
    assert {d["env"]["WORLD_SIZE"] for d in got.values()} == {"2"}
    assert {d["env"]["TORCHELASTIC_RUN_ID"] for d in got.values()} == {"plugin-job"}
    assert marker.read_text().count("round rank=0 world=1") == 1
    # a name that no plugin provides is still one clear line, exit 2
    bad = run_launcher("fastrun", ["--rdzv-backend", "nosuchplugin", str(DUMP)], env)
    assert bad.returncode == 2
    assert "unknown rendezvous backend 'nosuchplugin'" in bad.stderr
