"""MFU of a mixture of experts against the dense model with the same active FLOPs, on one GPU.

The two models are `moe_vs_dense.py`'s (8 experts of F/3, top-2, one shared expert of F/3 against a dense
SwiGLU of F: the same FLOPs per token within a few percent), here at a GPU's size and in bf16. Each trains for
`--steps` steps through `liandan train`, logging every step; the figures are medians over the steps after
`--warmup` (compilation and allocator warm-up excluded): MFU as liandan reports it (active FLOPs per token x
tokens per second / the device's peak), tokens per second, step time and peak memory, then the MoE's over the
dense model's. Runs one after the other, never at once, so that neither's timing disturbs the other's.

    python benchmarks/moe_mfu.py --out runs/moe-mfu                  # dim 1024, 8 blocks, 16 x 2048 tokens
    python benchmarks/moe_mfu.py --out runs/moe-mfu --compile        # each block compiled
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from moe_vs_dense import CORPORA, ROOT, run_config

FIGURES = ("mfu", "tokens_per_s", "step_time_s", "peak_mem_gib")


def measure(a: argparse.Namespace, name: str) -> dict[str, float]:
    run = a.out / name
    config = a.out / f"{name}.toml"
    config.write_text(run_config(a, name, a.out))
    overrides = [
        "--train.log_every=1",
        "--train.eval_every=0",  # timing only; a compiled evaluation forward is another graph to compile
        f"--train.compile={str(a.compile).lower()}",
        "--train.activation_checkpoint=none",
        "--track.plot=false",
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    subprocess.run([sys.executable, "-m", "liandan.cli", "train", str(config), *overrides], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r.get("step", 0) > a.warmup and "mfu" in r]
    if not timed:
        sys.exit(f"{name}: no step after --warmup {a.warmup} logged its MFU (is --steps larger?)")
    return {key: statistics.median(r[key] for r in timed) for key in FIGURES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=0, help="the dense hidden size F (0: 3 x dim)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--compile", action="store_true", help="train.compile = true for both")
    parser.add_argument("--dtype", default="bf16")
    a = parser.parse_args()
    # what moe_vs_dense's configs also read
    a.lr, a.bias_rate, a.log_every, a.score, a.aux_loss, a.z_loss = 3e-4, 1e-3, 1, "sigmoid", 0.0, 0.0
    a.tokenizer, a.bpe_vocab = "byte", 4096
    if not all(p.is_file() for p in CORPORA):
        sys.exit(f"the shared corpora are not at {CORPORA[0].parent}")
    a.out.mkdir(parents=True, exist_ok=True)
    figures = {name: measure(a, name) for name in ("dense", "moe")}
    print(f"dim {a.dim}, {a.layers} blocks, {a.batch} x {a.seq} tokens a step, {a.dtype}"
          f"{', compiled' if a.compile else ''}; medians of steps {a.warmup + 1}-{a.steps}")  # fmt: skip
    for name, f in figures.items():
        print(f"{name:5s}: MFU {f['mfu']:.1%}, {f['tokens_per_s']:,.0f} tokens/s, {f['step_time_s'] * 1e3:.1f} ms"
              f" a step, peak {f['peak_mem_gib']:.1f} GiB")  # fmt: skip
    dense, moe = figures["dense"], figures["moe"]
    print(
        f"MoE / dense: MFU {moe['mfu'] / dense['mfu']:.2f}x, tokens/s {moe['tokens_per_s'] / dense['tokens_per_s']:.2f}x"
    )
    (a.out / "moe_mfu.json").write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, **figures}))


if __name__ == "__main__":
    main()
