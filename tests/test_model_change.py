"""A resume, an init_from or an export of a checkpoint of another model is refused in one line naming the key,
unless `checkpoint.allow_model_change` says the change is deliberate."""

import json

import pytest

from helpers import liandan_here, tiny_config, write_corpus
from liandan.checkpoint.verify import write_manifest
from liandan.config import ConfigError
from liandan.train.trainer import Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def _train(runs, corpus, *overrides):
    messages = []
    trainer = Trainer(tiny_config(runs, corpus, "--schedule.warmup_steps=1", *overrides), say=messages.append)
    try:
        trainer.train()
    finally:
        trainer.close()
    return messages


@pytest.mark.parametrize(("key", "before", "after"), [("n_layers", 4, 2), ("n_kv_heads", 2, 4), ("rope_theta", 10000.0, 500000.0)])  # fmt: skip
def test_a_resume_of_another_model_shape_is_refused(tmp_path, corpus, key, before, after):
    _train(tmp_path, corpus, "--train.steps=2", f"--model.{key}={before}")
    with pytest.raises(ConfigError, match=f"holds another model: model.{key} = {after} \\(checkpoint: {before}\\);"
                                          " to change the model on purpose, set checkpoint.allow_model_change"):  # fmt: skip
        _train(tmp_path, corpus, "--train.steps=4", f"--model.{key}={after}")


def test_a_deliberate_change_resumes_and_says_so(tmp_path, corpus):
    _train(tmp_path, corpus, "--train.steps=2", "--model.n_layers=4")
    said = _train(tmp_path, corpus, "--train.steps=4", "--model.n_layers=2", "--checkpoint.allow_model_change=true")
    assert any("model.n_layers = 2 (checkpoint: 4)" in m and "allow_model_change" in m for m in said), said
    assert any("resumed from" in m for m in said), said
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["differences"] for e in events if e["kind"] == "model_changed"] == [
        ["model.n_layers = 2 (checkpoint: 4)"]
    ]


def test_a_resume_from_a_memory_snapshot_of_another_model_is_refused(tmp_path, corpus, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    monkeypatch.setenv("LIANDAN_SNAPSHOT_OWNER", "sup-1")
    monkeypatch.setenv("LIANDAN_SNAPSHOT_DIR", str(shm))
    no_checkpoints = ("--checkpoint.enabled=false", "--checkpoint.memory_every=1")
    _train(tmp_path, corpus, "--train.steps=3", "--model.n_layers=4", *no_checkpoints)
    with pytest.raises(ConfigError, match=r"memory snapshot of step 2 .* holds another model: model.n_layers = 2"):
        _train(tmp_path, corpus, "--train.steps=4", "--model.n_layers=2", *no_checkpoints)


def test_an_export_whose_model_args_leave_tensors_out_is_refused(tmp_path, corpus):
    _train(tmp_path, corpus, "--train.steps=2", "--model.n_layers=4")
    [checkpoint] = (tmp_path / "run" / "checkpoints").iterdir()
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["model_args"]["n_layers"] = 2
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    write_manifest(checkpoint)  # consistent again: only the model_args disagree with the tensors
    done = liandan_here("export", checkpoint, tmp_path / "out.safetensors", "--consolidated")
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1, done.stderr
    assert "model tensor(s) that its model_args do not describe (layers.2." in lines[0], lines
