"""What the loss-spike guard costs: step time with the guard off and on, and one rollback against a restart
by hand from the last durable checkpoint.

    python benchmarks/guard_overhead.py                      # both parts, a few minutes on 2 cores
    python benchmarks/guard_overhead.py --models tiny --steps 200 --skip-recovery

Overhead: for each model, two `Trainer`s on the same token store, one with `--guard.enabled=false` and one
with the guard on (per-layer statistics every `--guard.stats_every` steps, the state ring every
`guard.ring_every`), trained in the same process in alternating turns of `--turn` steps, so that a load spike
from another process lands on both. The time of a turn is its steps' wall time with every callback; the
first turn of each is warm-up and not counted. Printed: seconds per step of each, on/off ratio of the totals,
and the median of the per-turn ratios. Models: `tiny` (configs/tiny.toml, its BPE vocabulary of 4096) and
`train_step` (the ~10M-parameter Llama of benchmarks/train_step.py: width 320, 4 layers, SwiGLU 896,
8192-token vocabulary, batch 8 x 256).

Recovery: the tiny config as `liandan train` processes, checkpoints every `--checkpoint-every` steps. One run
meets `burst@update:F` (an update at 100 times the learning rate) and the guard rolls back: its cost is the
"rollback" event's `seconds` (restore, diagnosis, replay) plus `steps_redone` steps. The baseline is stopping
and restarting by hand from the last durable checkpoint: the same run's checkpoints after it are removed and
the run is started again, and its cost is the time from launch to the resumed run's first step plus the
steps from the checkpoint to the detection, at the run's median step time (a person's reaction time is not
counted).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"
COMMON = ["--train.eval_every=0", "--checkpoint.every=0", "--resilience.supervise=false", "--schedule.warmup_steps=10"]
MODELS = {
    "tiny": [],
    "train_step": [
        "--model.dim=320",
        "--model.n_layers=4",
        "--model.n_heads=5",
        "--model.n_kv_heads=5",
        "--model.ffn_dim=896",
        "--model.max_seq_len=256",
        "--model.z_loss=0",
        "--train.seq_len=256",
        "--train.global_batch=8",
        "--data.bpe_vocab_size=8192",
    ],
}


# -- overhead -------------------------------------------------------------------------------------------------
class Turns:
    """Two trainers in two threads, one running at a time, handing over every `every` steps."""

    def __init__(self, every: int):
        self.every, self.turn, self.finished = every, 0, set()
        self.cond = threading.Condition()
        self.seconds: dict[int, list[float]] = {0: [], 1: []}

    def wait(self, me: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == me or (1 - me) in self.finished)

    def hand_over(self, me: int, seconds: float, finished: bool = False) -> None:
        with self.cond:
            self.seconds[me].append(seconds)
            if finished:
                self.finished.add(me)
            self.turn = 1 - me
            self.cond.notify_all()


def turn_taker(turns: Turns, me: int):
    from liandan.train.callbacks import Callback

    class TurnTaker(Callback):
        order = 99  # last: a turn holds every other callback's work of its steps

        def on_train_start(self, trainer) -> None:
            turns.wait(me)
            self.started = time.perf_counter()

        def on_step_end(self, trainer, step: int) -> None:
            if step % turns.every == 0 and step < trainer.cfg.train.steps:
                turns.hand_over(me, time.perf_counter() - self.started)
                turns.wait(me)
                self.started = time.perf_counter()

        def on_train_end(self, trainer, result) -> None:
            turns.hand_over(me, time.perf_counter() - self.started, finished=True)

    return TurnTaker()


def overhead(name: str, store: Path, root: Path, steps: int, turn: int, stats_every: int) -> dict:
    from liandan.config import load_config
    from liandan.train import Trainer

    turns = Turns(turn)
    trainers = []
    for me, guard in enumerate(("false", "true")):
        cfg = load_config(str(TINY), [*COMMON, *MODELS[name], f"--train.steps={steps}", f'--data.stores=["{store}"]',
                                      f"--run.output_dir={root}", f"--run.name={name}-guard-{guard}",
                                      f"--guard.enabled={guard}", f"--guard.stats_every={stats_every}"])  # fmt: skip
        trainers.append(Trainer(cfg, callbacks=[turn_taker(turns, me)], say=lambda message: None))
    threads = [threading.Thread(target=t.train) for t in trainers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for t in trainers:
        t.close()
    off, on = turns.seconds[0][1:], turns.seconds[1][1:]
    per_turn = [b / a for a, b in zip(off, on, strict=True)]
    counted = steps - turn
    result = {"model": name, "steps": steps, "turn": turn, "stats_every": stats_every,
              "off_s_per_step": sum(off) / counted, "on_s_per_step": sum(on) / counted,
              "ratio": sum(on) / sum(off), "median_turn_ratio": statistics.median(per_turn),
              "turn_ratio_range": [min(per_turn), max(per_turn)]}  # fmt: skip
    print(f"{name}: guard off {1000 * result['off_s_per_step']:.1f} ms/step, on {1000 * result['on_s_per_step']:.1f}"
          f" ms/step over {counted} steps; on/off {result['ratio']:.4f} (turns of {turn}: median"
          f" {result['median_turn_ratio']:.4f}, range {min(per_turn):.3f}..{max(per_turn):.3f})", flush=True)  # fmt: skip
    return result


# -- recovery -------------------------------------------------------------------------------------------------
def liandan(run_dir: Path, store: Path, *args: str, env: dict | None = None) -> float:
    """Run `liandan train` on the tiny config into `run_dir`; returns its launch time."""
    command = [sys.executable, "-m", "liandan.cli", "train", str(TINY), *COMMON, f'--data.stores=["{store}"]',
               f"--run.output_dir={run_dir.parent}", f"--run.name={run_dir.name}", *args]  # fmt: skip
    launched = time.time()
    done = subprocess.run(command, env={**os.environ, **(env or {})}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"liandan train: exit {done.returncode}\n{done.stderr[-3000:]}")
    return launched


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def recovery(store: Path, root: Path, fault: int, every: int) -> dict:
    run = root / "recovery"
    steps = fault + 10
    liandan(run, store, f"--train.steps={steps}", f"--checkpoint.every={every}",
            env={"LIANDAN_FAULTS": f"burst@update:{fault}"})  # fmt: skip
    rollbacks = [e for e in events(run) if e["kind"] == "rollback"]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(m["step_time_s"] for m in metrics if m.get("step_time_s"))
    if not rollbacks:
        print(f"recovery: burst@update:{fault} caused no rollback; nothing to compare", flush=True)
        return {"rollback": None, "step_s": step_s}
    rollback = rollbacks[0]
    durable = (rollback["step"] // every) * every
    for checkpoint in (run / "checkpoints").iterdir():  # the durable state a person would restart from
        digits = "".join(c for c in checkpoint.name if c.isdigit())
        if digits and int(digits) > durable:
            shutil.rmtree(checkpoint) if checkpoint.is_dir() else checkpoint.unlink()
    launched = liandan(run, store, f"--train.steps={durable + 1}", f"--checkpoint.every={every}")
    start = [e for e in events(run) if e["kind"] == "train_start" and e["time"] > launched]
    restart_s = start[0]["time"] - launched
    by_hand_steps = rollback["step"] - durable
    guard_s = rollback["seconds"] + rollback["steps_redone"] * step_s
    hand_s = restart_s + by_hand_steps * step_s
    result = {"fault_step": fault, "checkpoint_every": every, "step_s": step_s, "rollback": rollback,
              "guard_seconds": guard_s, "restart_seconds": restart_s, "by_hand_steps": by_hand_steps,
              "by_hand_seconds": hand_s, "ratio": guard_s / hand_s}  # fmt: skip
    print(f"recovery (tiny, {1000 * step_s:.0f} ms/step): rollback at step {rollback['step']} to {rollback['to']}:"
          f" {rollback['seconds']:.2f} s + {rollback['steps_redone']} steps redone = {guard_s:.2f} s;"
          f" by hand from the checkpoint of step {durable}: restart {restart_s:.2f} s + {by_hand_steps} steps"
          f" = {hand_s:.2f} s; guard/by hand {guard_s / hand_s:.3f}", flush=True)  # fmt: skip
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--steps", type=int, default=300, help="steps of each overhead run (tiny)")
    parser.add_argument("--steps-large", type=int, default=120, help="steps of each overhead run (train_step)")
    parser.add_argument("--turn", type=int, default=10, help="steps per turn")
    parser.add_argument("--stats-every", type=int, default=100)
    parser.add_argument("--fault", type=int, default=80, help="the step of the burst in the recovery run")
    parser.add_argument("--checkpoint-every", type=int, default=50)
    parser.add_argument("--skip-recovery", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from liandan.config import load_config
    from liandan.data.pipeline.prepare import prepare_store

    record = {"load_before": os.getloadavg(), "threads": os.environ.get("OMP_NUM_THREADS")}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        stores = {}
        for name in args.models:
            stores[name] = root / f"store-{name}"
            prepare_store(load_config(str(TINY), MODELS[name]).data, stores[name], say=lambda message: None)
        lengths = {"tiny": args.steps, "train_step": args.steps_large}
        record["overhead"] = [
            overhead(name, stores[name], root, lengths[name], args.turn, args.stats_every) for name in args.models
        ]
        if not args.skip_recovery:
            store = stores.get("tiny") or root / "store-tiny"
            if "tiny" not in stores:
                prepare_store(load_config(str(TINY), []).data, store, say=lambda message: None)
            record["recovery"] = recovery(store, root, args.fault, args.checkpoint_every)
    record["load_after"] = os.getloadavg()
    print(f"load average (1, 5, 15 min): before {record['load_before']}, after {record['load_after']}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
