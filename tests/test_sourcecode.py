"""Our own rules, checked on the source tree: linters, type checks, stubs, no build output."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "native" / "fastelastic" / "_native"
STUBS = ROOT / "src" / "fastelastic" / "_native"


def _tool(name: str) -> list[str]:
    if shutil.which(name) is None:
        pytest.skip(f"!!! {name} is not installed (pip install '.[test]'); CI installs it")
    return [name]


def _run(cmd: list[str]) -> None:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout}\n{out.stderr}"


def test_ruff():
    _run([*_tool("ruff"), "check", "src", "tests", "examples"])


@pytest.mark.slow
def test_mypy():
    _run([sys.executable, "-m", "mypy", "src"] if shutil.which("mypy") else _tool("mypy"))


def test_cython_lint():
    _run([*_tool("cython-lint"), "native"])


def test_every_compiled_module_has_a_stub():
    modules = {p.stem for p in NATIVE.glob("*.pyx")}
    stubs = {p.stem for p in STUBS.glob("*.pyi")}
    assert modules and modules <= stubs, f"missing .pyi for {sorted(modules - stubs)}"


def test_no_generated_c_is_tracked():
    tracked = subprocess.run(["git", "ls-files", "native"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout.split()
    generated = [f for f in tracked if f.endswith((".c", ".cpp", ".so", ".html"))]
    assert not generated, f"build output committed: {generated}"


def test_no_placeholders_in_shipped_code():
    pattern = re.compile(r"NotImplementedError|\bTODO\b|\bFIXME\b|\bXXX\b|not implemented")
    hits = []
    for path in [*ROOT.joinpath("src").rglob("*.py"), *NATIVE.rglob("*.pyx"),
                 *NATIVE.rglob("*.pxd")]:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)



# ---------------------------------------------------------------------- the layout of src/

SRC = ROOT / "src"
RENDEZVOUS = SRC / "fastelastic" / "rendezvous"
# torch.distributed.elastic.rendezvous's public modules that we mirror at the same paths: not
# counted among our own (torch's layout needs them where they are)
TORCH_RENDEZVOUS = {"api", "registry", "utils", "dynamic_rendezvous", "c10d_rendezvous_backend",
                    "static_tcp_rendezvous", "etcd_rendezvous", "etcd_rendezvous_backend",
                    "etcd_server"}
MAX_MODULES = 12


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``path`` imports anywhere: at the top, in a function,
    under ``if TYPE_CHECKING``; ``from p import x`` names the module ``p.x`` if there is one,
    else ``p``."""
    import ast

    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                frm = ".".join(base + ([node.module] if node.module else []))
            else:
                frm = node.module or ""
            for a in node.names:
                out.add(f"{frm}.{a.name}" if f"{frm}.{a.name}" in modules else frm)
    return {m for m in out if m in modules and m != name}


def _import_graph() -> dict[str, set[str]]:
    paths = sorted(SRC.joinpath("fastelastic").rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    return {_module_name(p): _imports(p, modules) for p in paths}


def test_the_import_graph_is_read_whole():
    """The graph the next test checks sees every kind of import (a check of the checker)."""
    graph = _import_graph()
    fr = "fastelastic.rendezvous"
    assert f"{fr}.fast._config" in graph[f"{fr}.fast._members"]  # under TYPE_CHECKING
    assert f"{fr}.api" in graph[f"{fr}.fast.fast_rendezvous"]  # relative, two levels up
    assert f"{fr}.fast.failover._majority" in graph[f"{fr}.fast._round"]  # from . import x
    assert f"{fr}.fast.fast_rendezvous" in graph[f"{fr}.registry"]  # in a function
    assert f"{fr}.fast._round" in graph[f"{fr}.fast.failover._hops"]  # under TYPE_CHECKING


def _mutual(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    return sorted({tuple(sorted((a, b))) for a, deps in graph.items() for b in deps
                   if a in graph.get(b, set())})


def test_a_pair_that_imports_each_other_is_found():
    assert _mutual({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [("a", "b")]
    assert _mutual({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_two_modules_import_each_other():
    """Including imports under ``TYPE_CHECKING`` and in functions: a type both need lives in a
    leaf module that both import."""
    pairs = _mutual(_import_graph())
    assert not pairs, "modules that import each other:\n" + "\n".join(
        f"  {a} <-> {b}" for a, b in pairs)


def test_no_folder_of_the_rendezvous_holds_more_than_12_of_our_modules():
    counts = {}
    for folder in [RENDEZVOUS, *(p for p in RENDEZVOUS.rglob("*") if p.is_dir()
                                 and p.joinpath("__init__.py").exists())]:
        ours = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"
                and not (folder == RENDEZVOUS and p.stem in TORCH_RENDEZVOUS)]
        counts[str(folder.relative_to(SRC))] = len(ours)
    assert len(counts) > 1 and all(counts.values()), counts  # the subpackages were found
    over = {k: v for k, v in counts.items() if v > MAX_MODULES}
    assert not over, f"more than {MAX_MODULES} of our modules in a folder: {over}"


def test_torch_s_public_rendezvous_modules_are_where_torch_has_them():
    """The modules not counted above are torch's public paths: each is where torch has it."""
    here = {p.stem for p in RENDEZVOUS.glob("*.py")}
    assert TORCH_RENDEZVOUS <= here, sorted(TORCH_RENDEZVOUS - here)
    try:
        import torch.distributed.elastic.rendezvous as trdzv
    except ImportError:
        pytest.skip("!!! torch is not installed: torch's own module list not compared")
    theirs = {p.stem for p in Path(trdzv.__file__).parent.glob("*.py")}
    assert TORCH_RENDEZVOUS <= theirs, sorted(TORCH_RENDEZVOUS - theirs)
