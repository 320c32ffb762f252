"""Tokens to quality: Muon against AdamW, each with its learning rate tuned by the same sweep, on the shared
English and on the shared Chinese text.

For each corpus and optimizer the learning rate is swept over one grid (factors of 2); each optimizer's best
run is the one with the lowest final validation loss. The figure is the tokens Muon's best run takes to first
reach AdamW's best final validation loss (read off its validation curve, linearly between evaluations),
over the tokens AdamW's best run took: below 1, Muon reaches the same quality on fewer tokens.

Every run shares the model (a Llama of about 10 M parameters by default), the data split, the seed, the
schedule's shape, the batch and the steps; only the optimizer and its learning rate change. A run whose
summary.json exists is not trained again, so the sweep can be stopped and continued.

    python benchmarks/muon_vs_adamw.py --out runs/muon-vs-adamw                    # both corpora, 1 process
    python benchmarks/muon_vs_adamw.py --out runs/muon-vs-adamw --nproc 2          # the same under FSDP2
    python benchmarks/muon_vs_adamw.py --out runs/small --dim 128 --layers 4 --steps 200   # a quick look
    python benchmarks/muon_vs_adamw.py --out runs/fsdp2 --nproc 2 --lr en:adamw=5e-4 --lr en:muon=4e-3 \
        --lr zh:adamw=2e-3 --lr zh:muon=4e-3                # only these rates (a sweep's winners, elsewhere)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "corpus"
CORPORA = {"en": SHARED / "en-wikitext2.jsonl", "zh": SHARED / "zh-classics.jsonl"}
GRIDS = {"adamw": (2.5e-4, 5e-4, 1e-3, 2e-3, 4e-3, 8e-3), "muon": (1e-3, 2e-3, 4e-3, 8e-3)}


def run_config(a: argparse.Namespace, corpus: str, optimizer: str, lr: float, out: Path) -> str:
    heads = max(1, a.dim // 64)
    return f"""[run]
seed = 1
output_dir = "{out}"
name = "{run_name(corpus, optimizer, lr)}"

[model]
max_seq_len = {a.seq}

[model.llama]
dim = {a.dim}
n_layers = {a.layers}
n_heads = {heads}
n_kv_heads = {heads}

[optim]
name = "{optimizer}"
lr = {lr}
grad_clip = 1.0

[schedule]
kind = "cosine"
warmup_steps = {max(5, a.steps // 20)}
min_lr_ratio = 0.1

[train]
steps = {a.steps}
global_batch = {a.batch}
seq_len = {a.seq}
dtype = "{a.dtype}"
eval_every = {max(1, a.steps // 20)}
eval_batches = 16

[resilience]
supervise = false

[doctor]
preflight = false

[checkpoint]
enabled = false

[data]
paths = ["{CORPORA[corpus]}"]
tokenizer = "bpe"
bpe_vocab_size = 4096
val_fraction = 0.05
"""


def run_name(corpus: str, optimizer: str, lr: float) -> str:
    return f"{corpus}-{optimizer}-lr{lr:g}"


def train(config: Path, nproc: int, concurrent: int = 1) -> float:
    threads = max(1, (os.cpu_count() or 1) // (nproc * concurrent))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT / "src"))
    command = [sys.executable, "-m", "liandan.cli", "train", str(config)]
    if nproc > 1:
        command += ["--nproc", str(nproc)]
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def eval_curve(run: Path) -> list[tuple[int, float]]:
    """(tokens, validation loss) at each evaluation of the run."""
    summary = json.loads((run / "summary.json").read_text())
    per_step = summary["tokens"] / summary["steps"]
    curve = []
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("kind") == "eval":
            curve.append((round(event["step"] * per_step), float(event["loss"])))
    return sorted(curve)


def tokens_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    """The tokens at which the validation curve first reaches `target`, linearly between evaluations."""
    previous = None
    for tokens, loss in curve:
        if loss <= target:
            if previous is None:
                return float(tokens)
            t0, l0 = previous
            return t0 + (tokens - t0) * (l0 - target) / (l0 - loss)
        previous = (tokens, loss)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--corpora", default="en,zh")
    parser.add_argument("--dim", type=int, default=320)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="train.dtype")
    parser.add_argument("--parallel", type=int, default=1, help="runs trained at once (several fit on one GPU)")
    parser.add_argument("--lr", action="append", default=[], metavar="CORPUS:OPTIMIZER=LR",
                        help="train only these rates, repeatable (default: each optimizer's whole grid)")  # fmt: skip
    a = parser.parse_args()
    if not SHARED.is_dir():
        sys.exit(f"the shared corpora are not at {SHARED}")
    a.out.mkdir(parents=True, exist_ok=True)
    corpora = a.corpora.split(",")
    chosen = [(c, o, float(lr)) for c, o, lr in (item.replace(":", "=").split("=") for item in a.lr)]
    grids = {(c, o): [lr for cc, oo, lr in chosen if (cc, oo) == (c, o)] or (GRIDS[o] if not chosen else [])
             for c in corpora for o in GRIDS}  # fmt: skip
    pending = [
        (corpus, optimizer, lr)
        for (corpus, optimizer), grid in grids.items()
        for lr in grid
        if not (a.out / run_name(corpus, optimizer, lr) / "summary.json").is_file()
    ]
    for corpus, optimizer, lr in pending:
        (a.out / f"{run_name(corpus, optimizer, lr)}.toml").write_text(run_config(a, corpus, optimizer, lr, a.out))
    with ThreadPoolExecutor(max(1, a.parallel)) as pool:
        configs = [a.out / f"{run_name(*run)}.toml" for run in pending]
        for config, seconds in zip(configs, pool.map(lambda c: train(c, a.nproc, a.parallel), configs)):
            print(f"  trained {config.stem} in {seconds:.0f} s", flush=True)
    for corpus in corpora:
        best: dict[str, tuple[float, Path]] = {}
        print(f"\n{corpus}: final validation loss by learning rate")
        for optimizer in GRIDS:
            for lr in grids[corpus, optimizer]:
                run = a.out / run_name(corpus, optimizer, lr)
                summary = json.loads((run / "summary.json").read_text())
                print(f"  {optimizer:6s} lr {lr:<7g} val {summary['val_loss']:.4f}  params {summary['parameters']:,}")
                if optimizer not in best or summary["val_loss"] < best[optimizer][0]:
                    best[optimizer] = (summary["val_loss"], run)
        target, adamw_run = best["adamw"]
        adamw_tokens = eval_curve(adamw_run)[-1][0]
        muon_tokens = tokens_to_reach(eval_curve(best["muon"][1]), target)
        reached = f"{muon_tokens:,.0f} tokens, {muon_tokens / adamw_tokens:.2f}x" if muon_tokens else "not reached"
        print(f"{corpus}: AdamW's best ({adamw_run.name}) ends at {target:.4f} after {adamw_tokens:,} tokens;"
              f" Muon's best ({best['muon'][1].name}) reaches it at {reached}")  # fmt: skip


if __name__ == "__main__":
    main()
