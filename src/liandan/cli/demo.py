"""`liandan demo`: the whole system on a laptop CPU in a few minutes, on text that ships with Python.

Runs the data pipeline's stages on the corpus (normalize, language tags, PII redaction, repetition filter,
exact and verified near dedup, a byte-level BPE, a token store and an inspection report), poisons one batch of
the store (a copy in which that batch's documents are random tokens), trains a small Llama on the copy with
document masking, validation and verified checkpoints on two processes (FSDP2) under the supervisor, after the
preflight doctor has checked every rank's devices and collectives and with silent-data-corruption checks on,
which survives a rank killed on purpose part-way (it resumes from the in-memory snapshot of that very step),
while the loss-spike guard rolls back the poisoned batch and names its documents and a live forecast predicts
the final loss early, then samples from the final checkpoint, exports it for `transformers` and says where
everything is.
"""

from __future__ import annotations

import json
import sys
from datetime import datetime
from pathlib import Path

import torch

from liandan.checkpoint.loading import load_model
from liandan.cli.report_cmd import make_report
from liandan.config import load_config
from liandan.data.tokens.store import TokenStore
from liandan.resilience.incidents import timeline
from liandan.run import RunDir, step_dir_name
from liandan.run.worker_env import WorkerEnv

# A model that learns visibly in a few CPU minutes: ~3.5M parameters, 256-token sequences.
DEMO_SETTINGS = [
    "--model.dim=192",
    "--model.n_layers=4",
    "--model.n_heads=6",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=256",
    "--model.tie_embeddings=true",
    "--model.qk_norm=true",
    "--optim.lr=2e-3",
    "--optim.weight_decay=0.1",
    "--schedule.kind=wsd",
    "--schedule.warmup_steps=30",
    "--train.steps=300",
    "--train.global_batch=16",
    "--train.seq_len=256",
    "--train.eval_every=50",
    "--data.tokenizer=bpe",
    "--data.bpe_vocab_size=4096",
    "--checkpoint.every=100",
    "--checkpoint.memory_every=1",
    "--forecast.every=60",
]
NPROC = 2


def prepare_data(data: list[str] | None, out: Path, vocab_size: int) -> dict:
    """The data pipeline over the user's files (or Python's documentation), into a token store at `out`."""
    from liandan.cli.data_cmd import print_summary
    from liandan.data.documents.corpus import write_python_docs
    from liandan.data.pipeline.layout import PipelineLayout
    from liandan.data.pipeline.pipeline import run_pipeline
    from liandan.data.pipeline.pipeline_config import InputSpec, PipelineConfig, PipelineSection, TokenizerSection

    if data:
        paths = data_files(data)
    else:
        corpus = PipelineLayout(out).python_docs
        stats = write_python_docs(corpus)
        print(f"wrote the Python documentation corpus (pydoc topics + stdlib docstrings): {stats.summary()}")
        paths = [str(corpus)]
    cfg = PipelineConfig(
        pipeline=PipelineSection(output=str(out), workers=2),
        inputs=[InputSpec(name="corpus", paths=paths, txt_mode="paragraph")],
        steps=[{"name": "normalize"}, {"name": "language"}, {"name": "pii"}, {"name": "gopher_repetition"}],
        tokenizer=TokenizerSection(vocab_size=vocab_size),
    )
    cfg.check()
    summary = run_pipeline(cfg).summary
    print_summary(summary)
    return summary


def data_files(given: list[str]) -> list[str]:
    """The files of `--data`: a directory stands for the data files directly in it, sorted by name."""
    from liandan.data.documents.readers import files_in_directory

    files = []
    for name in given:
        path = Path(name).resolve()
        if not path.is_dir():
            files.append(str(path))  # the pipeline says so when it is missing
            continue
        files += [str(p) for p in files_in_directory(path, f"--data {name}")]
    return files


def run_demo(data: list[str] | None, steps: int | None, output_dir: Path, overrides: list[str]) -> int:
    name = f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    settings = list(DEMO_SETTINGS)
    if steps is not None:
        settings.append(f"--train.steps={steps}")
        settings.append(f"--train.eval_every={max(1, steps // 6)}")
        settings.append(f"--schedule.warmup_steps={min(30, max(1, steps // 10))}")
        settings.append(f"--checkpoint.every={max(1, steps // 3)}")
        settings.append(f"--forecast.every={max(1, steps // 5)}")
    # checks --steps and the overrides before any data is written
    vocab_size = load_config(None, settings + overrides).data.bpe_vocab_size
    data_summary = prepare_data(data, output_dir / f"{name}-data", vocab_size)
    store = Path(next(iter(data_summary["stores"].values()))["path"])  # one input, so one store
    settings.append(f"--run.output_dir={output_dir}")
    settings.append(f"--run.name={name}")
    cfg = load_config(None, settings + overrides)
    trained_on = poison_batch(cfg, store, kill_step(cfg))
    cfg = load_config(None, [*settings, "--data.stores=" + json.dumps([str(trained_on)]), *overrides])
    run = cfg.run_dir(name)  # run.name is set: the run directory is the demo's name
    code = train_supervised(cfg, run)
    if code != 0:
        return code
    room = RunDir.of(run, cfg.checkpoint.dir)
    s = room.read_summary()
    records = room.read_metrics()
    # null: not a number; records without a loss are an evaluation's, beside the step's own
    losses = [r["loss"] if r["loss"] is not None else float("nan") for r in records if "loss" in r]
    print()
    print(
        f"trained {s['parameters'] / 1e6:.1f}M parameters for {s['steps']} steps on {NPROC} processes"
        f" ({s['layout']}, {s['dtype']}); goodput {100 * s['goodput']:.1f}% with {s['restarts']} restart(s)"
    )
    val_loss = s["val_loss"] if s["val_loss"] is not None else float("nan")
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}; validation loss {val_loss:.3f}")
    show_early_forecast(room, records)
    print("incidents (liandan incidents <run>):")
    for line in timeline(run, triaged=True):
        print(f"  {line}")
    model, _ = load_model(room.checkpoints / step_dir_name(s["steps"]))
    tokenizer = TokenStore(store).tokenizer
    prompt = "The for statement"
    print(f"\nsample, prompted with {prompt!r}:\n  {sample(model, tokenizer, prompt)!r}\n")
    show_checkpoints(run)
    export_for_transformers(model, run, store / "tokenizer.json")
    evaluate_briefly(model, tokenizer, run, cfg.eval.data_dir)
    report = make_report([run])[0]
    data_dir = Path(data_summary["output"])
    print(f"data directory: {data_dir}")
    for name, what in [
        ("clean/", "cleaned documents, and every dropped record with its step and reason (*.rejects.jsonl.zst)"),
        ("dedup/", "which documents exact and near dedup removed, and their clusters"),
        ("state/", "each stage's done marker with its statistics: a rerun resumes after the last one"),
        ("stores/corpus/", "the token store: shards with self-describing headers, provenance, manifest, tokenizer"),
        ("stores/corpus-poisoned/", "the store trained on: the same, with the documents of one batch made noise"),
        ("report/report.html", "the inspection report: distributions, repeated lines, anomaly flags"),
        ("summary.json", "what every stage did"),
    ]:
        if (data_dir / name).exists():
            print(f"  {name:22s} {what}")
    print(f"run directory: {run}")
    for name, what in [
        ("config.toml", "the resolved run config"),
        ("metrics.jsonl", "loss, grad norm, lr, tokens/s, MFU, memory, step time per step"),
        ("events.jsonl", "run events and validation losses"),
        ("summary.json", "the run's totals"),
        ("training.png", "loss, learning rate and throughput curves, incidents marked"),
        ("report.html", "the run in one self-contained page to share (liandan report <run>)"),
        ("doctor.json", "the preflight doctor's report: every rank's devices, collectives, disk (liandan doctor)"),
        ("checkpoints/", "sharded, verified checkpoints (liandan ckpt info <run>/checkpoints)"),
        ("guard/", "the loss-spike guard's reports (liandan incidents <run>; liandan skipped <run>)"),
        ("hf/", "the final model for Hugging Face transformers (LlamaForCausalLM + tokenizer)"),
    ]:
        if (run / name).exists():
            print(f"  {name:22s} {what}")
    print(f"\nsee it in the dashboard:  liandan dash {output_dir}")
    print(f"share it as one page:     liandan report {run}   (written: {report})")
    return 0


def show_early_forecast(room: RunDir, records: list[dict]) -> None:
    """The earliest live forecast of the final loss against what the run then measured."""
    from liandan.plan.forecast import measured_final_loss

    forecasts = sorted((e for e in room.read_events() if e.get("kind") == "forecast"), key=lambda e: e["step"])
    trained = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    if not forecasts or not trained:
        return
    f = forecasts[0]
    measured = measured_final_loss([s for s, _ in trained], [x for _, x in trained])
    print(
        f"forecast of the final loss from step {f['step']} ({100 * f['observed_fraction']:.0f}% of the run):"
        f" {f['final_loss']:.3f}, {round(100 * f['confidence'])}% interval [{f['low']:.3f}, {f['high']:.3f}]"
        f" (a plain power law: {f['power_law']:.3f}); measured {measured:.3f}"
    )


def kill_step(cfg) -> int:
    """The step after which rank 1 is killed: 40% of the way."""
    return max(1, cfg.train.steps * 2 // 5)


def train_supervised(cfg, run: Path) -> int:
    """Train on NPROC processes under the supervisor, with rank 1 killed after `kill_step`."""
    from liandan.resilience.supervisor import Supervisor

    run.mkdir(parents=True, exist_ok=True)
    config = run / "launch.toml"
    config.write_text(cfg.to_toml())
    fault_step = kill_step(cfg)
    print(
        f"training on {NPROC} processes under the supervisor; rank 1 will be killed (SIGKILL) after step {fault_step}"
    )
    worker = [sys.executable, "-m", "liandan.cli", "train", str(config), f"--nproc={NPROC}", f"--run.name={run.name}"]
    fault = WorkerEnv(faults=f"kill@step:{fault_step}:1").to_env()  # handed to the first attempt only
    return Supervisor(cfg, worker, run, nproc=NPROC, attempt_env=lambda number: fault).run()


def poison_batch(cfg, store: Path, before: int) -> Path:
    """The store to train on: where the guard can judge a batch before the kill, a copy of `store` next to it
    with the documents of that batch turned into noise for the guard to roll back and name; else `store`."""
    from liandan.data.tokens.poison import poison_store

    data_step = poison_step(cfg, before)
    if data_step is None:
        return store
    poisoned = store.with_name(store.name + "-poisoned")
    t = cfg.train
    refs = poison_store(store, poisoned, data_step, seq_len=t.seq_len, global_batch=t.global_batch,
                        seed=cfg.run.seed, val_fraction=cfg.data.val_fraction)  # fmt: skip
    print(f"poisoned data step {data_step}: its {len(refs)} document(s) are random tokens in {poisoned};"
          f" the guard should roll back step {data_step + 1}, which trains on them, and name them")  # fmt: skip
    return poisoned


def poison_step(cfg, before: int) -> int | None:
    """A data step to poison: step s + 1 trains on data step s, so its spike shows in the loss of step s + 1.
    That step comes once the guard has judged a few steps past its warmup, with a state kept in its ring a few
    steps before, and before the kill, so that the first attempt meets it. None where the run is too short for
    that."""
    g = cfg.guard
    if not g.enabled:
        return None
    data_step = max(g.warmup + 10, g.ring_every + 5)
    return data_step if data_step + 1 < before else None


def evaluate_briefly(model, tokenizer, run: Path, data_dir: str, items: int = 10, max_len: int = 128) -> None:
    """A few items of the English next-line cloze under every prompt format, on the final model: its spread line
    (a model this small is near chance; the point is that one number would hide the spread)."""
    import time

    from liandan.config import ConfigError
    from liandan.evaluate.runner import run_task
    from liandan.evaluate.tasks import load_tasks

    started = time.perf_counter()
    try:
        (task,) = load_tasks(["cloze_en"], data_dir)
    except ConfigError as err:  # the shared corpus is not where [eval] data_dir says
        print(f"evaluation skipped: {err}\n")
        return
    result = run_task(model, tokenizer, task, limit=items, max_len=min(max_len, model.args.max_seq_len))
    print(
        f"evaluation of the final model on {result.n} items of cloze_en under {len(result.scores)} prompt formats"
        f" ({time.perf_counter() - started:.1f}s; more: liandan eval {run} --tasks cloze_en,cloze_zh,gsm8k):"
    )
    print(f"  {result.spread_line()}\n")  # fmt: skip


def show_checkpoints(run: Path) -> None:
    from liandan.checkpoint.info import describe_checkpoint

    print("checkpoints:")
    for path in RunDir(run).checkpoint_steps():
        info = describe_checkpoint(path)
        status = "verified" if info["verified"] else f"NOT VERIFIED ({info['error']})"
        print(f"  {path.name}: step {info['step']}, {info['bytes'] / 2**20:.1f} MiB, {status}")


def export_for_transformers(model, run: Path, tokenizer: Path) -> None:
    from liandan.checkpoint.hf import export_hf

    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    export_hf(state, model.args, run / "hf", tokenizer_json=tokenizer if tokenizer.is_file() else None)
    print(f"exported for transformers: AutoModelForCausalLM.from_pretrained('{run / 'hf'}')\n")


@torch.no_grad()
def sample(model, tokenizer, prompt: str, new_tokens: int = 40, temperature: float = 0.8, seed: int = 0) -> str:
    """A short continuation from the trained model (one process, CPU), seeded for repeatability."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode_batch([prompt])[0]
    limit = model.args.max_seq_len
    for _ in range(new_tokens):
        x = torch.tensor([ids[-limit:]])
        logits = model(x)[0, -1].float() / temperature
        next_id = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
        if next_id == tokenizer.eos_id:
            break
        ids.append(next_id)
    return tokenizer.decode(ids)
