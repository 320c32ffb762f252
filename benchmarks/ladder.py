"""Scale-up prediction on the CPU: train a ladder of small runs and a larger run on the same data, predict the
larger run's final loss from the ladder alone (`liandan fit LADDER... --predict CONFIG`), and compare.

The rungs are six widths of a two-layer Llama, 24 to 96 (byte tokenizer, the shared English text), each
trained on tokens in proportion to its non-embedding parameters (data scaled with size), with the same
schedule shape, batch and learning rate; the target is the same recipe 128 wide (LADDER, TARGET below). The
comparison fits four ladders (SUBSETS): the four smallest rungs (the target 13.6 times their largest's
compute), the four largest (3.1 times), all six, and the four smallest with a second seed. Every run ends
with a validation loss over 64 held-out batches (the split follows the seed: the seed-1 rungs and the
target share it).

    python benchmarks/ladder.py --out runs/ladder               # train what is missing, then compare
    python benchmarks/ladder.py --out runs/ladder --seeds 2     # the four smallest rungs again, seed 2
    python benchmarks/ladder.py --out runs/ladder --seeds 2 --fixture tests/fixtures/ladder/ladder.csv
                                        # also the ladder's results, the target's config and loss, for the tests

A run whose summary.json exists is not trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "corpus"

# name: (dim, heads). Two layers each; widths only, so N grows by one knob.
LADDER = {"w24": (24, 2), "w32": (32, 2), "w48": (48, 3), "w64": (64, 4), "w80": (80, 4), "w96": (96, 4)}
TARGET = {"w128": (128, 4)}
# the ladders compared: four rungs each, from the smallest up (the longest reach) and the largest four
SUBSETS = {"w24-w64": ("w24", "w32", "w48", "w64"), "w48-w96": ("w48", "w64", "w80", "w96"), "all six": tuple(LADDER)}
SEEDED = ("w24", "w32", "w48", "w64")  # the rungs --seeds trains again
TOKENS_PER_PARAM = 4  # D = 4·N (non-embedding): data scaled with size
BATCH, SEQ = 8, 128


def run_config(name: str, dim: int, heads: int, out: Path, seed: int) -> str:
    """The TOML of one run: everything but the width and the steps is shared by the ladder and the target."""
    from liandan.model import ModelArgs, count_params

    args = ModelArgs(dim=dim, n_layers=2, n_heads=heads, n_kv_heads=heads, vocab_size=256, max_seq_len=SEQ,
                     ffn_multiple_of=16)  # fmt: skip
    n = count_params(args).non_embedding
    steps = max(1, round(TOKENS_PER_PARAM * n / (BATCH * SEQ)))
    data = [str(SHARED / "en-shakespeare.txt"), str(SHARED / "en-wikitext2.jsonl")]
    return f"""[run]
seed = {seed}
output_dir = "{out}"
name = "{name}"

[model]
dim = {dim}
n_layers = 2
n_heads = {heads}
n_kv_heads = {heads}
max_seq_len = {SEQ}
ffn_multiple_of = 16

[optim]
lr = 3e-3

[schedule]
kind = "cosine"
warmup_steps = {max(5, steps // 20)}
min_lr_ratio = 0.1

[train]
steps = {steps}
global_batch = {BATCH}
seq_len = {SEQ}
dtype = "fp32"
log_every = 1
eval_every = {steps}
eval_batches = 64

[resilience]
supervise = false

[data]
paths = {json.dumps(data)}
tokenizer = "byte"
val_fraction = 0.02
"""


def train(config: Path) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "liandan.cli", "train", str(config)], check=True, env=env,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    return time.perf_counter() - start


def ensure_runs(out: Path, runs: dict[str, tuple[int, int]], seed: int, suffix: str = "") -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    dirs = []
    for name, (dim, heads) in runs.items():
        run = out / f"{name}{suffix}"
        if not (run / "summary.json").is_file():
            config = out / f"{name}{suffix}.toml"
            config.write_text(run_config(run.name, dim, heads, out, seed))
            seconds = train(config)
            print(f"trained {run.name} in {seconds:.0f} s", flush=True)
        dirs.append(run)
    return dirs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "ladder")
    parser.add_argument("--seeds", type=int, default=1, help="train the ladder with this many seeds")
    parser.add_argument("--train-only", action="store_true")
    parser.add_argument("--fixture", type=Path, help="write the ladder's and the target's results here (JSON)")
    args = parser.parse_args()

    ladder = ensure_runs(args.out, LADDER, seed=1)
    for i in range(1, args.seeds):
        ladder += ensure_runs(args.out, {k: LADDER[k] for k in SEEDED}, seed=1 + i, suffix=f"-s{1 + i}")
    target = ensure_runs(args.out, TARGET, seed=1)
    if args.train_only:
        return 0
    return compare(ladder, target[0], args.fixture)


def compare(ladder: list[Path], target: Path, fixture: Path | None) -> int:
    from liandan.plan.scale_up import planned_run, predict_scale_up
    from liandan.plan.scaling_runs import load_observations

    summary = json.loads((target / "summary.json").read_text())
    actual = summary["val_loss"]
    run = planned_run(target.parent / f"{target.name}.toml")
    by_name = {p.name: p for p in ladder}
    cases = [(label, [by_name[n] for n in names]) for label, names in SUBSETS.items()]
    repeats = [p for p in ladder if "-s" in p.name]
    if repeats:
        cases.insert(1, ("w24-w64, two seeds", [by_name[n] for n in SUBSETS["w24-w64"]] + repeats))
    print(f"target {target.name}: N = {run.n:.4g}, D = {run.d:.4g}, final validation loss {actual:.4f}")
    print("| ladder | runs | target's C / largest rung's | predicted | 80% interval | actual | error | covered |")
    print("|---|---|---|---|---|---|---|---|")
    for label, dirs in cases:
        obs = load_observations(dirs, loss="val")
        obs.compute = 6.0 * obs.n * obs.d
        (p,) = predict_scale_up(obs, run, confidence=0.8)
        error = p.loss / actual - 1
        covered = "yes" if p.low <= actual <= p.high else "no"
        print(f"| {label} | {len(obs)} | {p.reach:.1f}x | {p.loss:.4f} | [{p.low:.4f}, {p.high:.4f}] | {actual:.4f} "
              f"| {error:+.2%} | {covered} |")  # fmt: skip
    for label, dirs in cases:
        print(
            f"{label}: liandan fit {' '.join(str(p) for p in dirs)} --loss val --confidence 0.8 --predict {target}.toml"
        )
    if fixture:
        fixture.parent.mkdir(parents=True, exist_ok=True)
        obs = load_observations(ladder, loss="val")
        lines = [
            "# the ladder of benchmarks/ladder.py: non-embedding parameters, tokens, final validation loss",
            "rung,seed,N,D,loss",
        ]
        for name, n, d, loss in zip(obs.names, obs.n, obs.d, obs.loss):
            rung, _, seed = name.partition("-s")
            lines.append(f"{rung},{seed or 1},{int(n)},{int(d)},{loss:.6f}")
        fixture.write_text("\n".join(lines) + "\n")
        target_file = fixture.with_name("target.json")
        target_file.write_text(
            json.dumps(
                {
                    "name": target.name,
                    "non_embedding_parameters": summary["non_embedding_parameters"],
                    "tokens": summary["tokens"],
                    "flops_per_token": summary["flops_per_token"],
                    "val_loss": actual,
                }
            )
            + "\n"
        )
        config = (target.parent / f"{target.name}.toml").read_text()  # paths as seen from the project root
        config = config.replace(str(target.parent), "runs/ladder").replace(str(SHARED), "../shared/data/corpus")
        fixture.with_name("target.toml").write_text(config)
        print(f"wrote {fixture}, {target_file} and target.toml")
    return 0


if __name__ == "__main__":
    sys.exit(main())
