"""The documented set-up commands install what the main job needs to run without noise."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _pip_installs(command_text: str) -> list[list[str]]:
    """The package arguments of every ``pip install`` in a shell text (options dropped)."""
    out = []
    for part in re.split(r"&&|;|\n", command_text):
        if not re.search(r"\bpip\b.*\binstall\b", part):
            continue  # other shell lines may hold quoting that spans a split point
        words = shlex.split(part, comments=True)
        if "pip" in words and "install" in words:
            args = words[words.index("install") + 1:]
            out.append([w for w in args if not w.startswith("-")])
    return out


def _with_torch_also_numpy(installs: list[list[str]], where: str) -> None:
    torch_lines = [pkgs for pkgs in installs if any(p.startswith("torch") for p in pkgs)]
    assert torch_lines, f"{where} does not install torch"
    for pkgs in torch_lines:
        assert "numpy" in pkgs, f"{where} installs torch without numpy: {pkgs}"


def test_readme_first_command_installs_numpy_with_torch():
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", readme, re.S)
    assert first is not None
    _with_torch_also_numpy(_pip_installs(first.group(1)), "README's first command")


def test_ci_installs_numpy_with_torch():
    _with_torch_also_numpy(_pip_installs((ROOT / ".ci" / "run").read_text()), ".ci/run")


def test_torch_extra_has_numpy():
    text = (ROOT / "pyproject.toml").read_text()
    line = re.search(r"^torch = \[(.*)\]$", text, re.M)
    assert line is not None and '"numpy"' in line.group(1), "the torch extra lacks numpy"


def test_importing_torch_does_not_warn_about_numpy():
    try:
        import torch  # noqa: F401
    except ImportError:
        pytest.skip("!!! torch is not installed: the NumPy warning cannot be checked")
    r = subprocess.run([sys.executable, "-c", "import torch; torch.zeros(1).tolist()"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "Failed to initialize NumPy" not in r.stderr, r.stderr
