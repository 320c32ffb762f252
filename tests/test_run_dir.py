"""The run room: atomic writes that leave the old file on failure, strict JSON, readers that follow a file
being written, and step-directory names."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from liandan.run import (
    JsonlTail,
    RunDir,
    atomic_write,
    atomic_write_json,
    dumps_json,
    parse_step_dir,
    read_jsonl,
    step_dir_name,
)


def test_atomic_write_replaces_whole_or_not_at_all(tmp_path):
    path = tmp_path / "summary.json"
    atomic_write_json(path, {"tokens": 1})
    assert json.loads(path.read_text()) == {"tokens": 1}
    (tmp_path / ".summary.json.tmp").mkdir()  # the temporary cannot be written: the write fails
    with pytest.raises(IsADirectoryError, match="summary.json.tmp"):
        atomic_write(path, "{}")
    assert json.loads(path.read_text()) == {"tokens": 1}


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
