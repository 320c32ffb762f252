import itertools
import json
import math

import pytest
import torch

from helpers import read_run, tiny_config, write_corpus
from liandan.config import ConfigError, ScheduleSection
from liandan.model import ModelArgs, Transformer
from liandan.spec.schedule import lr_multiplier
from liandan.train import Trainer
from liandan.train.hardware import cpu_supports_bf16
from liandan.train.optim import clip_grad_norm, parameter_groups


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def run(tmp_path, corpus, *overrides, name="run"):
    cfg = tiny_config(tmp_path, corpus, f"--run.name={name}", *overrides)
    trainer = Trainer(cfg, say=lambda msg: None)
    return trainer, trainer.train()


def test_tiny_model_overfits_a_batch():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=64, n_layers=2, n_heads=4, max_seq_len=32))
    tokens = torch.randint(0, 64, (4, 33))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(150):
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[0] > 3.5  # about ln(64) at init
    assert losses[-1] < 0.1


def test_same_seed_same_loss_curve_bit_for_bit(tmp_path, corpus):
    _, a = run(tmp_path, corpus, name="a")
    _, b = run(tmp_path, corpus, name="b")
    _, c = run(tmp_path, corpus, "--run.seed=99", name="c")
    assert len(a.losses) == 6
    assert a.losses == b.losses  # exact float equality
    assert a.losses != c.losses


def test_run_directory_contents(tmp_path, corpus):
    _trainer, result = run(tmp_path, corpus, "--train.eval_every=3")
    run_dir = result.run_dir
    recorded = read_run(run_dir)
    records = recorded.metrics
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "peak_mem_gib", "step_time_s"):
        assert all(math.isfinite(r[key]) and r[key] >= 0 for r in records), key
    assert 0 < records[-1]["mfu"] < 1
    assert records[-1]["loss"] < records[0]["loss"]
    assert [e["step"] for e in recorded.of_kind("eval")] == [3, 6]
    summary = recorded.summary
    assert summary["steps"] == 6 and summary["tokens"] == 6 * 4 * 64
    assert summary["val_loss"] == pytest.approx(result.val_loss)
    assert (run_dir / "training.png").stat().st_size > 10_000
    assert "dim = 64" in (run_dir / "config.toml").read_text()
    # reusing the directory is refused unless asked for
    with pytest.raises(ConfigError, match="already holds a run"):
        Trainer(tiny_config(tmp_path, corpus, "--run.name=run"), say=lambda m: None)


def test_gradient_accumulation_matches_full_batch(tmp_path, corpus):
    _, full = run(tmp_path, corpus, name="full")
    _, accumulated = run(tmp_path, corpus, "--train.micro_batch=1", name="acc")
    assert accumulated.losses == pytest.approx(full.losses, rel=1e-5)


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_activation_checkpointing_changes_no_numbers(tmp_path, corpus, mode):
    _, plain = run(tmp_path, corpus, name="plain")
    _, recomputed = run(tmp_path, corpus, f"--train.activation_checkpoint={mode}", name=mode)
    assert recomputed.losses == pytest.approx(plain.losses, rel=1e-6)


def test_document_mask_changes_training(tmp_path):
    short_docs = tmp_path / "short.jsonl"
    short_docs.write_text("".join(json.dumps({"text": f"document number {i} says {'hi ' * i}"}) + "\n" for i in range(300)))
    _, doc = run(tmp_path, short_docs, "--train.mask=document", name="doc")
    trainer, causal = run(tmp_path, short_docs, "--train.mask=causal", name="causal")
    assert trainer.loader.next_step(4)[0].doc_ids.max() > 0  # sequences do span documents
    assert doc.losses[0] == causal.losses[0] or doc.losses != causal.losses
    assert doc.losses != causal.losses


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")
def test_bf16_autocast_tracks_fp32(tmp_path, corpus):
    trainer, bf16 = run(tmp_path, corpus, "--train.dtype=bf16", name="bf16")
    _, fp32 = run(tmp_path, corpus, name="fp32")
    assert trainer.autocast and trainer.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master weights
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], abs=2e-2)
    assert bf16.losses[-1] < bf16.losses[0]


def test_compiled_blocks_match_eager(tmp_path, corpus):
    _, eager = run(tmp_path, corpus, name="eager")
    _, compiled = run(tmp_path, corpus, "--train.compile=true", name="compiled")
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-4)


def test_schedules():
    def curve(**kw):
        cfg = ScheduleSection(**kw)
        return [lr_multiplier(s, 100, cfg) for s in range(100)]

    cos = curve(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert cos[0] == pytest.approx(0.1) and cos[9] == pytest.approx(1.0)
    assert cos[10] == pytest.approx(1.0) and cos[-1] == pytest.approx(0.1)
    assert cos[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 89)))
    assert all(x >= y for x, y in itertools.pairwise(cos[10:]))
    lin = curve(kind="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert lin[0] == 1.0 and lin[-1] == pytest.approx(0.0)
    assert lin[50] == pytest.approx(1 - 50 / 99)
    wsd = curve(kind="wsd", warmup_steps=5, decay_fraction=0.2, min_lr_ratio=0.0)
    assert wsd[5:80] == [1.0] * 75
    # 1-sqrt cooldown over the last 20 steps
    assert wsd[80] == pytest.approx(1 - math.sqrt(1 / 20))
    assert wsd[89] == pytest.approx(1 - math.sqrt(10 / 20))
    assert wsd[-1] == pytest.approx(0.0)
    assert curve(kind="constant", warmup_steps=0)[-1] == 1.0


def test_no_weight_decay_on_norms_and_embeddings():
    model = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, qk_norm=True))
    decay, no_decay = parameter_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert sorted(names[id(p)] for p in decay) == sorted(
        n for n, p in model.named_parameters() if p.dim() == 2 and "tok_embeddings" not in n
    )
    assert {names[id(p)] for p in no_decay} >= {"tok_embeddings.weight", "norm.weight", "layers.0.attention.q_norm.weight"}
    everything, _ = parameter_groups(model, decay_norms_and_embeddings=True)
    assert len(everything) == len(list(model.parameters()))
    tied = Transformer(ModelArgs(vocab_size=32, dim=16, n_layers=1, n_heads=2, tie_embeddings=True))
    decay, no_decay = parameter_groups(tied)
    assert sum(p is tied.tok_embeddings.weight for p in decay + no_decay) == 1


def test_clip_grad_norm_matches_torch():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(5, 3)) for _ in range(3)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p) * 3
        q.grad = p.grad.clone()
    ours = clip_grad_norm(a, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(b, 1.0)
    assert ours == pytest.approx(float(theirs), rel=1e-6)
    for p, q in zip(a, b):
        torch.testing.assert_close(p.grad, q.grad)
    assert clip_grad_norm(a, float("inf")) == pytest.approx(1.0, rel=1e-4)
