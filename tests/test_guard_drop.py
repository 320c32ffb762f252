"""Too good to be true: the guard names a source of a mixture whose loss collapses toward zero, and shows the
tokens the model over-predicts; a clean mixture trained the same way raises nothing."""

import json

import pytest

from helpers import tiny_config
from liandan.data import ByteTokenizer, Document, shard_path, write_manifest, write_shard
from liandan.train import Trainer
from liandan.train.guard.rules import SourceWatch

STEPS = 40
BACKSLASH = ByteTokenizer().encode_batch(["\\"])[0][0]


def _topics():
    from pydoc_data.topics import topics

    return [(name, topics[name]) for name in sorted(topics)]


def _store(directory, docs):
    write_manifest(directory, [write_shard(docs, ByteTokenizer(), shard_path(directory, 0))], ByteTokenizer())
    return directory


@pytest.fixture(scope="module")
def mixtures(tmp_path_factory):
    """A clean store of prose, and as the second store either more prose or a scrape whose escaping went wrong:
    each page's text followed by thousands of stray backslashes."""
    root, topics = tmp_path_factory.mktemp("mixtures"), _topics()
    clean = _store(root / "prose", [Document("pydoc", name, text) for name, text in topics[:60]])
    more = _store(root / "more", [Document("pydoc", name, text) for name, text in topics[60:]])
    flood = _store(root / "scrape", [Document("scrape", name, text[:300] + "\\" * 4000) for name, text in topics[60:]])
    return {"clean": [clean, more], "flood": [clean, flood]}


def _train(run_dir, stores):
    cfg = tiny_config(run_dir, run_dir / "unused", f"--train.steps={STEPS}", "--train.global_batch=16",
                      "--optim.lr=1e-2", "--schedule.kind=constant", f"--data.stores={json.dumps([str(s) for s in stores])}",
                      "--data.weights=[0.75, 0.25]")  # fmt: skip
    trainer = Trainer(cfg, say=lambda message: None)
    try:
        trainer.train()
    finally:
        trainer.close()
    events = [json.loads(line) for line in (trainer.run_dir / "events.jsonl").read_text().splitlines()]
    return trainer.run_dir, events


def test_a_backslash_flood_is_too_good_to_be_true(tmp_path, mixtures):
    run_dir, events = _train(tmp_path, mixtures["flood"])
    warned = [e for e in events if e["kind"] == "too_good"]
    assert warned, "no too-good-to-be-true warning for a store of stray backslashes"
    first = warned[0]
    assert "source scrape" in first["detail"] and "prose" not in first["detail"]
    assert first["tokens"][0] == "\\"
    guard = [e for e in events if e["kind"] == "guard" and "drop" in e["detectors"]]
    assert guard and guard[0]["action"] == "warn"

    report = json.loads((run_dir / "guard" / f"drop-step-{first['step']:08d}.json").read_text())
    easiest = report["easiest_tokens"][0]
    assert easiest["id"] == BACKSLASH and easiest["text"] == "\\"
    assert easiest["mean_loss"] < 0.05
    assert easiest["share"] > 0.1 and easiest["predicted_share"] >= easiest["share"] * 0.9
    assert report["source_losses"]["scrape"] < 0.05 < report["source_losses"]["prose"]
    assert any(doc["store"] == "scrape" for doc in report["documents"])


def test_a_clean_mixture_of_the_same_length_raises_no_warning(tmp_path, mixtures):
    run_dir, events = _train(tmp_path, mixtures["clean"])
    assert not [e for e in events if e["kind"] in ("too_good", "guard")]
    assert not list((run_dir / "guard").glob("drop-*.json")) if (run_dir / "guard").exists() else True
    assert [e for e in events if e["kind"] == "train_end"]


def _parts(**losses):
    return {name: (loss * 8, 8.0) for name, loss in losses.items()}


def _watch(**overrides):
    settings = {"size": 100, "warmup": 10, "mads": 8.0, "floor": 0.05, "factor": 4.0, "persist": 2, **overrides}
    return SourceWatch(**settings)


def test_one_source_collapsing_alone_is_named_and_a_shared_fall_is_not():
    watch, found = _watch(), []
    for step in range(1, 31):  # both fall together, by a factor of 3 over the stretch
        level = 6.0 * 0.965**step
        found += watch.judge(step, _parts(web=level * (1 + 0.02 * (step % 3)), books=level * 0.9))
    assert not found
    for step in range(31, 34):  # books collapse by a factor of 10 in a few steps; the web goes on as before
        found += watch.judge(step, _parts(web=6.0 * 0.965**step, books=0.25))
    assert [began for began, _ in found] == [31]
    assert "source books" in found[0][1] and "collapsing alone" in found[0][1]
    # The other source's ratio to a collapsed rest leaps; it is not taken for too good.
    assert "web" not in found[0][1]


def test_a_source_below_the_floor_is_named_once_per_window_and_missing_steps_do_not_break_it():
    watch, found = _watch(), []
    for step in range(1, 6):
        found += watch.judge(step, _parts(web=3.0, flood=0.01))
    assert [began for began, _ in found] == [1]  # named when its streak reached two steps, once
    found.clear()
    watch.judge(6, {"web": (24.0, 8.0), "flood": (0.0, 0.0)})  # no flood sequence in this batch
    for step in range(7, 110):
        found += watch.judge(step, _parts(web=3.0, flood=0.8 if step % 7 == 0 else 0.01))
    assert [began for began, _ in found] == [106]  # quiet for the window of 100 steps, then named again

    restored = _watch()
    restored.load_state_dict(json.loads(json.dumps(watch.state_dict())))
    assert restored.state_dict() == watch.state_dict()


def test_disabled_per_source_rules_judge_nothing():
    watch = _watch(floor=0.0, factor=0.0)
    assert not [f for step in range(1, 40) for f in watch.judge(step, _parts(web=3.0, flood=0.001 * step))]


@pytest.mark.slow
def test_two_ranks_agree_on_a_collapsing_source(tmp_path, mixtures):
    """The per-source losses of both FSDP ranks go into the guard's one shared vector: the flood is named once,
    by the run, and both ranks carry on together."""
    from helpers import read_run, run_liandan

    stores = json.dumps([str(s) for s in mixtures["flood"]])
    cfg = tiny_config(tmp_path, tmp_path / "unused", f"--train.steps={STEPS}", "--train.global_batch=16",
                      "--optim.lr=1e-2", "--schedule.kind=constant", f"--data.stores={stores}",
                      "--data.weights=[0.75, 0.25]", "--run.name=ranks", "--data.paths=[]")  # fmt: skip
    config = tmp_path / "flood.toml"
    config.write_text(cfg.to_toml())
    done = run_liandan("train", config, "--nproc=2", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(tmp_path / "ranks")
    warned = records.of_kind("too_good")
    assert warned and "source scrape" in warned[0]["detail"] and warned[0]["tokens"][0] == "\\"
    assert [m["step"] for m in records.metrics] == list(range(1, STEPS + 1))
