"""`liandan forecast`: the final loss of a run in progress, from its partial curve and its known schedule."""

from __future__ import annotations

import argparse
from pathlib import Path

from liandan.config import ConfigError

WORSE_EXIT = 3
FRACTIONS = "0.1,0.2,0.5"


def add_commands(sub) -> None:
    p = sub.add_parser(
        "forecast",
        description=(
            "Forecast the final training loss of RUN from the loss records so far and the learning-rate"
            " schedule in its config.toml, with priors and a calibrated interval learned from finished runs:"
            " the shipped library of tiny real runs, the finished runs beside RUN, and those under --library."
            " --backtest replays finished runs instead (none named: the library's held-out runs), forecasting"
            " from the first 10/20/50% of their steps."
        ),
    )
    p.add_argument(
        "runs",
        nargs="*",
        metavar="RUN",
        help="run directory (with --backtest: finished runs, default the held-out library)",
    )
    p.add_argument(
        "--library",
        action="append",
        default=None,
        metavar="DIR",
        help="a project directory whose finished runs the forecast also learns from (repeatable; default: RUN's"
        " parent directory)",
    )
    p.add_argument("--reference", metavar="RUN2", help="flag RUN when its forecast is worse than this run's final loss")
    p.add_argument("--fail-if-worse", action="store_true", help="exit 3 when RUN is forecast worse than --reference")
    p.add_argument("--upto", type=int, metavar="STEP", help="use only the records up to STEP")
    p.add_argument("--backtest", action="store_true", help="replay finished runs from a share of their steps")
    p.add_argument(
        "--fractions", default=FRACTIONS, metavar="F,F,...", help="shares of the steps a backtest forecasts from"
    )
    p.add_argument("--confidence", type=float, default=0.8, help="coverage of the interval (default 0.8)")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    p.set_defaults(command=cmd_forecast)


def cmd_forecast(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"forecast takes no config overrides (got {overrides[0]})")
    if not 0.0 < args.confidence < 1.0:
        raise ConfigError(f"--confidence = {args.confidence} must lie between 0 and 1")
    if args.upto is not None and args.upto < 1:
        raise ConfigError(f"--upto = {args.upto} must be a step, 1 or more")
    options = {"confidence": args.confidence}
    if args.backtest:
        if args.reference or args.fail_if_worse or args.upto is not None:
            raise ConfigError("--backtest takes only runs, --library, --fractions and --confidence")
        return _backtest(args, options)
    if args.fractions != FRACTIONS:
        raise ConfigError("--fractions goes with --backtest")
    if len(args.runs) != 1:
        raise ConfigError(f"forecast takes one run (got {len(args.runs)}); use --backtest to replay several")
    if args.fail_if_worse and not args.reference:
        raise ConfigError("--fail-if-worse needs --reference RUN2")
    return _forecast(args, options)


def _forecast(args: argparse.Namespace, options: dict) -> int:
    from liandan.plan.forecast import forecast_run, measured_final_loss, read_run

    run = Path(args.runs[0])
    f = forecast_run(run, upto_step=args.upto, libraries=args.library, **options)
    reference = None
    if args.reference:
        ref = read_run(args.reference)
        if ref.diverged_at is not None:
            raise ConfigError(f"--reference {args.reference}: its loss is not finite from step {ref.diverged_at} on")
        if ref.finished:
            reference = ("final loss", measured_final_loss(ref.steps, ref.losses))
        else:
            reference = (
                "forecast final loss",
                forecast_run(args.reference, libraries=args.library, **options).final_loss,
            )
    worse = reference is not None and f.final_loss > reference[1]
    if args.json:
        import json

        out = {"run": str(run), **f.to_dict()}
        if reference:
            out.update(reference=str(args.reference), reference_loss=reference[1], worse=worse)
        print(json.dumps(out, indent=2))
    else:
        pct = round(100 * f.confidence)
        print(f"run {run}: step {f.observed_step} of {f.total_steps} ({100 * f.observed_fraction:.0f}% observed)")
        print(f"forecast final loss  {f.final_loss:.4f}   {pct}% interval [{f.low:.4f}, {f.high:.4f}]")
        print(f"  target: {f.target}")
        print(f"  {_reach_note(f)}")
        print(f"  fitted loss now {f.current_loss:.4f}; " + _annealing_note(f))
        print(f"  schedule-free power law: {f.power_law:.4f} [{f.power_low:.4f}, {f.power_high:.4f}]")
        print(f"  priors and interval learned from {f.prior_runs} finished runs")
        if reference:
            what, value = reference
            if worse:
                sure = "the whole interval lies above it" if f.low > value else "within the interval"
                print(
                    f"WORSE than reference {args.reference} ({what} {value:.4f}): +{f.final_loss - value:.4f}, {sure}"
                )
            else:
                sure = "the whole interval lies below it" if f.high < value else "within the interval"
                print(
                    f"not worse than reference {args.reference} ({what} {value:.4f}): {f.final_loss - value:+.4f}, {sure}"
                )
    return WORSE_EXIT if worse and args.fail_if_worse else 0


def _reach_note(f) -> str:
    if f.source == "own fit":
        return f"far from the library: {f.reach}; the run's own fit alone, its interval {f.widening:.1f}x wider"
    return f.reach + (f"; its interval {f.widening:.1f}x wider" if f.widening > 1.0 else "")


def _annealing_note(f) -> str:
    if f.fit.C == 0.0:
        return "constant learning rate: no annealing term"
    if f.annealing_seen < 0.2:
        return f"annealing {100 * f.annealing_seen:.0f}% seen: its effect comes from the runs learned from"
    return f"annealing {100 * f.annealing_seen:.0f}% seen"


def _backtest(args: argparse.Namespace, options: dict) -> int:
    from liandan.plan.forecast import backtest

    try:
        fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"--fractions = {args.fractions!r} must be numbers separated by commas") from None
    if not fractions or not all(0.0 < x <= 1.0 for x in fractions):
        raise ConfigError(f"--fractions = {args.fractions!r} must be shares in (0, 1]")
    rows = backtest(args.runs, fractions, libraries=args.library or (), **options)
    if args.json:
        import json

        print(json.dumps([_row_dict(r) for r in rows], indent=2))
        return 0
    from rich.console import Console

    console = Console(width=160, highlight=False)
    console.print(_rows_table(rows, options["confidence"]))
    console.print(_summary_table(rows, options["confidence"]))
    return 0


def _rows_table(rows, confidence: float):
    from rich.table import Table

    pct = round(100 * confidence)
    table = Table(title="forecast backtest: final training loss forecast from the start of finished runs")
    for name, justify in [
        ("run", "left"),
        ("schedule", "left"),
        ("seen", "right"),
        ("from step", "right"),
        ("forecast", "right"),
        (f"{pct}% interval", "right"),
        ("actual", "right"),
        ("error", "right"),
        ("in interval", "center"),
        ("from library", "right"),
        ("power law", "right"),
        ("power error", "right"),
    ]:
        table.add_column(name, justify=justify)
    for r in rows:
        f = r.forecast
        head = [Path(r.run).name, r.schedule, f"{100 * r.fraction:.0f}%", f"{r.upto_step}/{r.total_steps}"]
        if f is None:
            table.add_row(*head, "-", r.note, f"{r.actual:.4f}", "-", "-", "-", "-", "-")
            continue
        table.add_row(
            *head,
            f"{f.final_loss:.4f}",
            f"[{f.low:.4f}, {f.high:.4f}]",
            f"{r.actual:.4f}",
            f"{100 * r.error:+.2f}%",
            "yes" if r.covered else "no",
            f"{f.distance:.1f}" + (" (own fit)" if f.source == "own fit" else ""),
            f"{f.power_law:.4f}",
            f"{100 * r.power_error:+.2f}%",
        )
    return table


def summarize(rows) -> list[dict]:
    """Per share of the steps and schedule (and "all"): mean and worst |error| of the law and the power law,
    and the share of actual losses inside each one's interval."""
    out = []
    for fraction in dict.fromkeys(r.fraction for r in rows):
        done = [r for r in rows if r.fraction == fraction and r.forecast is not None]
        for schedule in [*dict.fromkeys(r.schedule for r in done), "all"]:
            group = [r for r in done if schedule in ("all", r.schedule)]
            if not group:
                continue
            n = len(group)
            out.append(
                {
                    "fraction": fraction,
                    "schedule": schedule,
                    "runs": n,
                    "mean_error": sum(abs(r.error) for r in group) / n,
                    "worst_error": max(abs(r.error) for r in group),
                    "coverage": sum(bool(r.covered) for r in group) / n,
                    "power_mean_error": sum(abs(r.power_error) for r in group) / n,
                    "power_coverage": sum(bool(r.power_covered) for r in group) / n,
                }
            )
    return out


def _summary_table(rows, confidence: float):
    from rich.table import Table

    pct = round(100 * confidence)
    table = Table(title="by share of the steps seen and schedule: the law with priors against a plain power law")
    for name in ("seen", "schedule", "runs", "mean |error|", "worst", f"in {pct}% interval", "power law mean |error|",
                 f"power law in {pct}% interval"):  # fmt: skip
        table.add_column(name, justify="left" if name == "schedule" else "right")
    for s in summarize(rows):
        table.add_row(
            f"{100 * s['fraction']:.0f}%",
            s["schedule"],
            str(s["runs"]),
            f"{100 * s['mean_error']:.2f}%",
            f"{100 * s['worst_error']:.2f}%",
            f"{100 * s['coverage']:.0f}%",
            f"{100 * s['power_mean_error']:.2f}%",
            f"{100 * s['power_coverage']:.0f}%",
        )
    return table


def _row_dict(r) -> dict:
    out = {
        "run": r.run,
        "schedule": r.schedule,
        "fraction": r.fraction,
        "upto_step": r.upto_step,
        "total_steps": r.total_steps,
        "actual": r.actual,
        "error": r.error,
        "power_error": r.power_error,
        "covered": r.covered,
        "power_covered": r.power_covered,
        "note": r.note,
    }
    if r.forecast is not None:
        out.update(r.forecast.to_dict())
    return out
