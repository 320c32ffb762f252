"""`liandan mix`: which data to train on, from a swarm of proxy runs over mixture weights (docs/mixtures.md)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from liandan.config import ConfigError
from liandan.plan.mixture_check import ZERO
from liandan.run.files import check_output


def add_commands(sub) -> None:
    p = sub.add_parser(
        "mix",
        description=(
            "Train a swarm of small proxy runs of CONFIG over mixture weights of its [data] stores (Dirichlet"
            " draws around the token-proportional mixture, plus it and the uniform one), fit each source's"
            " held-out bits per byte as a law of the weights, and recommend weights for a target under a cap on"
            " repeats at the planned token budget; each source's marginal value as a table and a plot. Overrides"
            " (--model.dim=..., --train.steps=...) size the proxies. Running it again reuses finished proxies."
        ),
    )
    p.add_argument("config", metavar="CONFIG", help="run config (TOML) whose [data] stores are the sources")
    p.add_argument("--out", metavar="DIR", help="the swarm's directory (default: <run.output_dir>/mix-<config name>)")
    p.add_argument("--runs", type=int, metavar="N", help="proxies in the swarm (default: max(8, 4 x sources))")
    p.add_argument("--concentration", type=float, default=1.0, metavar="C",
                   help="Dirichlet concentration per source around the natural mixture; larger stays nearer it"
                   " (default 1)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the Dirichlet draws and the bootstrap (default 0)")
    p.add_argument("--parallel", type=int, default=1, metavar="N", help="proxies trained at once (default 1)")
    p.add_argument("--target", default="average",
                   help="what to minimise: a source's name, average (of every source's held-out bits per byte), or"
                   " one weight per source, comma-separated (default: average)")  # fmt: skip
    p.add_argument("--max-repeat", type=float, default=4.0, metavar="R",
                   help="times a source may be repeated at the planned budget (default 4)")  # fmt: skip
    p.add_argument("--tokens", metavar="T",
                   help="the planned token budget, e.g. 2B (default: CONFIG's train.steps x global_batch x"
                   " seq_len)")  # fmt: skip
    p.add_argument("--kl", type=float, default=0.0, metavar="LAMBDA",
                   help="weight of KL(w || natural) added to the target's law (default 0)")  # fmt: skip
    p.add_argument("--bootstrap", type=int, default=200, metavar="B",
                   help="bootstrap refits, each under random weights of the proxies (default 200)")  # fmt: skip
    p.add_argument("--design-only", action="store_true", help="print the swarm and the caps; train nothing")
    p.add_argument("--validate", action="store_true",
                   help="then train the recommended, natural and uniform mixtures at a larger size for --seeds seeds"
                   " and set the law's predicted target against the measured one")  # fmt: skip
    p.add_argument("--larger", action="append", default=[], metavar="KEY=VALUE",
                   help="the larger size, as overrides on the proxies' config, repeated: --larger model.dim=256"
                   " --larger train.steps=600 (default: model.dim doubled)")  # fmt: skip
    p.add_argument("--seeds", type=int, default=3, metavar="N", help="seeds of each validation run (default 3)")
    p.set_defaults(command=cmd_mix)


def cmd_mix(args: argparse.Namespace, overrides: list[str]) -> int:
    import numpy as np

    from liandan.cli.fit_cmd import quantity
    from liandan.config import load_config
    from liandan.plan import mixture as mx
    from liandan.plan.mixture_runs import Swarm, check_overrides, planned_tokens, read_sources, run_swarm
    from liandan.run.console import make_console

    if args.validate and args.design_only:
        raise ConfigError("--validate trains the swarm and then the larger runs; --design-only trains nothing")
    if args.parallel < 1:
        raise ConfigError(f"--parallel = {args.parallel} must be at least 1")
    if args.bootstrap < 10:
        raise ConfigError(f"--bootstrap = {args.bootstrap} must be at least 10")
    if not (args.kl >= 0 and math.isfinite(args.kl)):
        raise ConfigError(f"--kl = {args.kl} must be a number >= 0")
    config = Path(args.config)
    if not config.is_file():
        raise ConfigError(f"run config not found: {config}")
    check_overrides(overrides)
    cfg = load_config(config, overrides)
    if not cfg.eval.heldout_sequences:
        raise ConfigError("[eval] heldout_sequences = 0: the proxies are scored by their held-out bits per byte")
    if not cfg.data.val_fraction:
        raise ConfigError("[data] val_fraction = 0: the proxies need held-out windows of every store")
    if args.validate:
        from liandan.cli.mix_validate import larger_config

        larger, big = larger_config(args, config, list(overrides), cfg)
    sources = read_sources(cfg)
    names = [s.name for s in sources]
    tokens = [s.tokens for s in sources]
    budget = quantity(args.tokens, "--tokens") if args.tokens else planned_tokens(config, overrides)
    caps = mx.repeat_caps(tokens, budget, args.max_repeat, names)
    target_label, target = mx.parse_target(args.target, names)
    natural = np.asarray(tokens, dtype=float) / sum(tokens)
    runs = args.runs if args.runs is not None else mx.default_runs(len(sources))
    proxies = mx.design_swarm(natural, runs, args.concentration, args.seed, cfg.data.weights)
    out = Path(args.out) if args.out else Path(cfg.run.output_dir) / f"mix-{config.stem}"
    check_output(out, directory=True, makes_parents=True)
    swarm = Swarm(config, list(overrides), sources, proxies, out, args.seed, args.concentration)
    swarm.claim()

    console = make_console(highlight=False)
    console.print(f"{len(sources)} sources, {sum(tokens):,} tokens; planned budget {budget:,.0f} tokens, each"
                  f" source repeated at most {args.max_repeat:g} times")  # fmt: skip
    console.print(_sources_table(sources, natural, caps))
    console.print(f"swarm: {len(proxies)} proxies of {cfg.train.steps} steps x {cfg.train.global_batch} x"
                  f" {cfg.train.seq_len} tokens in {out / 'proxies'} (natural, uniform, then Dirichlet draws,"
                  f" concentration {args.concentration:g}, seed {args.seed})")  # fmt: skip
    if args.design_only:
        for p in proxies:
            console.print(f"  {p.name}: " + ", ".join(f"{n} {w:.3f}" for n, w in zip(names, p.weights)))
        return 0
    outcomes = run_swarm(swarm, cfg.train.steps, args.parallel, _Reporter(console, names))
    states = [o.state for o in outcomes]
    console.print(f"proxies: {states.count('finished')} trained now, {states.count('reused')} finished earlier,"
                  f" {states.count('failed')} failed")  # fmt: skip
    done = [o for o in outcomes if o.bits_per_byte and all(math.isfinite(v) for v in o.bits_per_byte.values())]
    failed = [o for o in outcomes if o.state == "failed"]
    if len(done) < len(sources) + 3:
        why = f"; the first failure: {failed[0].proxy.name}: {failed[0].note}" if failed else ""
        print(f"liandan: error: {len(done)} of {len(outcomes)} proxies have held-out results, a law over"
              f" {len(sources)} sources needs {len(sources) + 3}{why}", file=sys.stderr)  # fmt: skip
        return 1
    weights = np.array([o.proxy.weights for o in done])
    losses = np.array([[o.bits_per_byte[n] for n in names] for o in done])
    fit = mx.fit_mixture(weights, losses, names, bootstrap=args.bootstrap, seed=args.seed)
    analysis = mx.analyse(fit, target_label, target, natural, caps, args.kl)
    per_source = {n: float(np.sqrt(np.mean((fit.leave_one_out(np.eye(len(names))[j]) / losses[:, j]) ** 2)))
                  for j, n in enumerate(names)}  # fmt: skip
    console.print(_value_table(analysis))
    for line in _summary_lines(analysis, per_source, sources):
        console.print(line, markup=False)
    report = {
        "config": str(config), "overrides": list(overrides), "budget_tokens": budget, "max_repeat": args.max_repeat,
        "sources": [{**vars(s), "natural": float(w), "cap": float(c)} for s, w, c in zip(sources, natural, caps)],
        "proxies": [{**o.proxy.to_dict(), "state": o.state, "bits_per_byte": o.bits_per_byte, "note": o.note,
                     "run_dir": o.run_dir} for o in outcomes],
        "loo_rms_relative_per_source": per_source,
        "analysis": analysis,
    }  # fmt: skip
    (out / "mix.json").write_text(json.dumps(report, indent=1) + "\n")
    png = plot_values(analysis, out / "mix.png")
    console.print(f"written: {out / 'mix.json'}, {png}")
    if failed:
        console.print(f"note: {len(failed)} proxies failed (the first: {failed[0].proxy.name}: {failed[0].note});"
                      " the fit uses the others; run again to retry them", markup=False)  # fmt: skip
    if args.validate:
        from liandan.cli.mix_validate import validate

        return validate(args, cfg, larger, big, swarm, analysis, console)
    return 0


class _Reporter:
    def __init__(self, console, names):
        self.console, self.names = console, names

    def started(self, proxy) -> None:
        pass

    def finished(self, outcome, done: int, total: int) -> None:
        if outcome.state == "failed":
            what = f"failed: {outcome.note}"
        else:
            what = ", ".join(f"{n} {outcome.bits_per_byte[n]:.4f}" for n in self.names) + " bits/byte"
        when = f" ({outcome.seconds:.1f}s)" if outcome.seconds else ""
        self.console.print(f"[{done}/{total}] {outcome.proxy.name}: {what}{when}", markup=False)


def _sources_table(sources, natural, caps):
    from rich.table import Table

    table = Table(title="sources")
    for name, justify in [("source", "left"), ("tokens", "right"), ("natural", "right"), ("cap", "right")]:
        table.add_column(name, justify=justify)
    for s, w, c in zip(sources, natural, caps):
        table.add_row(s.name, f"{s.tokens:,}", f"{w:.3f}", f"{c:.3f}")
    return table


def _iv(value: float, low: float, high: float) -> str:
    return f"{value:+.3g} [{low:+.3g}, {high:+.3g}]"


def _value_table(analysis: dict[str, Any]):
    from rich.table import Table

    from liandan.plan.mixture import SLOPE_STEP

    level = f"{analysis['level']:.0%}"
    table = Table(title=f"each source's value for target {analysis['target']} (at the natural mixture, {level}"
                        " intervals; negative: lower loss)")  # fmt: skip
    columns = ["source", "natural", "cap", "recommended", f"+{SLOPE_STEP:g} weight", "removed", "verdict"]
    for name in columns:
        table.add_column(name, justify="left" if name in ("source", "verdict") else "right")
    for s in analysis["sources"]:
        up = [SLOPE_STEP * s[k] for k in ("slope", "slope_low", "slope_high")]
        table.add_row(
            s["name"], f"{s['natural']:.3f}", f"{s['cap']:.3f}",
            f"{s['recommended']:.3f} [{s['recommended_low']:.3f}, {s['recommended_high']:.3f}]",
            _iv(*up), _iv(s["removed"], s["removed_low"], s["removed_high"]), s["verdict"],
        )  # fmt: skip
    return table


def _summary_lines(analysis: dict[str, Any], per_source: dict[str, float], sources) -> list[str]:
    fit = analysis["fit"]
    lines = []
    for kind in ("recommended", "natural", "uniform"):
        m = analysis[kind]
        lines.append(f"{kind:>11}: predicted {analysis['target']} {m['loss']:.4f} bits/byte"
                     f" [{m['low']:.4f}, {m['high']:.4f}]")  # fmt: skip
    each = ", ".join(f"{n} {v:.2%}" for n, v in per_source.items())
    lines.append(f"fit: {fit['proxies']} proxies, {fit['bootstrap']} bootstrap refits; leave-one-out error of"
                 f" the target {fit['loo_rms_relative']:.2%} RMS, {fit['loo_max_relative']:.2%} at most; per source"
                 f" {each}")  # fmt: skip
    kept = [(s, w) for s, w in zip(sources, analysis["recommended"]["weights"]) if w >= ZERO]
    stores = json.dumps([s.path for s, _ in kept])
    weights = "[" + ", ".join(f"{w:.4f}" for _, w in kept) + "]"
    lines.append(f"train on it: --data.stores='{stores}' --data.weights='{weights}'")
    return lines


def plot_values(analysis: dict[str, Any], out: Path) -> Path:
    """Each source's change in target loss for more weight and for removal, with intervals, coloured by
    verdict."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from liandan.plan.mixture import SLOPE_STEP

    sources = analysis["sources"]
    names = [s["name"] for s in sources]
    colour = {"helps": "tab:green", "neutral": "tab:gray", "hurts": "tab:red"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.6 * len(names) + 2.2), sharey=True)
    panels = [(f"+{SLOPE_STEP:g} of the mixture to the source", "slope", SLOPE_STEP), ("source removed", "removed", 1)]
    for ax, (title, key, scale) in zip(axes, panels):
        for y, s in enumerate(sources):
            value, low, high = (scale * s[k] for k in (key, f"{key}_low", f"{key}_high"))
            ax.errorbar(value, y, xerr=[[max(0.0, value - low)], [max(0.0, high - value)]], fmt="o", capsize=4,
                        color=colour[s["verdict"]])  # fmt: skip
        ax.axvline(0, color="black", lw=0.8)
        ax.locator_params(axis="x", nbins=5)
        ax.set(title=title, xlabel=f"change in {analysis['target']} held-out bits per byte")
        ax.grid(alpha=0.3)
    axes[0].set_yticks(range(len(names)), [f"{n} ({s['verdict']})" for n, s in zip(names, sources)])
    axes[0].invert_yaxis()
    fig.suptitle(f"value of each source at the natural mixture ({analysis['level']:.0%} bootstrap intervals)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
