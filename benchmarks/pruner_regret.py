"""The sweep's pruners measured for regret on the same study: liandan's forecast pruner against Hyperband and
median pruning, replaying recorded trials (`liandan.plan.sweep_replay`), so every pruner meets the same curves
in the same orders and nothing trains.

For each pruner and each order of the trials: whether it pruned the trial that would have won, the regret
(best final training loss among the trials it let finish minus the winner's), and the share of steps saved.

    # record the study once: a sweep of tiny runs with no pruning, every trial to its end
    liandan sweep benchmarks/sweep-regret.toml
    python benchmarks/pruner_regret.py --study runs/sweeps/regret --save tests/fixtures/regret-trials.json
    # replay it (the recorded curves are committed, so this alone reproduces the table)
    python benchmarks/pruner_regret.py --trials tests/fixtures/regret-trials.json --orders 40
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

from liandan.plan import sweep_replay as R


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--study", type=Path, help="a sweep's study directory of finished trials")
    source.add_argument("--trials", type=Path, help="recorded trials written by --save")
    parser.add_argument("--save", type=Path, help="write the recorded trials here (JSON)")
    parser.add_argument("--orders", type=int, default=10, help="orders of the trials to replay (the first as run)")
    parser.add_argument("--report-every", type=int, default=12, help="the sweep's report_every (steps)")
    parser.add_argument("--pruners", default=",".join(R.PRUNER_NAMES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    trials = R.read_trials(args.study) if args.study else R.load_trials(args.trials)
    if args.save:
        R.save_trials(trials, args.save)
        print(f"saved {len(trials)} trials: {args.save}")
    finals = [t.final for t in trials]
    winner = min(range(len(trials)), key=finals.__getitem__)
    print(
        f"{len(trials)} trials, {sum(t.total_steps for t in trials)} steps; final training loss "
        f"{min(finals):.4f} (the winner, {trials[winner].name}) to {max(finals):.4f}; "
        f"{args.orders} orders, report every {args.report_every} steps"
    )
    orders = R.orders(len(trials), args.orders, args.seed)
    header = "| pruner | winner pruned | mean regret | worst regret | trials pruned | steps saved | seconds |"
    print(header)
    print("|" + "---|" * 7)
    for name in args.pruners.split(","):
        started = time.perf_counter()
        results = [R.replay(trials, name, order, args.report_every) for order in orders]
        seconds = time.perf_counter() - started
        lost = sum(r.winner_pruned for r in results)
        regrets = [r.regret for r in results]
        rel = [r.regret / finals[winner] for r in results]
        print(
            f"| {name} | {lost} of {len(results)} | {statistics.mean(regrets):.4f} ({statistics.mean(rel):.2%}) "
            f"| {max(regrets):.4f} | {statistics.mean(r.pruned for r in results):.1f} of {len(trials)} "
            f"| {statistics.mean(r.saved for r in results):.0%} | {seconds:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
