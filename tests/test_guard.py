"""The loss-spike guard on real runs: a poisoned batch, a learning-rate burst, a gradient corrupted on one rank,
NaN gradients, a diverging learning rate, clean runs, and a kill in the middle of a rollback window."""

from __future__ import annotations

import json
import math
import os
import random
import string
from pathlib import Path

import pytest
import torch

from helpers import faults_planned, liandan_here, read_run, run_liandan, tiny_config, write_corpus
from liandan import faults
from liandan.checkpoint.ring import StateRing, restore
from liandan.config import load_config
from liandan.data.pipeline.prepare import prepare_store
from liandan.data.tokens.loader import PackedLoader
from liandan.train import Trainer
from liandan.train.guard.rules import Rule

STEPS = 60
# A byte-level model that learns in 60 steps, with batches large enough that its loss is not mostly noise.
GUARDED = [f"--train.steps={STEPS}", "--optim.lr=3e-3", "--train.global_batch=16", "--guard.ring_every=10",
           "--guard.stats_every=20", f"--train.eval_every={STEPS}", "--train.eval_batches=8"]  # fmt: skip
TOLERANCE = 0.15  # nats: how close a guarded run's final validation loss stays to the clean run's
POISONED_DATA_STEP = 30  # the batch of step 31


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Python's language-reference topics cut into short documents, so that one batch draws on a few dozen
    documents and poisoning them all leaves the rest of the corpus as it was."""
    out = tmp_path_factory.mktemp("guard-corpus")
    whole = write_corpus(out, 200)
    path = out / "short.jsonl"
    with whole.open() as src, path.open("w") as dst:
        for line in src:
            record = json.loads(line)
            text = record["text"]
            for k in range(0, len(text), 300):
                dst.write(json.dumps({"id": f"{record['id']}-{k // 300}", "text": text[k : k + 300]}) + "\n")
    return path


def train(out, corpus, *overrides, fault="", name="run"):
    """An in-process run with `fault` in $LIANDAN_FAULTS; returns (result, what the run directory holds)."""
    with faults_planned(fault):
        trainer = Trainer(tiny_config(out, corpus, f"--run.name={name}", *GUARDED, *overrides), say=lambda m: None)
        try:
            result = trainer.train()
        finally:
            trainer.close()
    return result, read_run(result.run_dir)


@pytest.fixture(scope="module")
def clean(tmp_path_factory, corpus):
    return train(tmp_path_factory.mktemp("guard-clean"), corpus)


@pytest.fixture(scope="module")
def poisoned(tmp_path_factory, corpus):
    """The corpus with every document of one batch rewritten as noise of the same length (so every other
    batch is what it was), and the ids of those documents."""
    out = tmp_path_factory.mktemp("guard-poison")
    cfg = tiny_config(out, corpus, *GUARDED)
    store, _ = prepare_store(cfg.data, out / "probe-store", say=lambda m: None)
    t = cfg.train
    loader = PackedLoader(store, t.seq_len, t.global_batch, cfg.run.seed, cfg.data.val_fraction)
    refs = loader.documents_for_step(POISONED_DATA_STEP)
    shard = store.shards[0]
    lengths = {ref.doc_id: int((shard.tokens[shard.doc_starts[ref.document] : shard.doc_starts[ref.document + 1]]
                                < 256).sum()) for ref in refs}  # fmt: skip
    rng = random.Random(0)
    (out / "poisoned").mkdir()
    path = out / "poisoned" / corpus.name
    with corpus.open() as src, path.open("w") as dst:
        for line in src:
            record = json.loads(line)
            if record["id"] in lengths:
                record["text"] = "".join(rng.choice(string.ascii_letters + string.punctuation)
                                         for _ in range(lengths[record["id"]]))  # fmt: skip
            dst.write(json.dumps(record) + "\n")
    return path, {(ref.source.replace(str(corpus), str(path)), ref.doc_id) for ref in refs}


def config_file(out, corpus):
    path = out / "guarded.toml"
    path.write_text(tiny_config(out, corpus, *GUARDED).to_toml())
    return path


def _final_val(records) -> float:
    return [e["loss"] for e in records.of_kind("eval")][-1]


def test_a_clean_run_raises_no_alarm(clean):
    result, records = clean
    assert records.of_kind("guard") == [] and records.of_kind("rollback") == []
    assert math.isfinite(_final_val(records)) and len(result.losses) == STEPS


def test_a_poisoned_batch_is_rolled_back_skipped_and_its_documents_named(tmp_path, poisoned, clean):
    path, injected = poisoned
    result, records = train(tmp_path, path)
    [rollback] = records.of_kind("rollback")
    assert rollback["step"] == POISONED_DATA_STEP + 1  # detected on the step that trained on it, before its update
    assert rollback["to"] == 20 and rollback["skipped"] == [20, POISONED_DATA_STEP + 1]
    assert rollback["culprit_data_steps"] == [POISONED_DATA_STEP] and rollback["reproduced"] is True
    report = json.loads((result.run_dir / "guard" / f"spike-step-{rollback['step']:08d}.json").read_text())
    assert {(d["source"], d["id"]) for d in report["documents"]} == injected
    assert report["verdict"].startswith("bad data")
    assert len(result.losses) == STEPS and [m["step"] for m in records.metrics] == list(range(1, STEPS + 1))
    assert abs(_final_val(records) - _final_val(clean[1])) < TOLERANCE


@pytest.mark.slow
def test_two_fsdp_ranks_roll_back_a_poisoned_batch_together(tmp_path, poisoned):
    path, injected = poisoned
    done = run_liandan("train", config_file(tmp_path, path), "--nproc=2", "--run.name=fsdp", timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(tmp_path / "fsdp")
    [rollback] = records.of_kind("rollback")
    assert (rollback["step"], rollback["to"], rollback["culprit_data_steps"]) == (31, 20, [POISONED_DATA_STEP])
    report = json.loads(Path(rollback["report"]).read_text())
    assert {(d["source"], d["id"]) for d in report["documents"]} == injected
    assert [m["step"] for m in records.metrics] == list(range(1, STEPS + 1))


def test_a_learning_rate_burst_is_rolled_back_and_found_not_reproducible(tmp_path, corpus, clean):
    _, records = train(tmp_path, corpus, fault="burst@update:30")
    [rollback] = records.of_kind("rollback")
    assert rollback["began"] in (31, 32) and rollback["step"] <= 33  # the burst's update is step 30's
    assert rollback["to"] == 20 and rollback["culprit_data_steps"] == [] and rollback["reproduced"] is False
    assert abs(_final_val(records) - _final_val(clean[1])) < TOLERANCE


def test_a_rollback_goes_to_a_newer_durable_checkpoint_than_any_state_in_memory(tmp_path, corpus):
    """With the ring keeping only the start, the checkpoint of step 25 is the newest state from before the
    burst's spike: the guard loads it and goes on from there as from a state in memory."""
    _, records = train(tmp_path, corpus, "--guard.ring_every=100", "--checkpoint.every=5", fault="burst@update:30")
    [rollback] = records.of_kind("rollback")
    assert rollback["to"] == 25 and rollback["from"].endswith("step-00000025")
    assert rollback["skipped"] == [25, rollback["step"]]
    assert [m["step"] for m in records.metrics] == list(range(1, STEPS + 1))
    timeline = liandan_here("incidents", records.path, check=True).stdout
    assert "back to step 25 (checkpoint step-00000025)" in timeline, timeline


def test_kill_in_a_rollback_window_then_resume_equals_the_uninterrupted_run(tmp_path, corpus):
    """The burst's rollback lowers the learning rate for 20 steps; a kill in that window and a resume from the
    checkpoint inside it gives the same loss curve, bit for bit, as the run that was not killed. Saves are
    synchronous here: a background save of step 35 still being written when step 37 is killed would be lost (as
    it should), and the resume would come from step 30, which is not what this test is about."""
    args = ["train", config_file(tmp_path, corpus), "--guard.lr_factor=0.5", "--guard.lr_steps=20",
            "--checkpoint.every=5", "--checkpoint.async_save=false", "--resilience.supervise=false"]  # fmt: skip

    def liandan(name, fault, expect):
        env = {k: v for k, v in os.environ.items() if k != faults.ENV}
        if fault:
            env[faults.ENV] = fault
        done = run_liandan(*args, f"--run.name={name}", env=env, timeout=300)
        assert done.returncode == expect, done.stderr[-3000:]
        return read_run(tmp_path / name)

    whole = liandan("whole", "burst@update:30", 0)
    killed = liandan("killed", "burst@update:30,kill@step:37", -9)
    assert killed.of_kind("rollback") and not killed.summary
    resumed = liandan("killed", "", 0)
    assert [e["step"] for e in resumed.of_kind("resumed")] == [35]
    assert [m["loss"] for m in resumed.metrics] == [m["loss"] for m in whole.metrics]
    assert [m.get("lr_scale") for m in resumed.metrics] == [m.get("lr_scale") for m in whole.metrics]
    assert {m.get("lr_scale") for m in whole.metrics} == {None, 0.5}


@pytest.mark.slow
def test_a_gradient_corrupted_on_one_rank_and_nan_gradients_never_reach_the_weights(tmp_path, corpus, clean):
    """Two data-parallel replicas (DDP): rank 1's gradients turn NaN at step 25 and rank 0's blow up at step 35,
    after the gradient sync, so the other rank saw nothing wrong. The NaN update is skipped everywhere; the
    explosion, with `on_grad = "rollback"`, rolls both ranks back to step 30 and skips the batches since. The
    silent-data-corruption checks are off: they would see the ranks' gradient norms differ first."""
    from liandan.checkpoint.loading import load_model

    args = ["train", config_file(tmp_path, corpus), "--nproc=2", "--parallel.dp_replicate=2",
            "--parallel.dp_shard=1", "--checkpoint.every=60", "--run.name=ranks", "--guard.on_grad=rollback",
            "--health.sdc=false"]  # fmt: skip
    env = {**{k: v for k, v in os.environ.items() if k != faults.ENV}, faults.ENV: "nan@grad:25:1,spike@grad:35:0"}
    done = run_liandan(*args, env=env, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(tmp_path / "ranks")
    acted = [(e["step"], e["action"], e["detectors"]) for e in records.of_kind("guard")]
    assert acted == [(25, "skip", ["nonfinite"]), (35, "rollback", ["grad"])]
    [rollback] = records.of_kind("rollback")
    assert rollback["to"] == 30 and rollback["skipped"] == [30, 35] and rollback["reproduced"] is False
    assert [m["step"] for m in records.metrics if m.get("update_skipped")] == [25]
    assert [m["step"] for m in records.metrics] == list(range(1, STEPS + 1))
    model, _ = load_model(tmp_path / "ranks" / "checkpoints" / "step-00000060")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert abs(_final_val(records) - _final_val(clean[1])) < TOLERANCE


def test_a_diverging_learning_rate_finishes_with_the_guard(tmp_path, corpus):
    # Adam keeps this tiny model stable far past any sensible learning rate; 10 without clipping is not.
    hot = ["--optim.lr=10", "--schedule.kind=constant", "--schedule.warmup_steps=40", "--optim.grad_clip=0",
           "--guard.warmup=10"]  # fmt: skip
    result, records = train(tmp_path, corpus, *hot, "--guard.enabled=false", name="unguarded")
    first = records.metrics[0]["loss"]
    final = _final_val(records)
    assert not math.isfinite(final) or final > first, "the learning rate does not diverge without the guard"
    result, records = train(tmp_path, corpus, *hot, "--guard.lr_factor=0.3", "--guard.max_rollbacks=6", name="guarded")
    assert records.of_kind("rollback") and math.isfinite(_final_val(records)) and _final_val(records) < first - 1
    assert len(result.losses) == STEPS


def test_early_divergence_is_rolled_back_to_the_start_at_a_lower_learning_rate(tmp_path, corpus):
    """A learning rate far too high blows the loss up in the first steps, before the spike rule has a history to
    judge by: rolled back to step 0 on the same batches at a lower rate, as often as it takes, and the run ends
    far below the one left alone."""
    hot = ["--train.steps=30", "--train.eval_every=30", "--optim.lr=1.0", "--schedule.warmup_steps=0"]
    unguarded, _ = train(tmp_path, corpus, *hot, "--guard.enabled=false", name="unguarded")
    guarded, records = train(tmp_path, corpus, *hot, "--guard.max_rollbacks=6", name="guarded")
    rollbacks = records.of_kind("rollback")
    assert rollbacks and all(r["detectors"] == ["diverge"] and r["to"] == 0 for r in rollbacks), rollbacks
    assert [r["skipped"] for r in rollbacks] == [[0, 0]] * len(rollbacks)  # the data was not to blame
    assert [r["lr_scale"] for r in rollbacks] == pytest.approx([0.3**k for k in range(1, len(rollbacks) + 1)])
    assert all(r["lr_until"] is None for r in rollbacks)
    assert records.metrics[-1]["lr_scale"] == rollbacks[-1]["lr_scale"]
    # How far the run left alone recovers by step 30 depends on the CPU's arithmetic (3.59-3.66 on some
    # machines, where a margin of 1.0 failed); the guarded run ends near 3.08.
    assert len(guarded.losses) == 30 and guarded.losses[-1] < unguarded.losses[-1] - 0.3


def test_a_shipped_learning_rate_is_never_taken_for_early_divergence(tmp_path, corpus):
    """configs/tiny.toml's optimizer and schedule on the small model, through its fast first fall, all of it
    under the early-divergence rule (fewer steps than the guard's window): no warning, no rollback."""
    shipped = ["--train.steps=50", "--train.eval_every=0", "--optim.lr=2e-3", "--schedule.warmup_steps=30",
               "--schedule.kind=cosine", "--optim.weight_decay=0.1", "--model.z_loss=1e-4"]  # fmt: skip
    result, records = train(tmp_path, corpus, *shipped)
    assert records.of_kind("guard") == [] and records.of_kind("rollback") == []
    assert len(result.losses) == 50 and result.losses[-1] < result.losses[0] - 1.0


def test_a_rollback_decided_just_before_a_crash_is_carried_out_after_the_restart(tmp_path, poisoned):
    """Rank 0 is killed after the step that trained on the poisoned batch, once its rollback is decided and before
    it is carried out. The supervisor resumes from the snapshot before that step (none is taken of a step being
    rolled back); the step comes again, and with only the resumed state in memory the guard rolls back to it."""
    path, _ = poisoned
    kill = f"kill@step:{POISONED_DATA_STEP + 1}"
    env = {**{k: v for k, v in os.environ.items() if k != faults.ENV}, faults.ENV: kill}
    done = run_liandan("train", config_file(tmp_path, path), "--run.name=killed", "--checkpoint.memory_every=1",
                       env=env, timeout=400)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    records = read_run(tmp_path / "killed")
    [incident] = records.of_kind("incident")
    assert incident["step"] == POISONED_DATA_STEP + 1 and incident["resume_step"] == POISONED_DATA_STEP
    [rollback] = records.of_kind("rollback")
    assert (rollback["step"], rollback["to"]) == (POISONED_DATA_STEP + 1, POISONED_DATA_STEP)
    assert rollback["skipped"] == [POISONED_DATA_STEP, POISONED_DATA_STEP + 1]
    assert rollback["culprit_data_steps"] == [POISONED_DATA_STEP]
    # decided before the crash, and again on the step's second coming: never skipped for want of a state
    assert [e["action"] for e in records.of_kind("guard")] == ["rollback", "rollback"]


def test_slow_logit_growth_only_warned_about_moves_the_level_and_a_jump_is_still_caught():
    from liandan.config.sections import GuardSection
    from liandan.train.guard.callback import GuardCallback

    def logit_findings(guard: GuardCallback, logits: list[float]) -> list[int]:
        return [
            n for n, x in enumerate(logits, 1) for kind, _, _ in guard._judge(n, 3.0, 1.0, x, 0.0) if kind == "logits"
        ]

    # A small model's largest logit leaves its first level within a few steps of the warm-up, then keeps
    # growing slowly (as in benchmarks/router_watch.py): warned about for a while, then the new level.
    growing = [1.0] * 20 + [2.5 * 1.002**k for k in range(480)]
    warned = logit_findings(GuardCallback(GuardSection()), growing)
    assert warned and max(warned) < 100
    # Under a policy that acts, a flagged value stays out of the history: the level holds, and so do the flags.
    acting = GuardCallback(GuardSection(on_logits="skip"))
    assert len(logit_findings(acting, growing)) == 480
    jump = [1.0] * 50 + [30.0]
    assert logit_findings(GuardCallback(GuardSection()), jump) == [51]


def test_early_divergence_allows_a_noisy_preference_loss_and_catches_its_climb():
    """A DPO-like loss (falling from ln 2 with batch-to-batch noise of a tenth of its level) raises nothing in the
    window of the early-divergence rule; the same loss climbing far above its level is caught."""
    from liandan.train.guard.rules import History, Rise

    draw = random.Random(7)
    # its first steps are ln 2 exactly: the policy is the reference while the learning rate warms up
    losses = [math.log(2)] * 10 + [max(0.05, 0.69 - 0.004 * i + draw.gauss(0, 0.06)) for i in range(80)]
    history = History(100)
    rise = Rise(history, until=100, rise=0.15, mads=5.0)
    fraction_only = Rise(history, until=100, rise=0.15)
    alarms, fraction_alarms = [], []
    for step, loss in enumerate(losses):
        verdict, fraction = rise.judge(loss), fraction_only.judge(loss)
        alarms += [step] if verdict and verdict.over else []
        fraction_alarms += [step] if fraction and fraction.over else []
        history.add(loss)
    assert alarms == [] and len(fraction_alarms) > 5  # the fraction alone took this noise for divergence
    verdict = rise.judge(1.4)  # twice ln 2: the policy now prefers the rejected replies
    assert verdict is not None and verdict.over


def test_under_dpo_the_loss_is_not_judged_and_the_rest_still_is():
    """A DPO run's loss (a few pairs a step) jumps between batches: the guard's loss rules stay out of it, while
    a non-finite value and an exploding gradient are still found."""
    from liandan.train.guard.callback import GuardCallback

    guard = GuardCallback(load_config(None, []).guard, judge_loss=False)
    draw = random.Random(3)
    findings = [guard._judge(n, max(0.05, 0.5 + draw.gauss(0, 0.15)), 1.0 + draw.random() / 10, 0, 0)
                for n in range(1, 60)]  # fmt: skip
    findings.append(guard._judge(60, 2.5, 1.0, 0, 0))  # five times the level: a spike of any pretraining loss
    assert all(found == [] for found in findings)
    assert [kind for kind, _, _ in guard._judge(61, 0.5, 500.0, 0, 0)] == ["grad"]
    assert [kind for kind, _, _ in guard._judge(62, math.nan, 1.0, 0, 0)] == ["nonfinite"]
    judged = GuardCallback(load_config(None, []).guard)
    for n in range(1, 60):
        judged._judge(n, 0.5 + 0.01 * (n % 3), 1.0, 0, 0)
    assert "spike" in [kind for kind, _, _ in judged._judge(60, 2.5, 1.0, 0, 0)]  # (and early divergence)


def test_rules_ignore_a_falling_trend_and_catch_a_jump():
    rule = Rule(size=100, warmup=10, mads=5, min_ratio=0.05)
    rng = random.Random(0)
    for i in range(40):
        value = 6.0 - 0.05 * i + rng.gauss(0, 0.02)
        verdict = rule.judge(value)
        assert verdict is None or not verdict.over, i
        rule.accept(value)
    assert rule.judge(4.0 + 1.0).over and not rule.judge(4.05).over


def test_state_ring_puts_model_and_optimizer_back_bit_for_bit():
    from liandan.model.llama import ModelArgs, Transformer

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2, max_seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ring = StateRing(2)
    tokens = torch.randint(0, 64, (2, 17))

    def step():
        model(tokens[:, :-1], tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad()

    ring.keep(0, model, optimizer, {"at": 0})
    step()
    ring.keep(1, model, optimizer, {"at": 1})
    after_one = {k: v.clone() for k, v in model.state_dict().items()}
    step()
    step()
    assert restore(ring.newest_at_or_before(1), model, optimizer) == {"at": 1}
    assert all(torch.equal(after_one[k], v) for k, v in model.state_dict().items())
    step()  # the optimizer state came back too: the same step as the first time round
    ring2 = {k: v.clone() for k, v in model.state_dict().items()}
    restore(ring.newest_at_or_before(1), model, optimizer)
    step()
    assert all(torch.equal(ring2[k], v) for k, v in model.state_dict().items())
    restore(ring.newest_at_or_before(0), model, optimizer)
    assert not optimizer.state  # kept before the first update: AdamW starts afresh


@pytest.mark.slow
def test_the_shipped_tiny_config_trains_without_a_false_alarm(tmp_path):
    """configs/tiny.toml through the fast fall of its first steps and past the peak of the learning rate, judged
    from step 11 on (the loss falls from 7.9 to 6.6 by step 18; the learning rate peaks at step 20 and decays to
    a tenth of it by step 40; a full 300-step run is recorded in docs/training.md; it is too slow for every test
    run). In this process, as the other runs here: a subprocess would add its start-up to the steps, which are
    the test."""
    config = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
    overrides = ["--train.steps=40", "--schedule.warmup_steps=20", "--train.eval_every=0",
                 f"--run.output_dir={tmp_path}", "--run.name=tiny", "--guard.warmup=10", "--guard.stats_every=20",
                 "--track.plot=false"]  # fmt: skip
    with faults_planned():
        trainer = Trainer(load_config(str(config), overrides), say=lambda m: None)
        try:
            result = trainer.train()
        finally:
            trainer.close()
    assert len(result.losses) == 40
    records = read_run(tmp_path / "tiny")
    assert records.of_kind("guard") == [] and records.of_kind("rollback") == []
    assert len((tmp_path / "tiny" / "guard" / "layers.jsonl").read_text().splitlines()) == 2
