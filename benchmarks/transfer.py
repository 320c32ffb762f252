"""Learning-rate transfer across width: does the best learning rate found at a small width hold at larger ones?

For each parameterization (standard, and mup with the smallest width as its base) and each width (64, 128,
256: two layers, heads of 16, the same tokens, batch, schedule and seed), AdamW (or Muon: --optimizers) is
trained at learning rates on a grid of factors of 2 (extended at an edge that wins), and scored by the mean training loss of the last 25 steps (every batch is
fresh text, so this is a held-out loss). The report gives the best learning rate per width and how many grid
steps it moved between the widths. Byte tokenizer, the shared English text (en-wikitext2), one thread.

    python benchmarks/transfer.py --out runs/transfer            # about 10 minutes on one idle core
    python benchmarks/transfer.py --out runs/transfer --steps 60 --widths 32,64 --grid -1,0,1   # a smoke run

Results land in <out>/transfer.json (a finished run is not trained again).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "data" / "corpus" / "en-wikitext2.jsonl"
BASE_LR = 1e-3  # the grid is BASE_LR * 2**k
SEQ, BATCH, HEAD_DIM, LAYERS = 64, 8, 16, 2
SCORED_STEPS = 25


def config(out: Path, parameterization: str, base: int, lr: float, steps: int, optimizer: str):
    from liandan.config import load_config

    return load_config(
        None,
        [
            f"--run.output_dir={out}",
            "--run.seed=7",
            f"--model.dim={base}",
            f"--model.n_layers={LAYERS}",
            f"--model.n_heads={base // HEAD_DIM}",
            "--model.n_kv_heads=0",
            f"--model.max_seq_len={SEQ}",
            f"--model.parameterization={parameterization}",
            f"--model.mup_base_dim={base}",
            f"--optim.name={optimizer}",
            f"--optim.lr={lr}",
            "--optim.grad_clip=0",
            "--schedule.kind=cosine",
            f"--schedule.warmup_steps={max(1, steps // 10)}",
            "--schedule.min_lr_ratio=0.1",
            f"--train.steps={steps}",
            f"--train.global_batch={BATCH}",
            f"--train.seq_len={SEQ}",
            "--data.tokenizer=byte",
            f'--data.paths=["{CORPUS}"]',
        ],
    )


def train(cfg, args, batches) -> float:
    """Mean training loss of the last SCORED_STEPS steps (inf if it diverged)."""
    import torch

    from liandan.model.llama import Transformer
    from liandan.train.optimizers import build_optimizers, schedule

    torch.manual_seed(cfg.run.seed)
    model = Transformer(args)
    optimizers = build_optimizers([model], cfg.optim, schedule(len(batches), cfg.schedule), torch.device("cpu"))
    losses = []
    for batch in batches:
        loss = model(batch.inputs, batch.targets)
        if not torch.isfinite(loss):
            return math.inf
        loss.backward()
        optimizers.step()
        losses.append(loss.item())
    tail = losses[-SCORED_STEPS:]
    return sum(tail) / len(tail)


def sweep(out: Path, parameterization: str, widths: list[int], grid: list[int], steps: int, optimizer: str,
          results: dict, save) -> None:  # fmt: skip
    from liandan.plan.transfer import open_data, widened

    base = widths[0]
    cfg0 = config(out, parameterization, base, BASE_LR, steps, optimizer)
    loader = open_data(cfg0, out / "data", lambda line: None)
    vocab = 64 * math.ceil(loader.stores[0].tokenizer.vocab_size / 64)
    batches = [loader.next_step(BATCH)[0] for _ in range(steps)]
    from liandan.model.spec import model_args

    for width in widths:
        key = f"{optimizer}/{parameterization}/{width}" + (f"/base{base}" if parameterization == "mup" else "")
        row = results.setdefault(key, {})
        tried = list(grid)
        while tried:
            k = tried.pop(0)
            if str(k) not in row:
                cfg = config(out, parameterization, base, BASE_LR * 2**k, steps, optimizer)
                args = widened(model_args(cfg.model, vocab), width)
                start = time.perf_counter()
                row[str(k)] = train(cfg, args, batches)
                print(f"{key} lr {BASE_LR * 2**k:.3g}: {row[str(k)]:.4f} ({time.perf_counter() - start:.0f}s)",
                      flush=True)  # fmt: skip
                save()
            best = min(row, key=lambda s: row[s])
            ks = sorted(int(s) for s in row)
            if not tried and int(best) in (ks[0], ks[-1]) and len(ks) < len(grid) + 4:
                tried.append(ks[0] - 1 if int(best) == ks[0] else ks[-1] + 1)  # the best is at an edge: go on


def vertex(row: dict) -> float:
    """The grid exponent of the parabola through the best point and its two neighbours (in log2 lr): the best
    learning rate between grid points; the best grid point itself at an edge of the grid."""
    best = int(min(row, key=lambda s: row[s]))
    left, right = row.get(str(best - 1), math.inf), row.get(str(best + 1), math.inf)
    if not (math.isfinite(left) and math.isfinite(right)):
        return float(best)
    curvature = left + right - 2 * row[str(best)]
    return best + (left - right) / (2 * curvature) if curvature > 0 else float(best)


def report(results: dict, widths: list[int]) -> list[str]:
    lines = []
    for key in sorted({"/".join(k.split("/")[:2]) for k in results}):
        rows = [next((r for k, r in results.items() if k.split("/")[:3] == [*key.split("/"), str(w)]), {})
                for w in widths]  # fmt: skip
        if not all(rows):
            continue
        bests = [int(min(r, key=lambda s: r[s])) for r in rows]
        smooth = [vertex(r) for r in rows]
        cells = ", ".join(f"{w}: {BASE_LR * 2**b:.3g} (loss {r[str(b)]:.3f}; parabola {BASE_LR * 2**v:.3g})"
                          for w, b, v, r in zip(widths, bests, smooth, rows, strict=True))  # fmt: skip
        lines.append(f"{key}: best lr {cells}; moved {max(bests) - min(bests)} grid step(s) "
                     f"({max(smooth) - min(smooth):.2f} by the parabolas)")  # fmt: skip
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--widths", default="64,128,256")
    p.add_argument("--grid", default="-2,-1,0,1,2,3,4", help="exponents k of the learning rates 1e-3 * 2**k")
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--optimizers", default="adamw")
    p.add_argument("--parameterizations", default="standard,mup")
    a = p.parse_args()
    import torch

    torch.set_num_threads(1)
    widths = [int(w) for w in a.widths.split(",")]
    grid = [int(k) for k in a.grid.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "transfer.json"
    saved = json.loads(path.read_text()) if path.is_file() else {}
    results = saved.get("results", {})
    load = {"start": os.getloadavg()}
    started = time.perf_counter()

    def save() -> None:
        record = {"results": results, "steps": a.steps, "widths": widths, "load": load, "cpus": os.cpu_count()}
        path.write_text(json.dumps(record, indent=1))

    for optimizer in a.optimizers.split(","):
        for parameterization in a.parameterizations.split(","):
            sweep(a.out, parameterization, widths, grid, a.steps, optimizer, results, save)
    load["end"] = os.getloadavg()
    load["seconds"] = time.perf_counter() - started
    save()
    print("\n".join(report(results, widths)))
    print(f"load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end; "
          f"{load['seconds']:.0f}s")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
