"""Quality per FLOP: a mixture of experts against a dense model with the same active parameters, trained on
the same tokens of the shared English and Chinese text.

The dense model's SwiGLU feed-forward has hidden size F; the MoE model's blocks route each token to the top-k
of E experts of hidden size F / (k + S) and through S shared experts of that size, so a token goes through F
hidden units as in the dense model (the router's dim x E weights are the only extra active parameters): the
same FLOPs per token within a few percent, (E + S) / (k + S) times the feed-forward parameters. By
default E = 16, k = 4, S = 0 (experts of F/4, 4x the feed-forward parameters), the setting that meets the
target on the shared text (docs/benchmarks.md); `--experts 8 --top-k 2 --shared-experts 1` is the shape measured
first: 8 experts of F/3, top-2, one shared expert of F/3. Balanced by the auxiliary-loss-free expert bias on
sigmoid scores (DeepSeek-V3; `--score softmax`, `--bias-rate`, `--aux-loss`, `--z-loss` try
other balancing). Everything else is shared: attention, width, depth, data split (a mixture of both
corpora), seed, schedule, batch, steps.

Printed: each run's final validation loss; the steps the MoE model takes to first reach the dense model's
final validation loss (linearly between evaluations) over the dense model's steps (the target is <= 0.8);
and the load balance after warm-up (the first fifth of the steps): the mean and the largest, over logged steps
and MoE blocks, of max/mean expert load (1.0 is perfect balance; the target is < 1.3). A run whose
summary.json exists is not trained again.

    python benchmarks/moe_vs_dense.py --out runs/moe-vs-dense --seed 1   # width 64, 4 blocks, 4,000 steps: 16 experts
                                                                        # top-4 of F/4, no shared one (7 min a run)
    python benchmarks/moe_vs_dense.py --out runs/e8 --experts 8 --top-k 2 --shared-experts 1 --dense-from runs/moe-vs-dense/dense
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "corpus"
CORPORA = [SHARED / "en-wikitext2.jsonl", SHARED / "zh-classics.jsonl"]


def run_config(a: argparse.Namespace, name: str, out: Path) -> str:
    heads = max(1, a.dim // 64)
    ffn = a.ffn or 3 * a.dim
    expert = ffn // (a.top_k + a.shared_experts)
    moe = ""
    if name == "moe":
        moe = f"""moe_experts = {a.experts}
moe_top_k = {a.top_k}
moe_ffn_dim = {expert}
moe_shared_experts = {a.shared_experts}
moe_balance = "bias"
moe_bias_rate = {a.bias_rate}
moe_score = "{a.score}"
moe_aux_loss = {a.aux_loss}
moe_z_loss = {a.z_loss}
"""
    paths = ", ".join(f'"{p}"' for p in CORPORA)
    return f"""[run]
seed = {a.seed}
output_dir = "{out}"
name = "{name}"

[model]
max_seq_len = {a.seq}

[model.llama]
dim = {a.dim}
n_layers = {a.layers}
n_heads = {heads}
n_kv_heads = {heads}
ffn_dim = {ffn}
{moe}
[optim]
lr = {a.lr}
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
log_every = {a.log_every}
eval_every = {max(1, a.steps // 20)}
eval_batches = {a.eval_batches}

[resilience]
supervise = false

[doctor]
preflight = false

[checkpoint]
enabled = false

[data]
paths = [{paths}]
tokenizer = "{a.tokenizer}"
bpe_vocab_size = {a.bpe_vocab}
val_fraction = 0.05
"""


def train(config: Path) -> float:
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "liandan.cli", "train", str(config)], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - start


def eval_curve(run: Path) -> list[tuple[int, float]]:
    """(step, validation loss) at each evaluation of the run."""
    curve = []
    for line in (run / "events.jsonl").read_text().splitlines():
        event = json.loads(line)
        if event.get("kind") == "eval":
            curve.append((int(event["step"]), float(event["loss"])))
    return sorted(curve)


def steps_to_reach(curve: list[tuple[int, float]], target: float) -> float | None:
    previous = None
    for step, loss in curve:
        if loss <= target:
            if previous is None:
                return float(step)
            s0, l0 = previous
            return s0 + (step - s0) * (l0 - target) / (l0 - loss)
        previous = (step, loss)
    return None


def load_balance(run: Path, after_step: int) -> tuple[float, float]:
    """(mean, largest) max/mean expert load over the logged steps after `after_step` and every MoE block."""
    values = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step", 0) > after_step:
            # per block (moe/<block>/load_max), not the logged maximum over blocks, which would count twice
            values += [
                v for k, v in record.items() if k.startswith("moe/") and k.endswith("/load_max") and k.count("/") == 2
            ]
    return statistics.fmean(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=0, help="the dense hidden size F (0: 3 x dim)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--seed", type=int, default=1, help="run.seed: initialisation and data order")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--experts", type=int, default=16, help="routed experts per MoE block")
    parser.add_argument("--top-k", type=int, default=4, help="routed experts per token")
    parser.add_argument("--shared-experts", type=int, default=0,
                        help="each expert's hidden size is F / (top-k + shared experts): a token's active hidden units are F")  # fmt: skip
    parser.add_argument("--bias-rate", type=float, default=1e-2, help="a few times --lr (DeepSeek-V3: 1e-3 at 2.2e-4)")
    parser.add_argument("--log-every", type=int, default=20)
    parser.add_argument("--eval-batches", type=int, default=32, help="validation batches per evaluation")
    parser.add_argument("--score", choices=("softmax", "sigmoid"), default="sigmoid")
    parser.add_argument("--aux-loss", type=float, default=0.0, help="weight of the load-balancing loss")
    parser.add_argument("--z-loss", type=float, default=0.0, help="weight of the router z-loss")
    parser.add_argument("--tokenizer", default="byte", help="byte (feed-forwards dominate) or bpe")
    parser.add_argument("--bpe-vocab", type=int, default=4096)
    parser.add_argument("--only", choices=("dense", "moe"), help="train and report one of the two models")
    parser.add_argument("--dense-from", type=Path, help="a finished dense run's directory to compare with")
    parser.add_argument("--dtype", default="fp32", help="train.dtype (bf16 on a GPU)")
    parser.add_argument("--parallel", action="store_true", help="train the two models at once (on one GPU, say)")
    a = parser.parse_args()
    if not all(p.is_file() for p in CORPORA):
        sys.exit(f"the shared corpora are not at {SHARED}")
    a.out.mkdir(parents=True, exist_ok=True)
    names = ("dense", "moe") if a.only is None else (a.only,)
    runs = {name: a.dense_from if name == "dense" and a.dense_from else a.out / name for name in names}
    pending = [name for name in names if not (runs[name] / "summary.json").is_file()]
    for name in pending:
        (a.out / f"{name}.toml").write_text(run_config(a, name, a.out))
    with ThreadPoolExecutor(len(pending) if a.parallel and pending else 1) as pool:
        for name, seconds in zip(pending, pool.map(lambda n: train(a.out / f"{n}.toml"), pending)):
            print(f"trained {name} in {seconds:.0f} s", flush=True)
    summaries = {}
    for name in names:
        summaries[name] = s = json.loads((runs[name] / "summary.json").read_text())
        print(f"{name:5s}: final validation loss {s['val_loss']:.4f}, {s['parameters']:,} parameters"
              f" ({s['active_parameters']:,} active),"
              f" {s['flops_per_token']:.3e} FLOPs per token")  # fmt: skip
    if a.only:
        return
    target = summaries["dense"]["val_loss"]
    reached = steps_to_reach(eval_curve(a.out / "moe"), target)
    ratio = f"{reached:.0f} steps, {reached / a.steps:.2f}x the dense model's {a.steps}" if reached else "not reached"
    print(f"MoE reaches the dense model's final validation loss {target:.4f} at {ratio} (target <= 0.80x)")
    mean, largest = load_balance(a.out / "moe", a.steps // 5)
    print(f"max/mean expert load after step {a.steps // 5}: mean {mean:.3f}, largest {largest:.3f} (target < 1.3)")


if __name__ == "__main__":
    main()
