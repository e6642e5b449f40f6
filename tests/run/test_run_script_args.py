"""Everything after the training script (or ``-m module``) reaches the script verbatim."""

from __future__ import annotations

import contextlib
import io
import json
import subprocess

import pytest
from run_testlib import base_env, launcher_cmd

from fastelastic.launcher.args import get_args_parser

VALUES = {"start_method": "spawn", "numa_binding": "node"}


def _words() -> list[str]:
    """Every fastrun option string, every abbreviation of it, ``--`` and friends."""
    words: set[str] = {"--", "-", "--=x", "-h", "--help", "-r3", "-mr3", "-t1", "-5", "a b",
                       "", "=", "--nnodes=2", "--exit", "--nproc", "--rdzv", "-m"}
    for action in get_args_parser()._actions:
        for opt in action.option_strings:
            words.add(opt)
            if opt.startswith("--"):
                words.update(opt[:n] for n in range(3, len(opt)))
    return sorted(words)


LAUNCHER_PARTS = [
    [],
    ["--standalone", "--nproc-per-node", "2"],
    ["-m"],
    ["--no-python"],
    ["--"],
    ["--nnodes=1:2", "-r3", "--rdzv-conf", "timeout=5"],
]


@pytest.mark.parametrize("head", LAUNCHER_PARTS, ids=lambda h: " ".join(h) or "bare")
def test_every_flag_and_abbreviation_after_the_script_is_the_scripts(head):
    words = _words()
    alone = vars(get_args_parser().parse_args([*head, "train"]))
    # each word alone, then all of them at once, in both orders
    for tail in [*([w] for w in words), words, words[::-1]]:
        ns = vars(get_args_parser().parse_args([*head, "train", *tail]))
        assert ns["training_script"] == "train"
        assert ns["training_script_args"] == tail, tail
        assert ns == {**alone, "training_script_args": tail}


@pytest.fixture(scope="module")
def torch_parser():
    try:
        from torch.distributed.run import get_args_parser as torch_get_args_parser
    except ImportError as e:  # pragma: no cover - CI installs torch
        pytest.skip(f"!!! torch is not installed, cannot compare abbreviations: {e}")
    return torch_get_args_parser()


def _outcome(parser, argv):
    try:
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            return vars(parser.parse_args(argv))
    except SystemExit as e:
        return ("exit", e.code)


def test_abbreviations_torchrun_accepts_mean_the_same(torch_parser):
    """Every prefix of every torchrun flag: accepted by both with the same meaning, or by none."""
    ours = get_args_parser()
    accepted = 0
    for action in torch_parser._actions:
        if action.dest == "help":
            continue
        value = [] if action.nargs == 0 else [VALUES.get(action.dest, "1")]
        for opt in action.option_strings:
            for n in range(3 if opt.startswith("--") else 2, len(opt) + 1):
                argv = [opt[:n], *value, "s.py", opt[:n], "--"]
                theirs = _outcome(torch_parser, argv)
                mine = _outcome(ours, argv)
                if isinstance(theirs, tuple):  # torchrun refuses: so may we (never the reverse)
                    continue
                accepted += 1
                assert not isinstance(mine, tuple), argv
                assert mine[action.dest] == theirs[action.dest], argv
                assert mine["training_script_args"] == [opt[:n], "--"]
    assert accepted > 100


WRITER = """
import json, os, sys
with open(os.environ["ARGV_OUT"], "w") as f:
    json.dump([os.fsencode(a).hex() for a in sys.argv[1:]], f)
"""

# bytes, so that arguments that are not UTF-8 go through as well
RAW_ARGS = [b"--exit", b"3", b"--", *(w.encode() for w in _words()), b"\xff\xfe", "é".encode(),
            b"x\ty", b"--local-rank=3"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("form", ["script", "module", "run-path"])
def test_script_gets_its_arguments_byte_for_byte(tmp_path, form):
    (tmp_path / "argv_writer.py").write_text(WRITER)
    out = tmp_path / "argv.json"
    env = base_env(ARGV_OUT=str(out))
    env["PYTHONPATH"] = f"{tmp_path}:{env['PYTHONPATH']}"
    target = {"script": [str(tmp_path / "argv_writer.py")],
              "module": ["-m", "argv_writer"],
              "run-path": ["--run-path", str(tmp_path / "argv_writer.py")]}[form]
    cmd = [*launcher_cmd("fastrun"), "--standalone", "--nproc-per-node", "1", *target, *RAW_ARGS]
    r = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, timeout=100)
    assert r.returncode == 0, r.stderr.decode(errors="replace")[-3000:]
    got = [bytes.fromhex(h) for h in json.loads(out.read_text())]
    assert got == RAW_ARGS
