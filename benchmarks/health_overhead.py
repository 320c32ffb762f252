"""What silent-data-corruption and straggler detection cost: step time with the checks on (default intervals)
and off, in alternating turns of one data-parallel run.

    python benchmarks/health_overhead.py                     # 2 DDP ranks on gloo, tiny config, 1200 steps
    python benchmarks/health_overhead.py --steps 600 --turn 150 --nproc 2

One `liandan`-style run of `--nproc` DDP ranks (`--parallel.dp_replicate=nproc`) on configs/tiny.toml with
the loss-spike guard on, as by default. A callback that runs last swaps the health callbacks ("sdc",
"stragglers") in and out of the trainer every `--turn` steps, the same on every rank, so that load from other
processes lands on both halves alike. Turns are a multiple of every default interval (weight fingerprints and
cross-checks every 25 steps, replays every 75, straggler windows of 50: 150 steps), so each "on" turn holds
its full share of checks. The first pair of turns is warm-up and not counted. Printed by rank 0: ms per step
with the checks off and on, the on/off ratio of the totals and the median of the per-turn ratios, and the
checks' own work: the time rank 0 spends inside the health callbacks' hooks and in the audited all-reduce hook
on its recording steps (waits for the other rank in their collectives included), per step of the "on" turns,
which load from other processes disturbs far less than the difference of two step times.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def worker(args: argparse.Namespace) -> None:
    from liandan.config import load_config
    from liandan.train import Trainer
    from liandan.train.callbacks import Callback
    from liandan.train.components import build_components
    from liandan.train.health.sdc import SdcCallback
    from liandan.train.health.stragglers import StragglerCallback

    class Turns(Callback):
        order = 99  # last: a turn holds every other callback's work of its steps

        def on_train_start(self, ctx) -> None:
            self.full = list(self.components.callbacks)
            self.bare = [c for c in self.full if not isinstance(c, (SdcCallback, StragglerCallback))]
            self.seconds: dict[bool, list[float]] = {False: [], True: []}
            self.on = False
            self._switch(ctx)

        def on_step_end(self, ctx, step: int) -> None:
            if step % args.turn == 0 and not ctx.rollback.pending:
                self.seconds[self.on].append(time.perf_counter() - self.started)
                self.on = not self.on
                self._switch(ctx)

        def _switch(self, ctx) -> None:
            # the trainer runs the components' list of callbacks: changed in place, it runs the other set
            self.components.callbacks[:] = self.full if self.on else self.bare
            audit = ctx.module.allreduce_audit
            if audit is not None:
                audit.start(record=False)  # the sdc callback turns recording on at its check steps only
            self.started = time.perf_counter()

    own = {"seconds": 0.0}  # inside the health callbacks' hooks and the audited all-reduce hook

    def timed(method):
        def run(*a, **k):
            began = time.perf_counter()
            try:
                return method(*a, **k)
            finally:
                own["seconds"] += time.perf_counter() - began

        return run

    for callback_type in (SdcCallback, StragglerCallback):
        for hook in ("before_step", "on_phase", "before_optimizer_step", "after_step", "on_step_end"):
            if hook in vars(callback_type):
                setattr(callback_type, hook, timed(vars(callback_type)[hook]))
    parallelize = importlib.import_module("liandan.train.parallelize")

    plain_hook = parallelize.audited_allreduce

    def audited(audit, bucket):  # timed only while recording: otherwise it is DDP's own averaging
        if not audit.recording:
            return plain_hook(audit, bucket)
        return timed(plain_hook)(audit, bucket)

    parallelize.audited_allreduce = audited

    cfg = load_config(str(TINY), [f"--train.steps={args.steps}", f'--data.stores=["{args.store}"]',
                                  f"--parallel.dp_replicate={os.environ['WORLD_SIZE']}", "--train.eval_every=0",
                                  "--checkpoint.every=0", "--resilience.supervise=false",
                                  "--schedule.warmup_steps=10", f"--run.output_dir={args.out}",
                                  "--run.name=health"])  # fmt: skip
    turns = Turns()
    turns.components = build_components(cfg, callbacks=[turns], say=lambda message: None)
    trainer = Trainer(turns.components)
    try:
        trainer.train()
    finally:
        trainer.close()
    if int(os.environ["RANK"]) == 0:
        off, on = turns.seconds[False][1:], turns.seconds[True][1:]
        counted = min(len(off), len(on))
        off, on = off[:counted], on[:counted]
        per_turn = [b / a for a, b in zip(off, on, strict=True)]
        result = {"steps": args.steps, "turn": args.turn, "turns_counted": counted, "nproc": os.environ["WORLD_SIZE"],
                  "off_ms_per_step": 1000 * sum(off) / (counted * args.turn),
                  "on_ms_per_step": 1000 * sum(on) / (counted * args.turn),
                  "ratio": sum(on) / sum(off), "median_turn_ratio": statistics.median(per_turn),
                  "turn_ratios": per_turn, "own_ms_per_step": 1000 * own["seconds"] / (len(turns.seconds[True])
                                                                                       * args.turn)}  # fmt: skip
        print(json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--turn", type=int, default=150, help="steps per turn: a multiple of 150 keeps each share")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    from liandan.config import load_config
    from liandan.data.pipeline.prepare import prepare_store

    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        store = Path(tmp) / "store"
        prepare_store(load_config(str(TINY), []).data, store, say=lambda message: None)
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc))}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
                   __file__, "--worker", f"--steps={args.steps}", f"--turn={args.turn}", f"--store={store}",
                   f"--out={tmp}"]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"benchmark workers failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    result.update(load_before=load_before, load_after=os.getloadavg())
    print(f"{result['nproc']} DDP ranks, tiny config: checks off {result['off_ms_per_step']:.1f} ms/step, on"
          f" {result['on_ms_per_step']:.1f} ms/step over {result['turns_counted']} turns of {args.turn} steps each;"
          f" on/off {result['ratio']:.4f} (per-turn median {result['median_turn_ratio']:.4f}, range"
          f" {min(result['turn_ratios']):.3f}..{max(result['turn_ratios']):.3f}); the checks' own work (rank 0,"
          f" inside their hooks, collectives' waits included) {result['own_ms_per_step']:.2f} ms/step ="
          f" {100 * result['own_ms_per_step'] / result['off_ms_per_step']:.2f}% of a step")  # fmt: skip
    print(f"load average (1, 5, 15 min): before {result['load_before']}, after {result['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
