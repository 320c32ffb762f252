"""`liandan fit LADDER... --predict CONFIG`: the final loss of a planned run, predicted from a ladder of
smaller runs before it starts. The numerics live in liandan.plan.scale_up."""

from __future__ import annotations

import argparse

import numpy as np

from liandan.cli.fit_cmd import _num, _table, runs_table
from liandan.config import ConfigError


def print_scale_up(console, obs, args: argparse.Namespace) -> int:
    from liandan.plan import scale_up
    from liandan.plan.scaling_fit import fit_compute_law

    if args.compute == "reported" and not np.all(obs.compute > 0):
        raise ConfigError("--compute reported needs C for every run")
    params = args.param_count.replace("-", "_")
    runs = [scale_up.planned_run(path, params=params) for path in args.predict]
    level = f"{args.confidence:.0%}".replace(".0%", "%")
    ratio = obs.d / obs.n
    console.print(
        f"ladder: {len(obs)} runs ({obs.source}); N {_num(obs.n.min())} to {_num(obs.n.max())}, "
        f"{ratio.min():.3g} to {ratio.max():.3g} tokens per parameter, C {_num(obs.compute.min())} to "
        f"{_num(obs.compute.max())} FLOPs ({'6·N·D' if args.compute == '6nd' else 'reported'})"
    )
    with console.status(f"fitting {len(obs)} runs, {args.bootstrap} noisy replicates per planned run"):
        law, _ = fit_compute_law(obs)
        predictions = [
            p
            for run in runs
            for p in scale_up.predict_scale_up(
                obs,
                run,
                compute=args.compute,
                confidence=args.confidence,
                replicates=args.bootstrap,
                seed=args.seed,
            )
        ]
    console.print(f"{law.describe()}  (Huber on log loss, L-BFGS-B)")
    fitted = law.loss(obs.compute)
    console.print(runs_table(obs, "L(C)", fitted, np.log(obs.loss / fitted), title="Ladder"))

    table = _table(
        "planned run", "N", "D", "C", "× ladder's C", "law", "predicted loss", f"{level} interval",
        title="Scale-up prediction",
    )  # fmt: skip
    for p in predictions:
        interval = "" if p.low is None else f"[{p.low:.4f}, {p.high:.4f}]"
        table.add_row(
            p.run.name,
            _num(p.run.n),
            _num(p.run.d),
            _num(p.compute),
            f"{p.reach:.3g}",
            p.law,
            f"{p.loss:.4f}",
            interval,
        )
    console.print(table)
    noise = {(p.law, p.noise_source): p.noise for p in predictions}
    for (name, source), sigma in noise.items():
        console.print(f"{name}: a run's noise σ = {sigma:.2%} of its loss ({source})")
    for run in runs:
        planned = run.d / run.n
        if not scale_up.varies_tokens_per_param(obs) and not (
            ratio.min() / scale_up.RATIO_SPREAD <= planned <= ratio.max() * scale_up.RATIO_SPREAD
        ):
            console.print(
                f"note: {run.name} trains {planned:.3g} tokens per parameter, the ladder {ratio.min():.3g} to "
                f"{ratio.max():.3g}; L(C) holds along the ladder's line only"
            )
    console.print(
        "note: the interval carries the ladder's noise through the fit and the planned run's own; "
        "not a law that bends beyond the ladder"
    )
    return 0
