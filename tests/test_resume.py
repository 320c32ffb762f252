"""The one resume decision (`choose_resume`) over real step directories with real manifests, and the claim of
a run directory that asks it before anything is verified (`can_resume`)."""

from pathlib import Path

import pytest

from liandan.checkpoint.loading import newest_verified
from liandan.checkpoint.resume import ResumePoint, can_resume, choose_resume
from liandan.checkpoint.verify import step_of, write_manifest
from liandan.run import RunDir, step_dir_name


def _save(root: Path, step: int) -> Path:
    path = root / step_dir_name(step)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(64)) * step)
    write_manifest(path)
    return path


@pytest.fixture
def room(tmp_path):
    return RunDir(tmp_path / "run")


def _decide(room: RunDir, memory_step: int | None) -> tuple[ResumePoint, list[int]]:
    """The decision, and each time it asked for the newest checkpoint that verifies."""
    asked = []

    def verified():
        asked.append(1)
        return newest_verified(room.checkpoints)

    complete = room.complete_checkpoints()
    return choose_resume(memory_step, step_of(complete[-1]) if complete else None, verified), asked


def test_a_snapshot_at_least_as_new_as_the_newest_checkpoint_wins_without_reading_one(room):
    _save(room.checkpoints, 4)
    for memory in (4, 6):
        point, asked = _decide(room, memory)
        assert point == ResumePoint("memory", memory) and asked == []


def test_a_snapshot_older_than_the_newest_checkpoint_loses_to_it(room):
    _save(room.checkpoints, 4)
    newest = _save(room.checkpoints, 8)
    point, asked = _decide(room, 6)
    assert point == ResumePoint("checkpoint", 8, newest) and asked == [1]


def test_an_unverifiable_newest_checkpoint_falls_back_to_the_older_one_or_the_snapshot(room):
    older = _save(room.checkpoints, 4)
    damaged = _save(room.checkpoints, 8)
    (damaged / "__0_0.distcp").write_bytes(b"changed")
    assert _decide(room, None)[0] == ResumePoint("checkpoint", 4, older)
    assert _decide(room, 2)[0] == ResumePoint("checkpoint", 4, older)
    assert _decide(room, 6)[0] == ResumePoint("memory", 6)  # newer than every checkpoint that verifies


def test_nothing_to_resume_from_starts_at_step_0(room):
    assert _decide(room, None)[0] == ResumePoint("none", 0)
    damaged = _save(room.checkpoints, 4)
    (damaged / "__0_0.distcp").unlink()
    assert _decide(room, None)[0] == ResumePoint("none", 0)


def test_claiming_a_run_directory_asks_the_same_decision_before_verifying(room):
    assert not can_resume(room.complete_checkpoints(), None)
    assert can_resume(room.complete_checkpoints(), 3)  # a snapshot in host memory alone
    room.checkpoints.mkdir(parents=True)
    (room.checkpoints / "step-00000002.tmp").mkdir()  # a save cut short is nothing to resume from
    (room.checkpoints / step_dir_name(3)).mkdir()  # nor a step directory without its manifest
    assert not can_resume(room.complete_checkpoints(), None)
    _save(room.checkpoints, 4)
    assert can_resume(room.complete_checkpoints(), None)
    assert [p.name for p in room.partial_saves()] == ["step-00000002.tmp"]
    assert [p.name for p in room.checkpoint_steps()] == ["step-00000003", "step-00000004"]
