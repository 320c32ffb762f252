"""FP8 training on a CUDA GPU: a small Llama trained a few steps in bf16 and in each torchao float8 recipe.

Each variant starts from the same weights and steps through the same seeded token batches (a small pool,
cycled, so the loss falls visibly within a few steps), the way liandan's trainer steps a single process:
fp32 master weights, autocast to bf16, `train.fp8`'s conversion through `liandan.train.parallelize`, the whole
model compiled. The script prints each variant's losses, its median step time, tokens/s, the loss gap to bf16,
and MFU against the peak liandan's trainer uses (the fp8 linears' share of the FLOPs at the fp8 data sheet
peak, the rest at the bf16 one).

    PYTHONPATH=src python benchmarks/fp8_cuda.py                     # H100-sized defaults, a few minutes
    PYTHONPATH=src python benchmarks/fp8_cuda.py --steps 10 --json fp8.json
    PYTHONPATH=src python benchmarks/fp8_cuda.py --device cpu --emulate --dim 64 --layers 2 --seq 64 \\
        --batch 2 --vocab 512 --no-compile                           # a smoke test of the script itself

Needs torchao (`pip install 'liandan[fp8]'`) and, without --emulate, a GPU of compute capability >= 8.9.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from liandan.common.layout import Layout
from liandan.common.peaks import mixed_peak_flops
from liandan.config import OptimSection
from liandan.model import ModelArgs, Transformer
from liandan.model.spec import flops_per_token
from liandan.train.fp8 import Fp8, fp8_param_count, fp8_refusal
from liandan.train.hardware import datasheet_fp8_peak_flops, device_peak_flops
from liandan.train.optimizers.adamw import build_adamw
from liandan.train.parallelize import parallelize

SKIP = ["output"]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation happens here)")
    p.add_argument("--pool", type=int, default=4, help="distinct batches, cycled")
    p.add_argument("--recipes", default="none,tensorwise,rowwise", help="'none' is the bf16 baseline")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--emulate", action="store_true", help="torchao's emulation (any device; no speed-up)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here as well")
    return p.parse_args()


def train(base: Transformer, recipe: str, batches, a: argparse.Namespace, device: torch.device) -> dict:
    model = copy.deepcopy(base)
    fp8 = Fp8(recipe, SKIP, a.emulate) if recipe != "none" else None
    fp8_params = fp8_param_count(model, SKIP) if fp8 else 0
    model = parallelize(model, None, Layout(1, 1, 1), compile=a.compile, fp8=fp8)
    optimizer = build_adamw(model, OptimSection(), device)
    losses, times = [], []
    for step in range(a.warmup + a.steps):
        inputs, targets = batches[step % len(batches)]
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()  # synchronises
        if step >= a.warmup:
            times.append(time.perf_counter() - start)
        losses.append(value)
    step_s = statistics.median(times)
    tokens = a.batch * a.seq
    return {"recipe": recipe, "losses": losses, "step_s": step_s, "tokens_per_s": tokens / step_s,
            "fp8_params": fp8_params}  # fmt: skip


def main() -> None:
    a = parse_args()
    device = torch.device(a.device)
    recipes = [r for r in a.recipes.split(",") if r]
    for recipe in recipes:
        refusal = fp8_refusal(recipe, device, emulate=a.emulate) if recipe != "none" else None
        if refusal:
            raise SystemExit(refusal)
    torch.manual_seed(a.seed)
    args = ModelArgs(vocab_size=a.vocab, dim=a.dim, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads,
                     max_seq_len=a.seq)  # fmt: skip
    base = Transformer(args).to(device)
    g = torch.Generator().manual_seed(a.seed)
    batches = []
    for _ in range(a.pool):
        tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=g).to(device)
        batches.append((tokens[:, :-1], tokens[:, 1:]))

    per_token = flops_per_token(args, a.seq)
    peak, source = device_peak_flops(device, torch.bfloat16)
    fp8_peak = None if a.emulate else datasheet_fp8_peak_flops(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"{name}; peak {peak / 1e12:g} TFLOP/s bf16 ({source}), fp8 {(fp8_peak or peak) / 1e12:g}")
    print(f"model: dim {a.dim}, {a.layers} layers, vocab {a.vocab}; {a.batch} x {a.seq} tokens per step;"
          f" compile {a.compile}; torch {torch.__version__}")  # fmt: skip
    results = []
    for recipe in recipes:
        r = train(base, recipe, batches, a, device)
        share = min(1.0, 6 * r["fp8_params"] / per_token)
        r["mfu"] = per_token * r["tokens_per_s"] / mixed_peak_flops(peak, fp8_peak or peak, share)
        r["mfu_bf16_peak"] = per_token * r["tokens_per_s"] / peak
        r["fp8_share"] = share
        results.append(r)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    baseline = results[0] if results and results[0]["recipe"] == "none" else None
    print(f"\n{'recipe':<12}{'step ms':>10}{'tokens/s':>12}{'speed-up':>10}{'MFU':>8}{'MFU bf16':>10}"
          f"{'max |dloss|':>13}  final loss")  # fmt: skip
    for r in results:
        speedup = baseline["step_s"] / r["step_s"] if baseline else float("nan")
        gap = max(abs(x - y) for x, y in zip(r["losses"], baseline["losses"], strict=True)) if baseline else 0.0
        r["max_loss_gap"] = gap
        print(f"{r['recipe']:<12}{1e3 * r['step_s']:>10.1f}{r['tokens_per_s']:>12,.0f}{speedup:>10.2f}"
              f"{r['mfu']:>8.1%}{r['mfu_bf16_peak']:>10.1%}{gap:>13.4f}  {r['losses'][-1]:.4f}")  # fmt: skip
    for r in results:
        print(f"{r['recipe']} losses: " + " ".join(f"{x:.4f}" for x in r["losses"]))
    if a.json:
        with open(a.json, "w") as handle:
            json.dump({"device": name, "args": vars(a), "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
