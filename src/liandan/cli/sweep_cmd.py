"""`liandan sweep`: a hyperparameter search over real training runs, with pruning; resumable."""

from __future__ import annotations

import argparse
import csv
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liandan.config import ConfigError
from liandan.run import RunDir

if TYPE_CHECKING:
    from typing_extensions import Self


def add_commands(sub) -> None:
    p = sub.add_parser(
        "sweep",
        description=(
            "Run the trials of the sweep file SWEEP (TOML: base config, overrides, [params] to search, pruner)"
            " until its study holds `trials` completed or pruned ones. Running it again continues the study."
            " Writes <output_dir>/<study>/trials.csv and sweep.png."
        ),
    )
    p.add_argument("sweep", metavar="SWEEP", help="sweep file (TOML), e.g. configs/sweep-tiny.toml")
    p.add_argument(
        "--trials", type=int, metavar="N", help="completed or pruned trials the study should hold (default: the file's)"
    )
    p.add_argument(
        "--target-dim",
        type=int,
        metavar="DIM",
        help="print the best trial's settings for a model of this width (default: the file's target_dim)",
    )
    p.set_defaults(command=cmd_sweep)


def cmd_sweep(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(
            f"sweep takes no config overrides (got {overrides[0]}); put them in the sweep file's overrides"
        )
    if args.trials is not None and args.trials < 1:
        raise ConfigError(f"--trials = {args.trials} must be at least 1")
    if args.target_dim is not None and args.target_dim < 1:
        raise ConfigError(f"--target-dim = {args.target_dim} must be a width of at least 1")
    from liandan.plan.sweep import FINISHED, load_sweep, open_study, run_sweep
    from liandan.run.console import make_console

    spec = load_sweep(args.sweep, trials=args.trials, target_dim=args.target_dim)
    console = make_console(highlight=False)
    done_before = len(open_study(spec).get_trials(deepcopy=False, states=FINISHED))
    console.print(
        f"sweep {spec.study}: {len(spec.params)} parameter(s), {spec.trials} trials ({done_before} finished before),"
        f" pruner {spec.pruner}, scored by final {'validation' if spec.scored_by == 'val_loss' else 'training'} loss"
    )
    console.print(f"study: {spec.shown_storage}")
    for note in spec.notes:
        console.print(f"note: {note}")
    with _ProgressReporter(console, spec.trials, done_before) as reporter:
        result = run_sweep(spec, reporter)
    for note in result.notes:
        console.print(f"note: {note}")
    rows = trial_rows(result.study)
    console.print(_table(rows, list(spec.params)))
    best = best_row(rows, spec.direction)
    if best is not None:
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in best.params.items())
        console.print(f"best: trial {best.number}, {spec.scored_by} {best.value:.4f} ({params})")
        if spec.target_dim:
            for line in _target_lines(spec, best):
                console.print(line, markup=False)
    csv_path = write_trials_csv(rows, spec.study_dir / "trials.csv")
    label = f"final {'validation' if spec.scored_by == 'val_loss' else 'training'} loss"
    png = plot_sweep(result.study, rows, spec.study_dir / "sweep.png", label)
    console.print(f"trials: {csv_path}" + (f"\nplot: {png}" if png else ""))
    if result.gave_up:
        print(f"liandan: error: sweep stopped: {result.gave_up}", file=sys.stderr)
        return 1
    return 0


def _target_lines(spec, best: TrialRow) -> list[str]:
    """The best trial's settings at `spec.target_dim` (liandan.plan.transfer), or why there are none."""
    from liandan.config import load_config
    from liandan.plan.sweep import override
    from liandan.plan.transfer import target_settings

    try:
        cfg = load_config(spec.base, [*spec.overrides, *(override(k, v) for k, v in best.params.items())])
        return target_settings(cfg, spec.target_dim)
    except ConfigError as err:
        return [f"no settings for width {spec.target_dim}: {err}"]


class _ProgressReporter:
    """A progress bar over the trials, the running trial's step and loss beside it, a line per trial."""

    def __init__(self, console, total: int, finished: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console, self.total = console, total
        self.progress = Progress(
            TextColumn("[bold]sweep"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            transient=True,
        )
        self.task = self.progress.add_task("sweep", total=total, completed=min(finished, total), status="")

    def __enter__(self) -> Self:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def trial_started(self, number: int, params: dict[str, Any]) -> None:
        self.progress.update(self.task, status=f"trial {number}: starting")

    def trial_step(self, number: int, step: int, total: int, loss: float) -> None:
        self.progress.update(self.task, status=f"trial {number}: step {step}/{total}, loss {loss:.4f}")

    def trial_finished(self, trial, finished: int) -> None:
        self.progress.update(self.task, completed=min(finished, self.total), status="")
        a = trial.user_attrs
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in trial.params.items())
        state = trial.state.name.lower()
        outcome = f"value {trial.value:.4f}" if state == "complete" else a.get("note", "")
        when = f"{a.get('steps', 0)} steps, {a.get('seconds', 0):.1f}s" if "seconds" in a else ""
        self.console.print(f"trial {trial.number} {state}: {outcome} ({params})" + (f", {when}" if when else ""))


# ---------------------------------------------------------------------------------------------------------
# results: the table, trials.csv, sweep.png


@dataclass(frozen=True)
class TrialRow:
    number: int
    state: str  # complete, pruned, fail, running
    value: float | None
    params: dict[str, Any]
    steps: int | None
    seconds: float | None
    run_dir: str
    note: str


def trial_rows(study) -> list[TrialRow]:
    """Every trial of the study; the value only of completed ones (Optuna gives a pruned trial its last
    reported training loss, which is not the objective)."""
    return [
        TrialRow(
            t.number,
            t.state.name.lower(),
            t.value if t.state.name == "COMPLETE" else None,
            dict(t.params),
            t.user_attrs.get("steps"),
            t.user_attrs.get("seconds"),
            t.user_attrs.get("run_dir", ""),
            t.user_attrs.get("note", ""),
        )
        for t in study.get_trials(deepcopy=False)
    ]


def best_row(rows: Sequence[TrialRow], direction: str = "minimize") -> TrialRow | None:
    done = [r for r in rows if r.state == "complete" and r.value is not None]
    if not done:
        return None
    return (min if direction == "minimize" else max)(done, key=lambda r: r.value)


def write_trials_csv(rows: Sequence[TrialRow], path: Path) -> Path:
    """One line per trial: number, state, value, steps, seconds, one column per parameter, run_dir, note."""
    keys = list(dict.fromkeys(k for r in rows for k in r.params))
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["number", "state", "value", "steps", "seconds", *keys, "run_dir", "note"])
        for r in rows:
            cells = [r.number, r.state, "" if r.value is None else repr(r.value), r.steps, r.seconds]
            writer.writerow([*cells, *(r.params.get(k, "") for k in keys), r.run_dir, r.note])
    return path


def _table(rows: Sequence[TrialRow], keys: Sequence[str]):
    from rich.table import Table

    table = Table(title="trials")
    for name, justify in [("#", "right"), ("params", "left"), ("state", "left"), ("value", "right")]:
        table.add_column(name, justify=justify)
    table.add_column("steps", justify="right")
    table.add_column("seconds", justify="right")
    for r in rows:
        params = ", ".join(f"{k}={_fmt(r.params[k])}" for k in keys if k in r.params)
        value = "" if r.value is None else f"{r.value:.4f}"
        seconds = "" if r.seconds is None else f"{r.seconds:.1f}"
        table.add_row(str(r.number), params, r.state, value, "" if r.steps is None else str(r.steps), seconds)
    return table


def _fmt(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def most_important_param(study) -> str | None:
    """The parameter that matters most to the objective (Optuna's default importance evaluator over the
    completed trials), or the first parameter when there are too few trials to say."""
    import warnings

    import optuna

    names = list(dict.fromkeys(k for t in study.get_trials(deepcopy=False) for k in t.params))
    if len(names) <= 1:
        return names[0] if names else None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return next(iter(optuna.importance.get_param_importances(study)), names[0])
    except (RuntimeError, ValueError, ZeroDivisionError):
        return names[0]


def _curve(run_dir: str) -> tuple[list[int], list[float]]:
    steps, losses = [], []
    if run_dir:
        for record in RunDir(Path(run_dir)).read_metrics():
            try:
                step, loss = int(record["step"]), float(record["loss"])
            except (ValueError, KeyError, TypeError):
                continue
            if math.isfinite(loss):
                steps.append(step)
                losses.append(loss)
    return steps, losses


def plot_sweep(study, rows: Sequence[TrialRow], out: Path, value_label: str) -> Path | None:
    """Loss curves of every trial whose run directory is here (pruned ones dashed), and the value of each
    trial against the parameter that matters most. Returns the path, or None with nothing to plot."""
    curves = {r.number: _curve(r.run_dir) for r in rows}
    if not any(steps for steps, _ in curves.values()):
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_curves, ax_param) = plt.subplots(1, 2, figsize=(12, 4.2))
    colors = plt.get_cmap("tab10")
    for r in rows:
        steps, losses = curves[r.number]
        if steps:
            style = {"complete": "-", "pruned": "--"}.get(r.state, ":")
            ax_curves.plot(steps, losses, style, lw=1, color=colors(r.number % 10), label=f"#{r.number} {r.state}")
    starts = [curves[r.number][1][0] for r in rows if r.state == "complete" and curves[r.number][1]]
    if starts:  # a diverged trial would squash the others
        low = min(min(losses) for _, losses in curves.values() if losses)
        ax_curves.set_ylim(low - 0.05 * (max(starts) - low), max(starts) * 1.02)
    ax_curves.set(title="training loss (pruned dashed, failed dotted)", xlabel="step", ylabel="loss")
    if len(rows) <= 12:
        ax_curves.legend(fontsize=7)
    param = most_important_param(study)
    if param is not None:
        done = [r for r in rows if r.state == "complete" and param in r.params and r.value is not None]
        ax_param.scatter([r.params[param] for r in done], [r.value for r in done], label="complete")
        pruned = [t for t in study.get_trials(deepcopy=False) if t.state.name == "PRUNED" and param in t.params]
        last = [(t.params[param], t.intermediate_values[t.last_step]) for t in pruned if t.last_step is not None]
        last = [(x, y) for x, y in last if math.isfinite(y)]
        if done:  # pruned trials far off the scale (diverged ones) are drawn at its top
            values = [r.value for r in done]
            top = max(values) + max(0.5 * (max(values) - min(values)), 0.05 * abs(max(values)))
            last = [(x, min(y, top)) for x, y in last]
        if last:
            ax_param.scatter(
                *zip(*last), marker="x", color="gray", label="pruned: last reported training loss (capped)"
            )
        distributions = [t.distributions.get(param) for t in study.get_trials(deepcopy=False)]
        if any(getattr(d, "log", False) for d in distributions):
            ax_param.set_xscale("log")
        ax_param.set(
            title=f"{value_label} of each trial", xlabel=f"{param} (the most important parameter)", ylabel="loss"
        )
        ax_param.legend(fontsize=7)
    for ax in (ax_curves, ax_param):
        ax.grid(alpha=0.3)
    fig.suptitle(f"sweep {study.study_name}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
