"""`liandan mix --validate`: the recommended, natural and uniform mixtures trained at a larger size over
several seeds, measured against the mixture law's prediction (liandan.plan.mixture_check)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from liandan.config import Config, ConfigError


def larger_config(
    args: argparse.Namespace, config: Path, overrides: list[str], cfg: Config
) -> tuple[list[str], Config]:
    """The larger size's overrides on top of the proxies' and the config they make; checked before the swarm
    trains, so that a wrong `--larger` costs nothing."""
    from liandan.config import load_config
    from liandan.plan.mixture_check import larger_overrides

    if args.seeds < 2:
        raise ConfigError(f"--seeds = {args.seeds}: a spread needs at least 2 seeds")
    larger = larger_overrides(args.larger, cfg)
    return larger, load_config(config, [*overrides, *larger])


def validate(args: argparse.Namespace, cfg: Config, larger: list[str], big: Config, swarm, analysis: dict[str, Any],
             console) -> int:  # fmt: skip
    """`larger`, `big`: what `larger_config` gave."""
    import numpy as np

    from liandan.cli.mix_cmd import _Reporter
    from liandan.data import TokenStore
    from liandan.plan import mixture_check as mc
    from liandan.plan.mixture_runs import Swarm, run_swarm

    names = [s.name for s in swarm.sources]
    vocab = TokenStore(swarm.sources[0].path).vocab_size
    small_n, big_n = mc.total_parameters(cfg, vocab), mc.total_parameters(big, vocab)
    mixtures = {kind: analysis[kind]["weights"] for kind in mc.KINDS}
    mixtures["recommended"] = mc.without_tiny(mixtures["recommended"])
    mixtures = {kind: tuple(round(float(x), 6) for x in w) for kind, w in mixtures.items()}
    runs = mc.validation_runs(mixtures, args.seeds, cfg.run.seed)
    name = mc.validation_name(analysis["target"])
    one_split = f"--data.split_seed={cfg.run.seed}"  # every seed scored on the same held-out windows
    checking = Swarm(swarm.config, [*swarm.overrides, *larger, one_split], swarm.sources, runs, swarm.out,
                     swarm.seed, swarm.concentration, runs_dir=name)  # fmt: skip
    checking.claim()
    console.print(f"validation: {len(runs)} runs ({', '.join(mc.KINDS)} x {args.seeds} seeds) at"
                  f" {' '.join(larger)}: {big_n:,} parameters, {big_n / small_n:.1f}x the proxies' {small_n:,};"
                  f" {big.train.steps} steps x {big.train.global_batch} x {big.train.seq_len} tokens, in"
                  f" {checking.proxies_dir}", markup=False)  # fmt: skip
    outcomes = run_swarm(checking, big.train.steps, args.parallel, _Reporter(console, names))
    states = [o.state for o in outcomes]
    console.print(f"validation runs: {states.count('finished')} trained now, {states.count('reused')} finished"
                  f" earlier, {states.count('failed')} failed")  # fmt: skip
    failed = [o for o in outcomes if not o.bits_per_byte or not all(map(math.isfinite, o.bits_per_byte.values()))]
    if failed:
        console.print(f"liandan: error: {len(failed)} of {len(outcomes)} validation runs have no held-out result"
                      f" (the first: {failed[0].proxy.name}: {failed[0].note}); run again to retry them",
                      markup=False)  # fmt: skip
        return 1
    summary = mc.summarise(runs, [o.bits_per_byte for o in outcomes], analysis["fit"]["laws"],
                           analysis["target_weights"], names)  # fmt: skip
    report = {"larger": larger, "parameters": {"proxy": small_n, "larger": big_n, "ratio": big_n / small_n},
              "steps": big.train.steps, "target": analysis["target"], **summary,
              "runs": [{**o.proxy.to_dict(), "bits_per_byte": o.bits_per_byte, "run_dir": o.run_dir}
                       for o in outcomes]}  # fmt: skip
    console.print(_table(report, names))
    for line in _verdict_lines(report):
        console.print(line, markup=False)
    path = swarm.out / f"{name}.json"
    path.write_text(json.dumps(report, indent=1, default=lambda x: np.asarray(x).tolist()) + "\n")
    png = plot_validation(report, swarm.out / f"{name}.png")
    console.print(f"written: {path}, {png}")
    return 0


def _table(report: dict[str, Any], names: list[str]):
    from rich.table import Table

    table = Table(title=f"target {report['target']} at the larger size: held-out bits per byte, measured over"
                        f" {len(report['mixtures']['natural']['seeds'])} seeds and predicted")  # fmt: skip
    columns = ["mixture", "weights", "measured mean [min, max]", *names, "predicted (proxy size)", "predicted",
               "error"]  # fmt: skip
    for name in columns:
        table.add_column(name, justify="left" if name in ("mixture", "weights") else "right")
    for kind, m in report["mixtures"].items():
        table.add_row(
            kind + (" (anchor)" if kind in report["anchors"] else ""), " ".join(f"{w:.3f}" for w in m["weights"]),
            f"{m['mean']:.4f} [{m['low']:.4f}, {m['high']:.4f}]", *(f"{m['sources'][n]:.4f}" for n in names),
            f"{m['predicted_at_proxy_size']:.4f}", f"{m['predicted']:.4f}", f"{m['error_relative']:+.2%}",
        )  # fmt: skip
    return table


def _verdict_lines(report: dict[str, Any]) -> list[str]:
    rec = report["mixtures"]["recommended"]
    lines = []
    for other, b in report["beats"].items():
        verdict = "beats it beyond the seed spread" if b["beyond_spread"] else "does not beat it beyond the seed spread"
        o = report["mixtures"][other]
        lines.append(f"recommended against {other}: {b['margin']:+.4f} bits/byte lower on average; {verdict} (its"
                     f" worst seed {rec['high']:.4f}, {other}'s best {o['low']:.4f})")  # fmt: skip
    lines.append(
        f"the law's prediction for the recommended mixture, moved to the larger size by the natural and"
        f" uniform runs: {rec['predicted']:.4f} against {rec['mean']:.4f} measured"
        f" ({rec['error_relative']:+.2%}); at the proxies' size it said {rec['predicted_at_proxy_size']:.4f}"
    )
    return lines


def plot_validation(report: dict[str, Any], out: Path) -> Path:
    """Each mixture's measured target per seed, its mean, and the two predictions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for x, (kind, m) in enumerate(report["mixtures"].items()):
        ax.scatter([x] * len(m["measured"]), m["measured"], color="tab:blue", s=18,
                   label="measured, one seed" if x == 0 else None)  # fmt: skip
        ax.hlines(m["mean"], x - 0.25, x + 0.25, color="tab:blue", label="measured mean" if x == 0 else None)
        ax.scatter(x + 0.12, m["predicted"], marker="x", color="tab:red", label="law, moved to this size" if x == 0
                   else None)  # fmt: skip
        ax.scatter(x - 0.12, m["predicted_at_proxy_size"], marker="o", facecolors="none", edgecolors="tab:gray",
                   label="law at the proxies' size" if x == 0 else None)  # fmt: skip
    ax.set_xticks(range(len(report["mixtures"])), list(report["mixtures"]))
    ax.set(ylabel=f"{report['target']} held-out bits per byte",
           title=f"mixtures at {report['parameters']['ratio']:.1f}x the proxies' parameters")  # fmt: skip
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
