"""What a run shows of its evaluation as it trains: greedy samples of `[eval] samples` at the `[eval]` steps,
the validation loss of each source of a mixture as `val/<source>/loss` curves, and the mixture in the
report's header."""

from __future__ import annotations

import json

import pytest

from helpers import liandan_here, read_run, tiny_config
from liandan.data import ByteTokenizer, Document, shard_path, write_manifest, write_shard
from liandan.evaluate.loading import load_for_eval
from liandan.evaluate.scoring import generate
from liandan.train import Trainer

SAMPLES = ["The ", "def "]


def _store(directory, docs):
    write_manifest(directory, [write_shard(docs, ByteTokenizer(), shard_path(directory, 0))], ByteTokenizer())
    return directory


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    """Six steps on a mixture of prose and of a scrape that is mostly backslashes (far easier to predict), with
    validation and evaluation every three steps."""
    from pydoc_data.topics import topics

    root = tmp_path_factory.mktemp("mixture")
    pages = [(name, topics[name]) for name in sorted(topics)]
    prose = _store(root / "prose", [Document("pydoc", n, t) for n, t in pages[:60]])
    scrape = _store(root / "scrape", [Document("scrape", n, t[:200] + "\\" * 3000) for n, t in pages[60:120]])
    cfg = tiny_config(root, root / "unused", f"--data.stores={json.dumps([str(prose), str(scrape)])}",
                      "--data.weights=[3, 1]", "--data.paths=[]", "--data.val_fraction=0.1", "--train.eval_every=3",
                      "--eval.every=3", "--eval.heldout_sequences=0", "--eval.contamination=false",
                      f"--eval.samples={json.dumps(SAMPLES)}", "--eval.sample_tokens=12", "--checkpoint.every=6",
                      "--checkpoint.async_save=false", '--track.exporters=["tensorboard"]')  # fmt: skip
    trainer = Trainer(cfg, say=lambda m: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer.run_dir


def test_samples_are_logged_at_each_eval_step(mixture_run):
    samples = read_run(mixture_run).of_kind("eval_sample")
    assert [(e["step"], e["prompt"]) for e in samples] == [(3, "The "), (3, "def "), (6, "The "), (6, "def ")]
    # the last ones are the greedy continuations of the final checkpoint's model
    model, tokenizer, _ = load_for_eval(mixture_run)
    prompts = tokenizer.encode_batch(SAMPLES)
    expected = generate(model, prompts, max_new_tokens=12, eos_id=tokenizer.eos_id)
    assert [e["text"] for e in samples[2:]] == [tokenizer.decode(ids) for ids in expected]


def test_each_source_of_the_mixture_has_its_validation_curve(mixture_run):
    run = read_run(mixture_run)
    by_source = {(r["step"], k): v for r in run.metrics for k, v in r.items() if k.startswith("val/")}
    assert set(by_source) == {(s, f"val/{n}/loss") for s in (3, 6) for n in ("prose", "scrape")}
    for step in (3, 6):
        prose, scrape = by_source[(step, "val/prose/loss")], by_source[(step, "val/scrape/loss")]
        assert scrape < prose  # the backslashes are learnt at once
        mixture = next(e["loss"] for e in run.of_kind("eval") if e["step"] == step)
        assert scrape < mixture < prose  # the mixture's windows are the two sources' together


def test_the_exporters_get_the_curves_of_the_sources(mixture_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from liandan.run import RunDir

    logged = EventAccumulator(str(RunDir(mixture_run).tensorboard), size_guidance={"scalars": 0}).Reload()
    metrics = read_run(mixture_run).metrics
    for source in ("prose", "scrape"):
        curve = {e.step: e.value for e in logged.Scalars(f"val/{source}/loss")}
        expected = {r["step"]: r[f"val/{source}/loss"] for r in metrics if f"val/{source}/loss" in r}
        assert list(curve) == [3, 6] and curve == pytest.approx(expected, rel=1e-6)


def test_the_report_names_the_mixture_and_shows_the_samples(mixture_run, tmp_path):
    out = tmp_path / "report.html"
    done = liandan_here("report", mixture_run, "--output", out)
    assert done.returncode == 0, done.stderr
    html = out.read_text()
    assert "<th>mixture</th><td>prose 75%, scrape 25%</td>" in html
    assert "eval_sample" in html and "def " in html
