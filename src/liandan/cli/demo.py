"""`liandan demo`: the whole system on a laptop CPU in a few minutes, on text that ships with Python.

Runs the data pipeline on the corpus (normalize, language tags, repetition filter, exact and near dedup, a
byte-level BPE, a token store and an inspection report), trains a small Llama on the store with document
masking, validation and verified checkpoints, then samples from it, exports it for `transformers` and says
where everything is.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import torch

from liandan.config import load_config

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
]


def prepare_data(data: list[str] | None, out: Path, vocab_size: int) -> dict:
    """The data pipeline over the user's files (or Python's documentation), into a token store at `out`."""
    from liandan.cli.data_cmd import print_summary
    from liandan.data.corpus import ReadStats, python_docs_corpus
    from liandan.data.pipeline import run_pipeline
    from liandan.data.pipeline_config import InputSpec, PipelineConfig, PipelineSection, TokenizerSection

    if data:
        paths = [str(Path(p).resolve()) for p in data]
    else:
        raw = out / "raw" / "python-docs.jsonl"
        raw.parent.mkdir(parents=True, exist_ok=True)
        stats = ReadStats()
        with raw.open("w", encoding="utf-8") as handle:
            for doc in python_docs_corpus(stats):
                handle.write(json.dumps({"id": doc.doc_id, "text": doc.text}, ensure_ascii=False) + "\n")
        print(f"wrote the Python documentation corpus (pydoc topics + stdlib docstrings): {stats.summary()}")
        paths = [str(raw)]
    cfg = PipelineConfig(
        pipeline=PipelineSection(output=str(out), workers=2),
        inputs=[InputSpec(name="corpus", paths=paths, txt_mode="paragraph")],
        steps=[{"name": "normalize"}, {"name": "language"}, {"name": "gopher_repetition"}],
        tokenizer=TokenizerSection(vocab_size=vocab_size),
    )
    cfg.check()
    summary = run_pipeline(cfg).summary
    print_summary(summary)
    return summary


def run_demo(data: list[str] | None, steps: int | None, output_dir: Path, overrides: list[str]) -> int:
    from liandan.train import Trainer

    name = f"demo-{datetime.now().strftime('%Y%m%d-%H%M%S')}"
    settings = list(DEMO_SETTINGS)
    vocab_size = load_config(None, settings + overrides).data.bpe_vocab_size  # checks the overrides, too
    data_summary = prepare_data(data, output_dir / f"{name}-data", vocab_size)
    settings.append("--data.stores=" + json.dumps([s["path"] for s in data_summary["stores"].values()]))
    if steps is not None:
        settings.append(f"--train.steps={steps}")
        settings.append(f"--train.eval_every={max(1, steps // 6)}")
        settings.append(f"--schedule.warmup_steps={min(30, max(1, steps // 10))}")
        settings.append(f"--checkpoint.every={max(1, steps // 3)}")
    settings.append(f"--run.output_dir={output_dir}")
    settings.append(f"--run.name={name}")
    cfg = load_config(None, settings + overrides)

    trainer = Trainer(cfg, config_name="demo")
    result = trainer.train()
    s = result.summary
    print()
    print(
        f"trained {s['parameters'] / 1e6:.1f}M parameters for {s['steps']} steps on {s['tokens']:,} tokens"
        f" in {s['seconds']:.0f}s ({s['tokens_per_s']:,.0f} tokens/s, {s['dtype']})"
    )
    print(f"loss {result.losses[0]:.3f} -> {s['final_loss']:.3f}; validation loss {s['val_loss']:.3f}")
    prompt = "The for statement"
    print(f"\nsample, prompted with {prompt!r}:\n  {sample(trainer, prompt)!r}\n")
    run = result.run_dir
    show_checkpoints(run)
    store = Path(next(iter(data_summary["stores"].values()))["path"])
    export_for_transformers(trainer, run, store / "tokenizer.json")
    data_dir = Path(data_summary["output"])
    print(f"data directory: {data_dir}")
    for name, what in [
        ("clean/", "cleaned documents, and every dropped record with its step and reason (*.rejects.jsonl.zst)"),
        ("dedup/stats.json", "exact and near duplicates found"),
        ("stores/corpus/", "the token store: shards with self-describing headers, provenance, manifest, tokenizer"),
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
        ("training.png", "loss, learning rate and throughput curves"),
        ("checkpoints/", "sharded, verified checkpoints (liandan ckpt info <run>/checkpoints)"),
        ("hf/", "the final model for Hugging Face transformers (LlamaForCausalLM + tokenizer)"),
    ]:
        if (run / name).exists():
            print(f"  {name:22s} {what}")
    return 0


def show_checkpoints(run: Path) -> None:
    from liandan.checkpoint.manager import describe_checkpoint

    print("checkpoints:")
    for path in sorted((run / "checkpoints").glob("step-*")):
        info = describe_checkpoint(path)
        status = "verified" if info["verified"] else f"NOT VERIFIED ({info['error']})"
        print(f"  {path.name}: step {info['step']}, {info['bytes'] / 2**20:.1f} MiB, {status}")


def export_for_transformers(trainer, run: Path, tokenizer: Path) -> None:
    from liandan.checkpoint.hf import export_hf

    state = {k: v.detach().cpu() for k, v in trainer.model.state_dict().items()}
    export_hf(state, trainer.model_args, run / "hf", tokenizer_json=tokenizer if tokenizer.is_file() else None)
    print(f"exported for transformers: AutoModelForCausalLM.from_pretrained('{run / 'hf'}')\n")


@torch.no_grad()
def sample(trainer, prompt: str, new_tokens: int = 40, temperature: float = 0.8, seed: int = 0) -> str:
    """A short continuation from the trained model (single process), seeded for repeatability."""
    model, tokenizer = trainer.model, trainer.tokenizer
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    ids = tokenizer.encode_batch([prompt])[0]
    limit = trainer.model_args.max_seq_len
    for _ in range(new_tokens):
        x = torch.tensor([ids[-limit:]], device=trainer.device)
        with trainer._autocast():
            logits = model(x)[0, -1].float() / temperature
        next_id = int(torch.multinomial(logits.softmax(-1).cpu(), 1, generator=generator))
        if next_id == tokenizer.eos_id:
            break
        ids.append(next_id)
    return tokenizer.decode(ids)
