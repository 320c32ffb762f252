"""The guard's router watch on a clean mixture-of-experts run: how many router alarms (collapse, drift) a run
with the default guard settings raises, and how balanced its routers are after the warm-up.

    python benchmarks/router_watch.py                     # 500 steps, a few minutes to half an hour on 2 cores
    python benchmarks/router_watch.py --steps 100 --data /path/to/text.jsonl

A byte-level Llama of 4 blocks (width 64; the first block dense, three MoE blocks of 8 experts, top-2, one
shared expert, auxiliary-loss-free balancing at a bias rate of 1e-2, `--bias-rate`) trained on the shared English text
(`shared/data/corpus/en-wikitext2.jsonl`) with `[guard]` at its defaults. Printed: the guard's events and
rollbacks that name a router (none is the result asked for; the others' count is printed too), and per MoE layer the median and largest max/mean expert
load over the steps after `guard.router_warmup`, read from the routing the guard judged.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from liandan.config import load_config
from liandan.run import RunDir
from liandan.train import Trainer
from liandan.train.callbacks import Callback

DATA = ROOT.parent / "shared" / "data" / "corpus" / "en-wikitext2.jsonl"


class Loads(Callback):
    """Each step's max/mean load per MoE layer, from the routing the guard judges."""

    def __init__(self) -> None:
        self.by_step: dict[int, dict[int, float]] = {}

    def after_step(self, ctx, step, metrics) -> None:
        routing = ctx.module.routing
        if routing is not None:
            experts = routing.load.shape[1]
            self.by_step[step] = {layer: float(row.max()) * experts for layer, row in zip(routing.layers, routing.load)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--data", type=Path, default=DATA)
    parser.add_argument("--bias-rate", type=float, default=1e-2, help="the balancing bias's step (model.moe_bias_rate)")
    args = parser.parse_args()
    if not args.data.exists():
        sys.exit(f"no text at {args.data} (the shared data); name one with --data")
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            f"--run.output_dir={out}", "--run.name=moe", "--data.tokenizer=byte", f'--data.paths=["{args.data}"]',
            "--model.dim=64", "--model.n_layers=4", "--model.n_heads=4", "--model.n_kv_heads=2",
            "--model.max_seq_len=128", "--model.moe_experts=8", "--model.moe_top_k=2", "--model.moe_shared_experts=1",
            "--model.moe_ffn_dim=64", "--model.moe_dense_layers=1", f"--model.moe_bias_rate={args.bias_rate}", f"--train.steps={args.steps}",
            "--train.global_batch=8", "--train.seq_len=128", "--train.dtype=fp32", "--optim.lr=3e-3",
            "--schedule.warmup_steps=20", f"--train.eval_every={args.steps}", "--track.plot=false",
            "--doctor.preflight=false", "--checkpoint.enabled=false",
        ])  # fmt: skip
        loads = Loads()
        trainer = Trainer(cfg, say=lambda m: None)
        trainer.callbacks.append(loads)
        try:
            result = trainer.train()
        finally:
            trainer.close()
        events = RunDir.of(result.run_dir).read_events()
    routers = {"collapse", "drift"}
    alarms = [e for e in events if e.get("kind") in ("guard", "rollback") and routers & set(e.get("detectors", []))]
    others = [e for e in events if e.get("kind") in ("guard", "rollback") and e not in alarms]
    warmup = cfg.guard.router_warmup
    print(
        f"steps {args.steps}, bias rate {args.bias_rate:g}, final loss {result.losses[-1]:.3f}, router alarms:"
        f" {len(alarms)}, other guard events: {len(others)}"
    )
    for alarm in alarms:
        print(f"  step {alarm.get('step')}: {alarm.get('kind')} {alarm.get('detail', alarm.get('detectors'))}")
    for layer in sorted({layer for seen in loads.by_step.values() for layer in seen}):
        after = [seen[layer] for step, seen in loads.by_step.items() if step > warmup and layer in seen]
        if after:
            print(f"  layer {layer}: max/mean load after step {warmup}: median {statistics.median(after):.3f},"
                  f" largest {max(after):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
