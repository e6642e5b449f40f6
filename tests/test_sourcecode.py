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

