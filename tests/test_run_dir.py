"""The run room: atomic writes that leave the old file on failure (whole or streamed), strict JSON, readers
that follow a file being written, the names of its files and step directories."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest

from liandan.run import (
    JsonlTail,
    RunDir,
    atomic_file,
    atomic_write,
    atomic_write_json,
    check_output,
    dumps_json,
    parse_partial_step_dir,
    parse_step_dir,
    partial_of,
    partial_step_dir_name,
    read_jsonl,
    replacing,
    step_dir_name,
    temporary,
)


def test_an_output_path_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
    from liandan.config import ConfigError

    (tmp_path / "t.toml").write_text("")
    (tmp_path / "ck").mkdir()
    refused = {
        (tmp_path / "t.toml" / "x.json", False, True): f"cannot write {tmp_path}/t.toml/x.json: {tmp_path}/t.toml is "
        "not a directory",
        (tmp_path / "t.toml" / "a" / "x.json", False, True): f"{tmp_path}/t.toml is not a directory",
        (tmp_path / "ck", False, True): f"cannot write {tmp_path}/ck: it is a directory; name a file in it",
        (tmp_path / "t.toml", True, True): f"cannot write {tmp_path}/t.toml: it is a file, not a directory",
        (tmp_path / "new" / "x.json", False, False): f"no such directory {tmp_path}/new",
    }
    for (path, directory, makes_parents), message in refused.items():
        with pytest.raises(ConfigError) as info:
            check_output(path, directory=directory, makes_parents=makes_parents)
        assert message in str(info.value) and "\n" not in str(info.value)
    assert check_output(tmp_path / "ck" / "x.json") == tmp_path / "ck" / "x.json"
    assert check_output(tmp_path / "ck", directory=True) == tmp_path / "ck"
    assert check_output(tmp_path / "new" / "deeper" / "x.json", makes_parents=True)
    assert not (tmp_path / "new").exists()  # a check makes nothing


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"tokens": 1})
    assert json.loads(path.read_text()) == {"tokens": 1}
    (tmp_path / ".summary.json.tmp").mkdir()  # the temporary cannot be written: the write fails
    with pytest.raises(IsADirectoryError, match="summary.json.tmp"):
        atomic_write(path, "{}")
    assert json.loads(path.read_text()) == {"tokens": 1}


def test_a_streamed_file_appears_whole_when_its_block_ends_or_not_at_all(tmp_path):
    path = tmp_path / "shard.bin"
    path.write_bytes(b"old")
    with atomic_file(path) as handle:
        handle.write(b"new ")
        assert path.read_bytes() == b"old"  # nothing of the new file shows before it is whole
        handle.write(b"shard")
    assert path.read_bytes() == b"new shard" and sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]
    with pytest.raises(RuntimeError, match="tokenizer failed"), atomic_file(path, "w") as handle:
        handle.write("half")
        raise RuntimeError("tokenizer failed")
    assert path.read_bytes() == b"new shard" and sorted(p.name for p in tmp_path.iterdir()) == ["shard.bin"]


def test_writers_that_take_a_file_name_write_the_temporary(tmp_path):
    path = tmp_path / "tokenizer.json"
    with replacing(path) as tmp:
        assert tmp == temporary(path) and tmp.parent == path.parent
        tmp.write_text("{}")
        assert not path.exists()
    assert path.read_text() == "{}" and not tmp.exists()


def test_private_and_unique_temporaries(tmp_path):
    path = tmp_path / "header.json"
    atomic_write(path, "{}", private=True)
    assert path.stat().st_mode & 0o777 == 0o600
    assert temporary(path, unique=True) != temporary(path) and str(os.getpid()) in temporary(path, unique=True).name
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    temporary(path).symlink_to(target)  # planted at the temporary name: replaced, never written through
    atomic_write(path, '{"step": 1}')
    assert target.read_text() == "keep me" and json.loads(path.read_text()) == {"step": 1}


def test_json_is_strict():
    text = dumps_json({"loss": math.nan, "nested": [math.inf, 1.5], "path": Path("/x")})
    assert json.loads(text) == {"loss": None, "nested": [None, 1.5], "path": "/x"}
    assert "NaN" not in text and "Infinity" not in text


def test_tail_waits_for_a_half_written_line_and_counts_malformed_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = JsonlTail(path)
    assert tail.read() == []  # not there yet
    path.write_text('{"step": 1}\n{"step": 2}\n{"st')
    assert [r["step"] for r in tail.read()] == [1, 2]
    with path.open("a") as f:
        f.write('ep": 3}\nnot json\n[1, 2]\n{"step": 4}\n')
    assert [r["step"] for r in tail.read()] == [3, 4]
    assert tail.skipped == 2
    assert tail.read() == []
    path.write_text('{"step": 1}\n')  # rewritten shorter, as a resume truncates metrics
    assert [r["step"] for r in tail.read()] == [1]
    assert [r["step"] for r in read_jsonl(path)] == [1]


def test_layout_and_step_names(tmp_path):
    run = RunDir.of(tmp_path / "r")
    assert run.checkpoints == tmp_path / "r" / "checkpoints"
    assert RunDir.of(tmp_path / "r", tmp_path / "ck").checkpoints == tmp_path / "ck"
    assert run.read_metrics() == [] and run.read_summary() == {} and not run.exists()
    assert step_dir_name(120) == "step-00000120" and parse_step_dir("step-00000120") == 120
    assert parse_step_dir("step-00000120.tmp") is None and parse_step_dir("latest") is None
    with pytest.raises(ValueError):
        step_dir_name(-1)
    assert partial_step_dir_name(120) == "step-00000120.tmp" and parse_partial_step_dir("step-00000120.tmp") == 120
    assert parse_partial_step_dir("step-00000120") is None and parse_partial_step_dir("step-120.tmp") is None
    assert partial_of(run.checkpoints / "step-00000120") == run.checkpoints / "step-00000120.tmp"
    assert run.heartbeat(3) == tmp_path / "r" / "heartbeat" / "rank-00003.json"
    assert run.stack_dump(3) == tmp_path / "r" / "heartbeat" / "stacks" / "rank-00003.txt"
    assert run.attempt_log(2, "node-a") == tmp_path / "r" / "logs" / "node-a" / "attempt-2.log"
    assert run.failure_report().parent == run.worker_errors().parent == run.logs


def test_checkpoints_are_where_the_saved_config_says(tmp_path):
    from liandan.config import ConfigError

    run = RunDir(tmp_path / "r")
    assert RunDir.from_saved_config(run.path).checkpoints == run.path / "checkpoints"  # no config saved
    run.path.mkdir()
    run.write_config(f'[checkpoint]\ndir = "{tmp_path / "elsewhere"}"\n')
    assert RunDir.from_saved_config(run.path).checkpoints == tmp_path / "elsewhere"
    run.write_config("[checkpoint\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        RunDir.from_saved_config(run.path)


def test_a_summary_that_must_be_there_says_what_is_wrong_with_it(tmp_path):
    run = RunDir(tmp_path)
    with pytest.raises(FileNotFoundError):
        run.load_summary()
    for text, why in (('{"steps": 4', "not valid JSON"), ("[4]", "expected a JSON object")):
        run.summary.write_text(text)
        with pytest.raises(ValueError, match=why):
            run.load_summary()
        assert run.read_summary() == {}  # the tolerant reader gives nothing instead
    run.summary.write_bytes(b"\xff")
    with pytest.raises(ValueError, match="not UTF-8 text"):
        run.load_summary()


def test_whole_file_readers_skip_a_half_written_last_line(tmp_path):
    """A run killed mid-write leaves a cut-off last line: the incident timeline used to fail on it, and now
    reads past it; a last record that is whole but lacks its newline still counts."""
    from liandan.resilience.incidents import read_events, timeline

    run = RunDir(tmp_path)
    run.events.write_text('{"time": 1.0, "kind": "restart", "attempt": 1, "after_seconds": 0}\n{"time": 2.0, "ki')
    assert [e["kind"] for e in read_events(tmp_path)] == ["restart"]
    assert len(timeline(tmp_path)) == 1
    run.metrics.write_text('{"step": 1, "loss": 2.5}\n{"step": 2, "loss": 2.25}')
    assert [r["step"] for r in run.read_metrics()] == [1, 2]


def test_the_run_directory_is_output_dir_and_the_run_name(tmp_path):
    from liandan.config import load_config

    named = load_config(None, [f"--run.output_dir={tmp_path}", "--run.name=r1"])
    assert named.run_dir("tiny") == tmp_path / "r1"
    unnamed = load_config(None, [f"--run.output_dir={tmp_path}"])
    drawn = unnamed.run_dir("tiny")
    assert (
        drawn.parent == tmp_path and drawn.name.startswith("tiny-") and len(drawn.name) == len("tiny-20260101-120000")
    )
