"""Std/to_map/DefaultLogsSpecs and the error-file format, checked against torch's own classes."""

from __future__ import annotations

import json
import os
import re

import pytest

from fastelastic.errors import ChildFailedError
from fastelastic.multiprocessing import DefaultLogsSpecs, Std, to_map
from fastelastic.multiprocessing.errors import ErrorHandler, ProcessFailure, record


def _torch_mp():
    pytest.importorskip(
        "torch", reason="!!! torch 2.13 is not installed: compatibility test skipped"
    )
    import torch.distributed.elastic.multiprocessing as tmp
    import torch.distributed.elastic.multiprocessing.errors as terr

    return tmp, terr


# ---------------------------------------------------------------- Std / to_map


@pytest.mark.parametrize("text", ["0", "1", "2", "3", "0:3,1:0,2:1,3:2", "1:1"])
def test_std_from_str_matches_torch(text):
    tmp, _ = _torch_mp()
    ours, theirs = Std.from_str(text), tmp.Std.from_str(text)
    if isinstance(theirs, dict):
        assert {k: int(v) for k, v in ours.items()} == {k: int(v) for k, v in theirs.items()}
    else:
        assert int(ours) == int(theirs)


@pytest.mark.parametrize("bad", ["4", "", "0:4", "a", "0:1,", "01"])
def test_std_from_str_rejects(bad):
    with pytest.raises(ValueError):
        Std.from_str(bad)


def test_to_map():
    assert to_map(Std.OUT, 2) == {0: Std.OUT, 1: Std.OUT}
    assert to_map({1: Std.ERR}, 3) == {0: Std.NONE, 1: Std.ERR, 2: Std.NONE}


# ---------------------------------------------------------------- DefaultLogsSpecs


def _envs(n):
    return {r: {"TORCHELASTIC_RUN_ID": "run1", "TORCHELASTIC_RESTART_COUNT": "2"} for r in range(n)}


def _relative(dest, base):
    def rel(p):
        return "" if p in ("", os.devnull) else os.path.relpath(p, base)

    return {
        "stdouts": {k: rel(v) for k, v in dest.stdouts.items()},
        "stderrs": {k: rel(v) for k, v in dest.stderrs.items()},
        "tee_stdouts": {k: rel(v) for k, v in dest.tee_stdouts.items()},
        "tee_stderrs": {k: rel(v) for k, v in dest.tee_stderrs.items()},
        "error_files": {k: rel(v) for k, v in dest.error_files.items()},
        "filtered": (rel(dest.filtered_stdout), rel(dest.filtered_stderr)),
    }


@pytest.mark.parametrize(
    "redirects,tee,filt",
    [
        (Std.NONE, Std.NONE, None),
        (Std.ALL, Std.NONE, None),
        ({0: Std.OUT}, {1: Std.ERR}, None),
        (Std.NONE, Std.ALL, {1}),
        (Std.ERR, Std.OUT, {0, 2}),
    ],
)
def test_reify_layout_matches_torch(tmp_path, redirects, tee, filt):
    tmp, _ = _torch_mp()
    ours_env, theirs_env = _envs(3), _envs(3)
    ours_dir, theirs_dir = tmp_path / "ours", tmp_path / "theirs"
    ours = DefaultLogsSpecs(str(ours_dir), redirects, tee, filt).reify(ours_env)
    theirs = tmp.DefaultLogsSpecs(
        str(theirs_dir),
        {k: tmp.Std(int(v)) for k, v in redirects.items()}
        if isinstance(redirects, dict)
        else tmp.Std(int(redirects)),
        {k: tmp.Std(int(v)) for k, v in tee.items()}
        if isinstance(tee, dict)
        else tmp.Std(int(tee)),
        filt,
    ).reify(theirs_env)
    # the run directory has a random suffix: compare paths relative to each one
    ours_run = os.path.join(str(ours_dir), os.listdir(ours_dir)[0])
    theirs_run = os.path.join(str(theirs_dir), os.listdir(theirs_dir)[0])
    assert os.listdir(ours_dir)[0].startswith("run1_")
    assert _relative(ours, ours_run) == _relative(theirs, theirs_run)
    assert all(os.path.isdir(os.path.join(ours_run, "attempt_2", str(r))) for r in range(3))
    for r in range(3):
        assert os.path.relpath(ours_env[r]["TORCHELASTIC_ERROR_FILE"], ours_run) == os.path.relpath(
            theirs_env[r]["TORCHELASTIC_ERROR_FILE"], theirs_run
        )


def test_reify_devnull_and_file_log_dir(tmp_path):
    envs = _envs(2)
    dest = DefaultLogsSpecs(os.devnull, Std.ALL).reify(envs)
    assert dest.error_files == {0: os.devnull, 1: os.devnull}
    assert envs[0]["TORCHELASTIC_ERROR_FILE"] == ""
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        DefaultLogsSpecs(str(f))
    assert DefaultLogsSpecs(str(tmp_path)) == DefaultLogsSpecs(str(tmp_path))


# ---------------------------------------------------------------- error files


def _raise_in(fn_record, error_file, monkeypatch, exc):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @fn_record
    def main():
        raise exc

    with pytest.raises(type(exc)):
        main()


def test_our_record_is_read_by_torch(tmp_path, monkeypatch):
    _, terr = _torch_mp()
    error_file = tmp_path / "error.json"
    _raise_in(record, error_file, monkeypatch, ValueError("ours"))
    failure = terr.ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "ValueError: ours"
    assert "raise exc" in failure.message["extraInfo"]["py_callstack"]
    assert failure.timestamp > 0


def test_torch_record_is_read_by_us(tmp_path, monkeypatch):
    _, terr = _torch_mp()
    error_file = tmp_path / "error.json"
    _raise_in(terr.record, error_file, monkeypatch, KeyError("theirs"))
    ours = ProcessFailure(local_rank=3, pid=42, exitcode=1, error_file=str(error_file))
    theirs = terr.ProcessFailure(local_rank=3, pid=42, exitcode=1, error_file=str(error_file))
    assert (ours.message, ours.timestamp, ours.error_file) == (
        theirs.message,
        theirs.timestamp,
        theirs.error_file,
    )


def test_child_failed_error_format_matches_torch(tmp_path, monkeypatch):
    _, terr = _torch_mp()
    error_file = tmp_path / "error.json"
    _raise_in(record, error_file, monkeypatch, ValueError("root"))
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")
    ours = {
        4: ProcessFailure(0, 10, 1, str(error_file)),
        5: ProcessFailure(1, 11, -9, str(tmp_path / "missing.json")),
    }
    theirs = {
        4: terr.ProcessFailure(0, 10, 1, str(error_file)),
        5: terr.ProcessFailure(1, 11, -9, str(tmp_path / "missing.json")),
    }
    ours[5].timestamp = theirs[5].timestamp = ours[4].timestamp + 1

    def normalise(text):  # torch prints getfqdn(), we print gethostname()
        return re.sub(r"host      : .*", "host      : H", text)

    ours_msg = ChildFailedError("trainer", ours).format_msg()
    theirs_msg = terr.ChildFailedError("trainer", theirs).format_msg()
    assert normalise(ours_msg) == normalise(theirs_msg)
    assert "Root Cause (first observed failure):\n[0]:" in ours_msg
    assert "exitcode  : -9 (pid: 11)  (SIGKILL)" in ours_msg


def test_record_semantics(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "mine.json"))

    @record
    def clean_exit():
        raise SystemExit(0)

    assert clean_exit() is None

    @record
    def bad_exit():
        raise SystemExit(2)

    with pytest.raises(SystemExit):
        bad_exit()
    assert not (tmp_path / "mine.json").exists()

    child = tmp_path / "child.json"
    child.write_text(
        json.dumps(
            {"message": {"message": "E", "extraInfo": {"py_callstack": "tb", "timestamp": "5"}}}
        )
    )

    @record
    def agent():
        raise ChildFailedError("t", {0: ProcessFailure(0, 1, 3, str(child))})

    with pytest.raises(ChildFailedError):
        agent()
    copied = json.loads((tmp_path / "mine.json").read_text())
    assert (
        copied["message"]["errorCode"] == 3
        and copied["message"]["extraInfo"]["py_callstack"] == "tb"
    )


def test_process_failure_fallbacks(tmp_path):
    corrupt = tmp_path / "bad.json"
    corrupt.write_text("{not json")
    f = ProcessFailure(0, 7, 1, str(corrupt), stderr_tail="Traceback...\nValueError: x")
    assert f.error_file == "<N/A>" and "ValueError: x" in f.message
    g = ProcessFailure(0, 7, 1, str(tmp_path / "none.json"))
    assert "To enable traceback" in g.message
    h = ProcessFailure(0, 7, -15, str(tmp_path / "none.json"), stderr_tail="bye")
    assert h.message.startswith("Signal 15 (SIGTERM) received by PID 7") and "bye" in h.message
    with pytest.raises(ValueError):
        ChildFailedError("x", {})


def test_error_handler_without_file_only_logs(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    handler = ErrorHandler()
    handler.initialize()
    try:
        raise RuntimeError("no file")
    except RuntimeError as e:
        handler.record_exception(e)  # must not raise
