"""README.md and docs/*.md: their runnable blocks run, their links resolve, their commands parse.

A fenced block whose fence line says ``runnable`` (```` ```bash runnable ````,
```` ```python runnable ````) is run: the blocks of one page in order, in one fresh temporary
directory (a block may use a file an earlier block of the same page wrote), bash blocks with
``bash -e``, python blocks as a file run by this interpreter, each with a timeout. ``fastrun``,
``fastelastic`` and ``python3`` on the blocks' PATH run this tree with this interpreter. A block
that also says ``needs=etcd`` or ``needs=torch`` is skipped, loudly, where that is missing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BLOCK_TIMEOUT_S = 60  # each runnable block is meant to take well under 20 s
README_MAX_LINES = 200

_FENCE = re.compile(r"^```(.*)$")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    flags: list[str]
    text: str

    @property
    def runnable(self) -> bool:
        return "runnable" in self.flags

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the words of its fence line."""
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        words = m.group(1).split()
        start, body = i + 1, []
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{page.relative_to(ROOT)}:{start}: unclosed code fence"
        out.append(Block(page, start, words[0] if words else "", words[1:], "\n".join(body) + "\n"))
        i += 1
    return out


def _prose(page: Path) -> str:
    """The page without its fenced blocks (links inside code are not links)."""
    return re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)


def _links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", _prose(page))  # nor are links in inline code
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", _prose(page), flags=re.M)}


# --- the pages' shape -------------------------------------------------------------------------


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


def test_readme_opens_with_the_two_commands():
    blocks = _blocks(README)
    assert len(blocks) >= 2 and all(b.lang == "bash" for b in blocks[:2]), blocks[:2]
    assert "python3 -m fastelastic.run --standalone" in blocks[0].text, blocks[0].text
    assert re.search(r"^bash \.ci/run$", blocks[1].text, re.M), blocks[1].text
    assert not any(b.runnable for b in blocks[:2]), "the set-up commands must not be runnable"


def test_every_docs_page_is_linked_from_readme():
    pages = sorted(p.name for p in DOCS.glob("*.md"))
    assert pages, "docs/ has no pages"
    linked = {os.path.normpath(link.split("#")[0]) for link in _links(README)}
    missing = [p for p in pages if os.path.join("docs", p) not in linked]
    assert not missing, f"docs pages README.md does not link: {missing}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path):
    bad = []
    for link in _links(page):
        if re.match(r"^[a-z]+:", link):  # http:, https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            bad.append(f"{link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
            bad.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    assert not bad, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(bad)


def test_runnable_blocks_are_bash_or_python():
    runnable = [b for p in _pages() for b in _blocks(p) if b.runnable]
    assert len(runnable) >= 10, f"only {len(runnable)} runnable blocks in README.md and docs/"
    wrong = [b.where() for b in runnable if b.lang not in ("bash", "python")]
    assert not wrong, f"runnable blocks must be bash or python: {wrong}"


# --- the commands the pages show ---------------------------------------------------------------


def _commands(tool: str) -> list[tuple[str, list[str]]]:
    """(where, words after ``tool``) for each ``tool`` command line in a bash block."""
    out = []
    for page in _pages():
        for b in _blocks(page):
            if b.lang != "bash":
                continue
            text = b.text.replace("\\\n", " ")
            for k, line in enumerate(text.splitlines()):
                try:
                    words = shlex.split(line, comments=True)
                except ValueError:
                    continue
                if tool not in words:
                    continue
                words = words[words.index(tool) + 1:]
                for stop in ("|", "&", "&&", ";", ">", "2>&1", "||"):
                    if stop in words:
                        words = words[: words.index(stop)]
                words = [w for w in words if not re.match(r"^\d?>", w)]
                out.append((f"{b.where()} (+{k})", words))
    return out


def test_every_fastrun_command_shown_parses():
    from fastelastic.launcher.args import get_args_parser

    cmds = _commands("fastrun")
    assert len(cmds) >= 20, f"only {len(cmds)} fastrun commands found"
    bad = []
    for where, words in cmds:
        try:
            ns = get_args_parser().parse_args(words)
        except SystemExit:
            bad.append(f"{where}: fastrun {shlex.join(words)}")
            continue
        if not ns.training_script:
            bad.append(f"{where}: no script: fastrun {shlex.join(words)}")
    assert not bad, "fastrun commands that fastrun rejects:\n" + "\n".join(bad)


def test_every_fastelastic_watch_command_shown_parses():
    from fastelastic.__main__ import _parser

    cmds = [(w, words) for w, words in _commands("fastelastic") if words[:1] == ["watch"]]
    assert cmds, "no `fastelastic watch` command found"
    bad = []
    for where, words in cmds:
        try:
            _parser().parse_args(words)
        except SystemExit:
            bad.append(f"{where}: fastelastic {shlex.join(words)}")
    assert not bad, "fastelastic commands that fail to parse:\n" + "\n".join(bad)


def test_every_environment_variable_named_exists_in_the_code():
    files = [*(ROOT / "src").rglob("*.py"), ROOT / "setup.py"]
    source = "\n".join(p.read_text() for p in files)
    bad = []
    for page in _pages():
        names = set(re.findall(r"\bFASTELASTIC_[A-Z0-9_]*[A-Z0-9]\b", page.read_text()))
        for name in sorted(names):
            if name not in source:
                bad.append(f"{page.relative_to(ROOT)}: {name}")
    assert not bad, "variables the docs name and the code never reads:\n" + "\n".join(bad)


# --- the runnable blocks ----------------------------------------------------------------------


def _shims(bindir: Path) -> None:
    """``fastrun``, ``fastelastic`` and ``python3`` commands that run this interpreter (on this
    tree: PYTHONPATH), whatever else is on PATH."""
    exe = shlex.quote(sys.executable)
    for name, args in (("fastrun", "-m fastelastic.run "), ("fastelastic", "-m fastelastic "),
                       ("python3", ""), ("python", "")):
        shim = bindir / name
        shim.write_text(f'#!/bin/sh\nexec {exe} {args}"$@"\n')
        shim.chmod(0o755)


def _unmet(block: Block) -> str | None:
    for flag in block.flags:
        if flag == "needs=etcd" and not (shutil.which("etcd")
                                         or os.environ.get("TORCHELASTIC_ETCD_BINARY_PATH")):
            return "etcd is not installed"
        if flag == "needs=etcd":
            try:
                import etcd3gw  # noqa: F401
            except ImportError:
                return "etcd3gw is not installed"
        if flag == "needs=torch":
            try:
                import torch  # noqa: F401
            except ImportError:
                return "torch is not installed"
    return None


_RUNNABLE_PAGES = [p for p in _pages() if any(b.runnable for b in _blocks(p))]


@pytest.mark.parametrize("page", _RUNNABLE_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_runnable_blocks_run(page: Path, tmp_path: Path):
    blocks = [b for b in _blocks(page) if b.runnable]
    for b in blocks:
        reason = _unmet(b)
        if reason:
            pytest.skip(f"!!! {b.where()} needs what is missing here: {reason}")
    bindir = tmp_path / ".bin"
    bindir.mkdir()
    _shims(bindir)
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ)
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    src = str(ROOT / "src")
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    for k, b in enumerate(blocks):
        script = work.parent / f"block{k}.{'sh' if b.lang == 'bash' else 'py'}"
        script.write_text(b.text)
        argv = ["bash", "-e", str(script)] if b.lang == "bash" else [sys.executable, str(script)]
        with subprocess.Popen(argv, cwd=work, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
            try:
                out, err = proc.communicate(timeout=BLOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                _kill_session(proc.pid)
                out, err = proc.communicate()
                pytest.fail(f"{b.where()}: still running after {BLOCK_TIMEOUT_S} s:\n{b.text}\n"
                            f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")
            finally:
                _kill_session(proc.pid)  # what a block left running in the background
        assert proc.returncode == 0, (
            f"{b.where()}: exit status {proc.returncode}:\n{b.text}\n"
            f"--- stdout\n{out[-4000:]}\n--- stderr\n{err[-4000:]}")


def _kill_session(pid: int) -> None:
    """SIGKILLs the process group the block started (its own session), if any is left."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
