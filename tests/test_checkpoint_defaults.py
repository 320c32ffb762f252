"""Checkpoints on by default: a save at the end of every run and at a time interval unless turned off, and a
one-line way to get a checkpoint from every command that needs one."""

import pytest

from helpers import run_liandan, tiny_config, write_corpus
from liandan.checkpoint.verify import complete_checkpoints
from liandan.train.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _train(tmp_path, corpus, *overrides):
    trainer = Trainer(tiny_config(tmp_path / "runs", corpus, *overrides), say=lambda m: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    return tmp_path / "runs" / "run"


def _saved_steps(run_dir):
    return [int(p.name.removeprefix("step-")) for p in complete_checkpoints(run_dir / "checkpoints")]


def test_a_run_saves_its_last_step_with_no_checkpoint_settings(tmp_path, corpus):
    assert _saved_steps(_train(tmp_path, corpus, "--train.steps=3")) == [3]


def test_checkpoints_can_be_turned_off_entirely(tmp_path, corpus):
    run = _train(tmp_path, corpus, "--train.steps=3", "--checkpoint.enabled=false", "--checkpoint.every=1")
    assert not (run / "checkpoints").exists() or _saved_steps(run) == []


def test_a_step_interval_without_the_end(tmp_path, corpus):
    run = _train(tmp_path, corpus, "--train.steps=5", "--checkpoint.every=2", "--checkpoint.at_end=false",
                 "--checkpoint.keep_last=0")  # fmt: skip
    assert _saved_steps(run) == [2, 4]


def test_the_time_interval_saves_steps_between_the_step_interval(tmp_path, corpus):
    # an interval shorter than any step: every step is due by the clock
    run = _train(tmp_path, corpus, "--train.steps=4", "--checkpoint.every_minutes=1e-6", "--checkpoint.keep_last=0")
    assert _saved_steps(run) == [1, 2, 3, 4]


@pytest.mark.slow
def test_ranks_agree_on_the_time_interval(tmp_path, corpus):
    """Rank 0's clock decides for both ranks: each save is collective, so a disagreement would hang or fail."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", corpus, "--train.steps=4", "--checkpoint.every_minutes=1e-6",
                                  "--checkpoint.keep_last=0", "--resilience.supervise=false").to_toml())  # fmt: skip
    done = run_liandan("train", config, "--nproc=2", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _saved_steps(tmp_path / "runs" / "run") == [1, 2, 3, 4]


@pytest.mark.parametrize("command", [["export"], ["ckpt", "info"], ["eval"]])
def test_commands_that_need_a_checkpoint_say_how_to_get_one(tmp_path, corpus, command):
    run = _train(tmp_path, corpus, "--train.steps=2", "--checkpoint.enabled=false")
    extra = {"export": [str(tmp_path / "out"), "--hf"], "eval": ["--tasks=cloze_en"]}.get(command[0], [])
    done = run_liandan(*command, run, *extra, timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no checkpoint" in lines[0] and "enabled = false" in lines[0], done.stderr
