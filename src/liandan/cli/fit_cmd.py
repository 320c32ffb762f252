"""`liandan fit` (a scaling law from a set of runs) and `liandan optimal` (compute-optimal model size and
tokens under a law). The numerics live in liandan.plan.scaling, scaling_fit and scaling_runs."""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Sequence
from pathlib import Path

from liandan.config import ConfigError
from liandan.run.files import atomic_write, check_output

_SUFFIX = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12, "P": 1e15}


def add_commands(sub) -> None:
    p = sub.add_parser(
        "fit",
        description="Fit L(N, D) = E + A/N^alpha + B/D^beta (Hoffmann et al. 2022, approach 3: Huber loss on log "
        "residuals, L-BFGS-B from a grid of starts) and L(C) = a*C^b + c to a set of runs, with bootstrap "
        "percentile intervals, and predict the loss of a proposed run.",
    )
    p.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="run directories (with summary.json), directories of them, or CSV files with columns N, D (or C) and loss",
    )
    p.add_argument(
        "--param-count",
        choices=["non-embedding", "total", "active", "active-total"],
        default="non-embedding",
        help="N of a run directory: non-embedding (default) or total parameters; of a mixture of experts, "
        "active (the non-embedding parameters a token goes through) or active-total (with the embedding)",
    )
    p.add_argument(
        "--loss",
        choices=["auto", "smoothed", "final", "val"],
        default="auto",
        help="loss of a run directory: val_loss, final_loss_smoothed, final_loss; auto (default) takes val_loss "
        "when every run has one, else final_loss_smoothed",
    )
    p.add_argument(
        "--compute",
        choices=["6nd", "reported"],
        default="6nd",
        help="C for L(C): 6*N*D (default), or reported: flops_per_token x tokens of a run (a CSV's C column)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=200,
        metavar="K",
        help="bootstrap resamples for intervals (default 200; 0: none)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the bootstrap resampling (default 0)")
    p.add_argument(
        "--confidence", type=float, default=0.95, metavar="P", help="level of the percentile intervals (default 0.95)"
    )
    p.add_argument("--predict-n", metavar="N", help="parameters of a proposed run (7e9 or 7B)")
    p.add_argument("--predict-d", metavar="D", help="tokens of a proposed run (2e12 or 2T)")
    p.add_argument(
        "--predict-flops",
        metavar="C",
        help="training FLOPs of a proposed run; alone, split compute-optimally under the fitted law",
    )
    p.add_argument(
        "--predict",
        action="append",
        metavar="CONFIG",
        help="a run config (TOML) to predict the final loss of before it starts, from these runs as a ladder, "
        "with an interval (the --bootstrap replicates carry the runs' noise; at --confidence); repeatable",
    )
    p.add_argument(
        "--save",
        metavar="FILE",
        help="write the fit and its bootstrap replicates as JSON (for `liandan optimal --law`)",
    )
    p.set_defaults(command=cmd_fit)

    p = sub.add_parser(
        "optimal",
        description="Compute-optimal allocation under L(N, D) = E + A/N^alpha + B/D^beta with C = 6*N*D: "
        "N_opt = G*(C/6)^a, D_opt = (C/6)^b/G. The default law is Chinchilla's as refitted by Besiroglu et al. 2024 "
        "(Epoch AI), which agrees with the paper's ~20 tokens per parameter; `--law hoffmann` gives the published "
        "approach-3 constants, and --law FILE one written by `liandan fit --save`.",
    )
    p.add_argument("--flops", nargs="+", metavar="C", help="training budgets in FLOPs (1e21 ...): the optimal N and D")
    p.add_argument(
        "--params", nargs="+", metavar="N", help="model sizes (7e9 or 7B ...): the tokens that make each optimal"
    )
    p.add_argument("--tokens", nargs="+", metavar="D", help="token budgets (1.4T ...): the model size optimal for each")
    p.add_argument(
        "--law",
        metavar="NAME|FILE",
        help="epoch (default: Chinchilla refitted by Epoch AI), hoffmann (as published), or a `liandan fit --save` file",
    )
    p.add_argument(
        "--confidence",
        type=float,
        default=0.95,
        metavar="P",
        help="interval level when the law has bootstrap replicates",
    )
    p.set_defaults(command=cmd_optimal)


# --------------------------------------------------------------------------------------------------------
# helpers


def quantity(text: str, what: str) -> float:
    """'7e9', '7B', '1.4T', '300M', '1e21' -> float; ConfigError naming the option otherwise."""
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([kKMBGTP]?)\s*", text or "")
    try:
        value = float(m.group(1)) * _SUFFIX.get(m.group(2), 1.0) if m else float("nan")
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{what} = {text!r}: expected a positive number such as 7e9 or 7B")
    return value


def runs_table(obs, law_label: str, fitted: Sequence[float], residuals: Sequence[float], title: str):
    """One row per run: its size, data, compute, measured loss, the law's loss and the log residual."""
    table = _table("run", "N", "D", "C", "loss", law_label, "residual", title=title)
    for i in range(len(obs)):
        table.add_row(
            obs.names[i],
            _num(obs.n[i]),
            _num(obs.d[i]),
            _num(obs.compute[i]),
            f"{obs.loss[i]:.4f}",
            f"{fitted[i]:.4f}",
            f"{residuals[i]:+.2%}",
        )
    return table


def _num(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x != 0 and (abs(x) >= 1e5 or abs(x) < 1e-3):
        mantissa, exponent = f"{x:.3e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    return f"{x:.4g}"


def _interval(bounds: tuple[float, float] | None) -> str:
    return "" if bounds is None else f"[{_num(bounds[0])}, {_num(bounds[1])}]"


def _console():
    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120, highlight=False, markup=False)


def _table(*columns: str, title: str | None = None):
    from rich.table import Table

    table = Table(title=title, title_justify="left", title_style="bold")
    for i, name in enumerate(columns):
        table.add_column(name, justify="left" if i == 0 else "right")
    return table


def _with_interval(x: float, replicas: list[float], confidence: float) -> str:
    """x, and under it the percentile interval of its bootstrap replicas when there are any."""
    if not replicas:
        return _num(x)
    from liandan.plan.scaling_fit import percentile_interval

    return f"{_num(x)}\n{_interval(percentile_interval(replicas, confidence))}"


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ConfigError(f"--confidence = {confidence} must lie between 0 and 1 (e.g. 0.95)")


def _no_overrides(overrides: list[str]) -> None:
    if overrides:
        raise ConfigError(f"unrecognised argument '{overrides[0]}'")


# --------------------------------------------------------------------------------------------------------
# liandan fit


def cmd_fit(args: argparse.Namespace, overrides: list[str]) -> int:
    import numpy as np

    from liandan.plan import scaling, scaling_fit, scaling_runs

    _no_overrides(overrides)
    _check_confidence(args.confidence)
    if args.save:
        check_output(args.save)
    if args.bootstrap < 0:
        raise ConfigError(f"--bootstrap = {args.bootstrap} must be 0 or more")
    predict = {
        key: quantity(value, option)
        for key, value, option in (
            ("n", args.predict_n, "--predict-n"),
            ("d", args.predict_d, "--predict-d"),
            ("flops", args.predict_flops, "--predict-flops"),
        )
        if value is not None
    }
    if len(predict) == 3:
        raise ConfigError("give at most two of --predict-n, --predict-d and --predict-flops; the third is 6*N*D")

    obs = scaling_runs.load_observations(args.paths, params=args.param_count.replace("-", "_"), loss=args.loss)
    if args.compute == "6nd":
        obs.compute = 6.0 * obs.n * obs.d
    console = _console()
    if args.predict:
        if predict or args.save:
            raise ConfigError("--predict CONFIG goes alone: without --predict-n/-d/-flops and --save")
        from liandan.cli.scale_up_cmd import print_scale_up

        return print_scale_up(console, obs, args)
    with console.status(f"fitting {len(obs)} runs, {args.bootstrap} bootstrap resamples"):
        result = scaling_fit.fit(obs, bootstrap=args.bootstrap, seed=args.seed)

    level = f"{args.confidence:.0%}".replace(".0%", "%")
    ci = lambda fn: result.interval(fn, args.confidence)
    law = result.law

    console.print(
        f"{len(obs)} runs ({obs.source}); N {_num(obs.n.min())} to {_num(obs.n.max())}, "
        f"D {_num(obs.d.min())} to {_num(obs.d.max())}, C {_num(obs.compute.min())} to {_num(obs.compute.max())} FLOPs"
    )
    boot = f"{len(result.samples)} bootstrap resamples, seed {args.seed}" if args.bootstrap else "no bootstrap"
    table = _table(
        "parameter",
        "estimate",
        f"{level} interval",
        "Chinchilla (Epoch refit)",
        title=f"L(N, D) = E + A/N^α + B/D^β  (Huber δ = {scaling_fit.HUBER_DELTA:g} on log loss, L-BFGS-B; {boot})",
    )
    chin = scaling.EPOCH_REFIT
    rows = [
        ("E", lambda s: s.E),
        ("A", lambda s: s.A),
        ("B", lambda s: s.B),
        ("α", lambda s: s.alpha),
        ("β", lambda s: s.beta),
        ("a = β/(α+β)   N_opt ∝ C^a", lambda s: s.a),
        ("b = α/(α+β)   D_opt ∝ C^b", lambda s: s.b),
    ]
    for name, fn in rows:
        table.add_row(name, _num(fn(law)), _interval(ci(fn)), _num(fn(chin)))
    console.print(table)

    residuals = result.residuals()
    worst = int(np.argmax(np.abs(residuals)))
    console.print(
        f"fit: RMS log residual {np.sqrt(np.mean(residuals**2)):.2%}, largest {residuals[worst]:+.2%} "
        f"({obs.names[worst]}); objective {result.objective:.3e}"
    )
    for name in result.at_bound():
        console.print(f"note: {name} sits on its bound {scaling_fit.EXPONENT_BOUNDS}: these runs do not constrain it")

    if result.compute_law is not None:
        cl = result.compute_law
        cci = lambda fn: result.compute_interval(fn, args.confidence)
        what = "6·N·D" if args.compute == "6nd" else "reported FLOPs"
        table = _table("parameter", "estimate", f"{level} interval", title=f"L(C) = a·C^b + c  (C = {what})")
        for name, fn in (("a", lambda s: s.a), ("b", lambda s: s.b), ("c", lambda s: s.c)):
            table.add_row(name, _num(fn(cl)), _interval(cci(fn)))
        console.print(table)
        r = np.log(obs.loss) - np.log(cl.loss(obs.compute))
        console.print(f"fit: RMS log residual {np.sqrt(np.mean(r**2)):.2%}")
    else:
        console.print("L(C): not fitted, every run has the same compute")

    console.print(runs_table(obs, "L(N, D)", law.loss(obs.n, obs.d), residuals, title="Runs"))

    if predict:
        _print_prediction(console, result, predict, args, level)

    if args.save:
        path = Path(args.save)
        atomic_write(path, json.dumps(scaling_fit.fit_to_dict(result, args.confidence), indent=2) + "\n")
        console.print(f"saved: {path}")
    return 0


def _print_prediction(console, result, predict: dict[str, float], args, level: str) -> None:
    from liandan.plan import scaling, scaling_fit

    law = result.law
    n, d, c = scaling.proposed_run(law, **predict)
    # what was not given follows from the law, so it varies over the bootstrap replicates of the law
    varies = len(predict) == 1
    runs = [scaling.proposed_run(s, **predict) for s in result.samples] if varies else []

    def spread(values: list[float], show: bool) -> str:
        return _interval(scaling_fit.percentile_interval(values, args.confidence)) if show and values else ""

    table = _table("proposed run", "value", f"{level} interval", title="Prediction")
    table.add_row("parameters N", _num(n), spread([r[0] for r in runs], "n" not in predict))
    table.add_row("tokens D", _num(d), spread([r[1] for r in runs], "d" not in predict))
    table.add_row("compute C = 6·N·D", _num(c), spread([r[2] for r in runs], "flops" not in predict))
    table.add_row("tokens per parameter", _num(d / n), spread([r[1] / r[0] for r in runs], True))
    table.add_row("loss, L(N, D)", f"{law.loss(n, d):.4f}", spread([s.loss(n, d) for s in result.samples], True))
    if result.compute_law is not None:
        table.add_row(
            "loss, L(C)", f"{result.compute_law.loss(c):.4f}", spread([s.loss(c) for s in result.compute_samples], True)
        )
    console.print(table)
    obs = result.obs
    reach = [
        f"{what} {value / top:,.0f}x the largest run's"
        for what, value, top in (("N", n, obs.n.max()), ("D", d, obs.d.max()), ("C", c, obs.compute.max()))
        if value > 2 * top
    ]
    if reach:
        console.print(f"note: an extrapolation, {', '.join(reach)}; the interval covers only the fit's uncertainty")
    if args.compute == "reported" and result.compute_law is not None:
        console.print("note: L(C) was fitted on reported FLOPs; the prediction puts in C = 6·N·D")


# --------------------------------------------------------------------------------------------------------
# liandan optimal


def cmd_optimal(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.plan import scaling

    _no_overrides(overrides)
    _check_confidence(args.confidence)
    requests = [("flops", quantity(v, "--flops")) for v in args.flops or []]
    requests += [("n", quantity(v, "--params")) for v in args.params or []]
    requests += [("d", quantity(v, "--tokens")) for v in args.tokens or []]
    if not requests:
        raise ConfigError("give --flops C, --params N or --tokens D (e.g. liandan optimal --flops 1e21)")
    law, samples, name = scaling.named_or_saved_law(args.law)

    console = _console()
    console.print(f"{law.describe()}  [{name}]")
    console.print(f"C = 6·N·D;  N_opt = {law.G:.4g}·(C/6)^{law.a:.4g},  D_opt = (C/6)^{law.b:.4g}/{law.G:.4g}")
    level = f"{args.confidence:.0%}".replace(".0%", "%")
    columns = ["given", "compute (FLOPs)", "parameters N", "tokens D", "tokens/param", "loss"]
    table = _table(*columns, title="Compute-optimal runs" + (f" ({level} intervals)" if samples else ""))
    for key, value in requests:
        n, d, c = scaling.proposed_run(law, **{key: value})
        runs = [scaling.proposed_run(s, **{key: value}) for s in samples]
        replicas = {  # each column under the bootstrap replicates of the law; nothing for what was given
            "flops": [r[2] for r in runs],
            "n": [r[0] for r in runs],
            "d": [r[1] for r in runs],
            "ratio": [r[1] / r[0] for r in runs],
            "loss": [s.loss(r[0], r[1]) for s, r in zip(samples, runs)],
        }
        replicas[key] = []
        columns = (("flops", c), ("n", n), ("d", d), ("ratio", d / n), ("loss", law.loss(n, d)))
        label = {"flops": "C", "n": "N", "d": "D"}[key] + f" = {_num(value)}"
        table.add_row(label, *(_with_interval(x, replicas[k], args.confidence) for k, x in columns))
    console.print(table)
    return 0
