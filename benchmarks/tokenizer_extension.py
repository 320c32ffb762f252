"""Chinese from an English base: does extending the tokenizer pay after the same short continued pretraining?

    python benchmarks/tokenizer_extension.py --out runs/tokext

1. A byte-level BPE trained on the shared English alone (en-wikitext2), and a small Llama pretrained on it.
2. The tokenizer extended with tokens learned on the shared Chinese (`liandan tokenizer extend`), and the
   pretrained model grown to match (new rows from the old tokens' rows).
3. The same continued pretraining on English + Chinese (half each), twice, from the same weights: with the
   English tokenizer, and with the extended one (the same steps, batch and sequence length).
4. Held-out bits per byte on each source (tokenizer-independent), and characters per token on Chinese.

Each `liandan train` runs as a subprocess with one thread. Prints a table; `--json` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared" / "data" / "corpus"
MODEL = ["--model.llama.dim=128", "--model.llama.n_layers=4", "--model.llama.n_heads=4", "--model.llama.n_kv_heads=4",
         "--model.max_seq_len=128", "--train.seq_len=128", "--train.global_batch=16", "--train.dtype=fp32",
         "--doctor.preflight=false", "--track.plot=false", "--resilience.supervise=false",
         "--eval.heldout_sequences=64", "--data.val_fraction=0.05"]  # fmt: skip


def liandan(*args: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "liandan.cli", *args], check=False, env=env, text=True, capture_output=True
    )
    if done.returncode:
        sys.exit(f"liandan {' '.join(args[:3])} failed:\n{done.stderr[-3000:]}")


def stores(out: Path, tokenizer: Path) -> dict[str, Path]:
    """Token stores of en.jsonl and zh.jsonl under `tokenizer`: one per language, so each has its held-out split
    and its bits per byte."""
    from liandan.data.documents.corpus import Document
    from liandan.data.tokens.store import shard_path, write_manifest, write_shard
    from liandan.data.tokens.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    made = {}
    for language in ("en", "zh"):
        where = out / "stores" / tokenizer.stem / language
        texts = [json.loads(line)["text"] for line in (out / f"{language}.jsonl").read_text().splitlines()]
        docs = (Document(language, str(i), text) for i, text in enumerate(texts))
        write_manifest(where, [write_shard(docs, tok, shard_path(where, 0))], tok)
        made[language] = where
    return made


def heldout(run: Path) -> dict[str, float]:
    """The last evaluation's held-out bits per byte per source."""
    found: dict[str, float] = {}
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        for key, value in record.items():
            if key.startswith("eval/heldout/") and key.endswith("/bits_per_byte"):
                found[key.split("/")[2]] = value
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("runs/tokext"))
    parser.add_argument("--vocab", type=int, default=2048, help="the English BPE's size")
    parser.add_argument("--add", type=int, default=2048, help="tokens added for Chinese")
    parser.add_argument("--base-steps", type=int, default=400)
    parser.add_argument("--continue-steps", type=int, default=200)
    parser.add_argument("--zh-docs", type=int, default=1500, help="Chinese documents (the first ones) used")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    english = [json.loads(line) for line in (SHARED / "en-wikitext2.jsonl").read_text().splitlines()]
    chinese = [json.loads(line) for line in (SHARED / "zh-classics.jsonl").read_text().splitlines()][: args.zh_docs]
    (out / "en.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in english if r["text"].strip()))
    (out / "zh.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in chinese if r["text"].strip()))

    from liandan.data.tokens.tokenizer import train_bpe

    train_bpe((r["text"] for r in english), args.vocab).save(out / "en-tokenizer.json")
    print(f"English BPE of {args.vocab} tokens; pretraining {args.base_steps} steps on English", flush=True)
    base = [f"--run.output_dir={out}", "--run.overwrite=true", *MODEL]
    english_stores = stores(out, out / "en-tokenizer.json")
    liandan("train", str(REPO / "configs" / "tiny.toml"), *base, "--run.name=base", f"--train.steps={args.base_steps}",
            f'--data.stores=["{english_stores["en"]}"]',
            "--optim.lr=3e-3", "--schedule.warmup_steps=30", f"--eval.every={args.base_steps}")  # fmt: skip
    print(f"extending by {args.add} tokens learned on Chinese; growing the pretrained model", flush=True)
    liandan("tokenizer", "extend", str(out / "en-tokenizer.json"), str(out / "zh.jsonl"), f"--add={args.add}",
            f"--out={out / 'en-zh-tokenizer.json'}", f"--checkpoint={out / 'base' / 'checkpoints'}",
            f"--weights-out={out / 'grown.safetensors'}")  # fmt: skip
    newest = max((out / "base" / "checkpoints").glob("step-*"))
    runs = {"english tokenizer": ("en-tokenizer.json", newest),
            "extended tokenizer": ("en-zh-tokenizer.json", out / "grown.safetensors")}  # fmt: skip
    results = {}
    for label, (tokenizer, start) in runs.items():
        name = "continue-" + label.split()[0]
        print(f"continued pretraining with the {label}: {args.continue_steps} steps", flush=True)
        made = stores(out, out / tokenizer)
        both = f'--data.stores=["{made["en"]}","{made["zh"]}"]'
        liandan("train", str(REPO / "configs" / "tiny.toml"), *base, f"--run.name={name}", both,
                "--data.weights=[0.5,0.5]", f"--checkpoint.init_from={start}",
                f"--train.steps={args.continue_steps}", "--optim.lr=1e-3", "--schedule.warmup_steps=20",
                f"--eval.every={args.continue_steps}")  # fmt: skip
        results[label] = heldout(out / name)
    from liandan.cli.tokenizer_cmd import load_encoder

    held = [json.loads(line)["text"] for line in (SHARED / "zh-classics.jsonl").read_text().splitlines()][-300:]
    per_token = {}
    for label, (tokenizer, _) in runs.items():
        _, encode = load_encoder(str(out / tokenizer))
        per_token[label] = sum(map(len, held)) / sum(len(ids) for ids in encode(held))
    print(f"\n{'':22s} {'zh chars/token':>15s} {'en bits/byte':>13s} {'zh bits/byte':>13s}")
    for label in runs:
        r = results[label]
        print(
            f"{label:22s} {per_token[label]:15.3f} {r.get('en', float('nan')):13.4f} {r.get('zh', float('nan')):13.4f}"
        )
    if args.json:
        args.json.write_text(json.dumps({"heldout_bits_per_byte": results, "zh_chars_per_token": per_token}, indent=1))


if __name__ == "__main__":
    main()
