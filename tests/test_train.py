import itertools
import json
import math
import signal
from pathlib import Path

import pytest
import torch

from helpers import environment_without, read_metrics, read_run, start_liandan, tiny_config, write_corpus
from liandan.common.schedule import lr_multiplier
from liandan.config import ConfigError, ScheduleSection
from liandan.data import DataError
from liandan.model import ModelArgs, Transformer
from liandan.train import Trainer
from liandan.train.hardware import cpu_supports_bf16
from liandan.train.optimizers.adamw import parameter_groups
from liandan.train.optimizers.container import clip_grad_norm


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
    for _ in range(60):  # below 0.03 by then (0.08 at step 40): the model memorises, not merely improves
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
    # no checkpoint: the rerun below has nothing to resume from
    _trainer, result = run(tmp_path, corpus, "--train.eval_every=3", "--track.plot=true", "--checkpoint.enabled=false")
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


def _strict_json(text):
    """JSON as the standard has it: NaN and Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_a_diverging_run_writes_only_valid_json(tmp_path, corpus):
    # A learning rate this large is finite, so the config takes it, but the loss is no longer a number by step 3.
    _, result = run(tmp_path, corpus, "--optim.lr=1e30", "--schedule.warmup_steps=0", "--train.eval_every=3",
                    "--guard.enabled=false")  # fmt: skip
    assert not math.isfinite(result.losses[-1]) and not math.isfinite(result.val_loss)
    run_dir = result.run_dir
    records = [_strict_json(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["loss"] is None  # non-finite numbers are written as null
    events = [_strict_json(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["loss"] for e in events if e["kind"] == "eval"] == [None, None]
    assert any(e["kind"] == "nonfinite_loss" for e in events)
    summary = _strict_json((run_dir / "summary.json").read_text())
    assert summary["final_loss"] is None and summary["val_loss"] is None and summary["steps"] == 6


def test_a_run_refused_at_start_up_does_not_block_the_corrected_rerun(tmp_path, corpus):
    with pytest.raises(DataError, match="2 mixture weights for 1 token stores"):
        run(tmp_path, corpus, "--data.weights=[1.0, 2.0]")
    _, result = run(tmp_path, corpus)
    assert result.steps == 6 and len(result.losses) == 6


def test_a_resumed_run_counts_the_tokens_of_every_kept_step(tmp_path, corpus):
    """A second `train` with more steps resumes the run: its summary (what `liandan fit` reads as D) and its
    checkpoint count the tokens of all 8 steps, not only the 4 this invocation trained."""
    tokens_per_step = 4 * 64
    _, first = run(tmp_path, corpus, "--train.steps=4", "--checkpoint.every=2", name="resumed")
    assert first.summary["tokens"] == 4 * tokens_per_step
    with open(first.run_dir / "metrics.jsonl", "a") as metrics:
        metrics.write('{"step": 5, "loss": 5.')  # a record a full disk cut short: dropped on resume, not fatal
    _, second = run(tmp_path, corpus, "--train.steps=8", "--checkpoint.every=2", name="resumed")
    summary = json.loads((second.run_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["tokens"] == second.tokens == 8 * tokens_per_step
    assert summary["first_step"] == 4 and summary["tokens_per_s"] == pytest.approx(4 * tokens_per_step / second.seconds)
    meta = json.loads((second.run_dir / "checkpoints" / "step-00000008" / "meta.json").read_text())
    assert meta["tokens"] == 8 * tokens_per_step
    assert [r["step"] for r in read_metrics(second.run_dir)] == list(range(1, 9))


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
    short_docs.write_text(
        "".join(json.dumps({"text": f"document number {i} says {'hi ' * i}"}) + "\n" for i in range(300))
    )
    _, doc = run(tmp_path, short_docs, "--train.mask=document", name="doc")
    trainer, causal = run(tmp_path, short_docs, "--train.mask=causal", name="causal")
    assert trainer.loader.next_step(4)[0].doc_ids.max() > 0  # sequences do span documents
    assert doc.losses[0] == causal.losses[0] or doc.losses != causal.losses
    assert doc.losses != causal.losses


@pytest.mark.skipif(not cpu_supports_bf16(), reason="this CPU has no native bf16")
def test_bf16_autocast_tracks_fp32(tmp_path, corpus):
    trainer, bf16 = run(tmp_path, corpus, "--train.dtype=bf16", name="bf16")
    _, fp32 = run(tmp_path, corpus, name="fp32")
    assert trainer.module.autocast and trainer.env.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in trainer.module.model.parameters())  # fp32 master weights
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
    assert {names[id(p)] for p in no_decay} >= {
        "tok_embeddings.weight",
        "norm.weight",
        "layers.0.attention.q_norm.weight",
    }
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


def _unsupervised(tmp_path, corpus, name, *overrides):
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", corpus, "--train.steps=200", "--checkpoint.every=0",
                                  "--resilience.supervise=false", *overrides).to_toml())  # fmt: skip
    return start_liandan("train", config, f"--run.name={name}", env=environment_without())


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_worker_told_to_stop_saves_its_step_and_exits_128_plus_signal(tmp_path, corpus, signum):
    """`liandan train` in one process, no supervisor: SIGTERM or SIGINT lets the step finish, saves a
    checkpoint of it (even with periodic checkpoints off) and exits 128 + signum, rather than dying mid-write."""
    from helpers import wait_for_step
    from liandan.checkpoint.verify import complete_checkpoints, verify

    proc = _unsupervised(tmp_path, corpus, "stop")
    run_dir = tmp_path / "runs" / "stop"
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-3000:]
    [saved] = complete_checkpoints(run_dir / "checkpoints")
    verify(saved, checksums=True)
    step = int(saved.name[5:])
    logged = [record["step"] for record in read_metrics(run_dir)]
    assert step >= 2 and logged[-1] == step
    [preempted] = read_run(run_dir).of_kind("preempted")
    assert preempted["signal"] == signum.name and preempted["step"] == step
    said = f"liandan: stopped by {signum.name} at step {step}; checkpoint {saved}; the next run resumes there"
    assert err.strip().splitlines()[-1] == said
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_preemption_with_no_time_left_says_so_and_tries_all_the_same(tmp_path, corpus):
    """A grace period of 0 s: nothing fits, which one line and the `preemption_plan` event say; the worker
    still saves its step (the estimate may be wrong) and exits 143."""
    from helpers import wait_for_step

    proc = _unsupervised(tmp_path, corpus, "no-time", "--resilience.preempt_grace_s=0")
    run_dir = tmp_path / "runs" / "no-time"
    wait_for_step(run_dir, 2, proc)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    [plan] = [e for e in events if e["kind"] == "preemption_plan"]
    [preempted] = [e for e in events if e["kind"] == "preempted"]
    assert not plan["fits"] and plan["plan"] == "finish" and plan["step"] == preempted["step"]
    said = [line for line in out.splitlines() if line.startswith("preemption: SIGTERM: ")]
    expected = (f"preemption: SIGTERM: saving step {plan['step']} ({plan['finish_s']:.1f}s) does not fit in the"
                " 0.0s of grace left; trying to finish all the same")  # fmt: skip
    assert said == [expected]
    assert preempted["checkpoint"] and Path(preempted["checkpoint"], "manifest.json").is_file()


@pytest.mark.slow
def test_a_worker_signalled_before_its_first_step_exits_at_once(tmp_path, corpus):
    """Nothing to save yet: the worker ends promptly with 143, no traceback, no checkpoint."""
    import time

    proc = _unsupervised(tmp_path, corpus, "early")
    deadline = time.time() + 120
    while not (tmp_path / "runs" / "early" / "heartbeat").is_dir():  # the trainer has started
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "stopped by SIGTERM before the first step" in err
    assert not (tmp_path / "runs" / "early" / "checkpoints").exists() or not any(
        (tmp_path / "runs" / "early" / "checkpoints").glob("step-*/manifest.json")
    )


@pytest.mark.parametrize(
    ("left_s", "finish_s", "fallback_s", "fallback_step", "choice", "fits"),
    [
        (5.0, 3.0, 1.0, 4, "finish", True),  # the step ends and is saved in time
        (2.0, 3.0, 1.0, 4, "fall back", True),  # only the step before can be saved in time
        (0.5, 3.0, 1.0, 4, "fall back", False),  # nothing fits: the cheaper plan
        (0.5, 1.0, 3.0, 4, "finish", False),
        (0.5, 3.0, float("inf"), -1, "finish", False),  # nothing to fall back on
    ],
)
def test_a_preemption_plan_finishes_falls_back_or_says_nothing_fits(left_s, finish_s, fallback_s, fallback_step,
                                                                     choice, fits):  # fmt: skip
    from liandan.train.preemption import Plan

    plan = Plan(signal.SIGTERM, left_s, finish_s, fallback_s, fallback_step)
    assert (plan.choice, plan.fits) == (choice, fits)


def test_a_global_batch_the_ranks_cannot_split_is_refused_before_any_worker_starts(tmp_path, corpus):
    from helpers import run_liandan

    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", corpus, "--train.global_batch=4").to_toml())
    done = run_liandan("train", config, "--nproc=3", timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "liandan: error: train.global_batch = 4 must split evenly over the 3 data-parallel ranks (a multiple of 3)"
    ]
    assert not (tmp_path / "runs").exists()  # no run directory claimed, no data tokenized


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_asked_for_where_there_is_none_is_one_user_error_the_supervisor_does_not_restart(tmp_path, corpus):
    from helpers import run_liandan

    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", corpus, "--run.device=cuda").to_toml())
    done = run_liandan("train", config, timeout=300)  # under the supervisor
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert errors == [
        "liandan: error: run.device = 'cuda' but no CUDA device is available; use --run.device=cpu or auto"
    ]
    assert "Traceback" not in done.stderr and "restart" not in done.stderr


def test_a_run_that_ends_in_order_leaves_no_lock_file(tmp_path, corpus):
    from helpers import run_liandan

    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", corpus, "--train.steps=2", "--schedule.warmup_steps=1").to_toml())
    done = run_liandan("train", config, timeout=300)  # under the supervisor, which holds the lock
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "runs" / "run" / "summary.json").is_file()
    assert not (tmp_path / "runs" / "run" / "run.lock").exists()


def test_a_rollback_ring_larger_than_host_memory_is_refused_at_start(tmp_path, corpus):
    from liandan.train.rollback import available_host_memory, ring_refusal

    with pytest.raises(ConfigError, match=r"guard.ring_size = 1000000 keeps that many copies .* at most \d+ fit"):
        Trainer(tiny_config(tmp_path, corpus, "--guard.ring_size=1000000"), say=lambda m: None)
    assert available_host_memory() > 0
    assert ring_refusal(3, 10**6, 10**9, 2) is None  # the default ring of a small model fits
    assert "not even one fits" in ring_refusal(1, 10**9, 10**9, 2)


def test_a_ring_state_is_weighed_by_the_optimizer_state_each_parameter_keeps():
    from liandan.model.llama import ModelArgs, Transformer
    from liandan.model.roles import parameter_roles
    from liandan.train.optimizers import optimizer_plugin
    from liandan.train.rollback import state_bytes

    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    numel = {role: 0 for role in ("embedding", "head", "hidden", "vector")}
    for r in parameter_roles(model):
        numel[r.role] += r.param.numel()
    total = sum(numel.values())
    assert state_bytes([model]) == 12 * total  # fp32 weights and two moments of each
    assert state_bytes([model], optimizer_plugin("adamw").state_bytes) == 12 * total
    # Muon keeps one momentum per hidden-matrix parameter, AdamW's two for the rest
    assert state_bytes([model], optimizer_plugin("muon").state_bytes) == 12 * total - 4 * numel["hidden"]
