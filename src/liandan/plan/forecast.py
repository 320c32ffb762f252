"""Forecast a run's final loss from its partial loss curve, knowing its whole learning-rate schedule and
what other finished runs teach.

The curve is the learning-rate-annealing law of Tissue et al. 2024 (`forecast_law`): L = L0 + A * S1^-alpha
- D * R, with S1 the area under the rate and R its drops so far, each answered after tau updates. A prefix
of a run cannot tell everything: its cooldown may lie ahead (D and tau unseen), and a short stretch of curve
fits many alphas that part at the end. Those come from the finished runs the forecast learns from
(`forecast_library`): the shipped library of tiny real runs on four schedules, joined by the user's own
finished runs (`liandan forecast --library DIR`, and the run's sibling directories). Each of those runs,
fitted whole, lends its curve's shape: its law put on this run's schedule and length, its level scaled to
this run's records. The shapes' forecasts are averaged in log, weighed by how well each fits the records
(their weight capped at `LawPriors.evidence`, as a law is only approximately a curve) and by how alike the
runs are (model size, tokens per step, learning rate, data); the run's own law (a MAP fit under priors from
the alike runs) joins with weight (share seen)^2, and the median error of the library's own forecasts from
as far in is taken off (`forecast_library.combined_forecast`, `Calibration.bias`).

Robustness: a spike (a record far above the median of those before it) is left out with its recovery; the
run's own law is fitted with a soft-L1 loss; a step logged twice keeps its last record; the warmup's
records, the noisiest, are not fitted.

The interval is conformal: the library's runs, each forecast from 10%..90% of its steps with everything
learned from the others (leave-one-run-out), give log(forecast / actual), and the interval at confidence c
from a share f of the steps is forecast * exp(+-q), q the conformal c-quantile of |score - median| at f. docs/benchmarks.md
has the held-out backtests and their coverage.

Runs unlike the library (`forecast_features`): a forecast measures its run's distance from the nearest run it
learns from (model size, tokens per step, learning rate, data, optimizer), widens its interval with it, and
past `FALLBACK_DISTANCE` is the run's own law alone. The calibration is read where a library run had seen as
much curve past its warmup, so a long warmup widens the interval too. A curve too short to tell anything is
refused in one line that names the steps it needs (`Curve.check_length`). Every forecast states its target
(`Forecast.target`): the training loss at the run's last step.

A schedule-free power law in steps, L = a + b * s^(-c), is fitted alongside for comparison, its interval
calibrated the same way.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from liandan.config import ConfigError
from liandan.plan.forecast_features import library_equivalent
from liandan.plan.forecast_law import (
    MIN_POINTS,
    Curve,
    LawFit,
    LawPriors,
    PowerLawFit,
    annealing_areas,
    clean_records,
    fit_power,
    schedule_fractions,
)
from liandan.plan.forecast_library import (
    Library,
    RunCurve,
    RunFeatures,
    combined_forecast,
    default_library,
    library_runs,
    measured_final_loss,
    read_run,
    with_project,
)

__all__ = [
    "MIN_POINTS",
    "BacktestRow",
    "Forecast",
    "Library",
    "RunCurve",
    "RunFeatures",
    "annealing_areas",
    "backtest",
    "clean_records",
    "fit_annealing_law",
    "fit_power_law",
    "forecast_final_loss",
    "forecast_run",
    "measured_final_loss",
    "read_run",
    "schedule_fractions",
]


@dataclass(frozen=True)
class Forecast:
    final_loss: float  # expected training loss at the last step, annealing law
    low: float  # interval at `confidence`
    high: float
    confidence: float
    observed_fraction: float  # last observed step / total steps
    observed_step: int
    total_steps: int
    current_loss: float  # the fitted curve at the last observed step
    annealing_seen: float  # share of the final annealing area S2 already behind the run (1 for constant LR)
    power_law: float  # the schedule-free forecast, with its interval
    power_low: float
    power_high: float
    fit: LawFit = field(repr=False)
    power_fit: PowerLawFit = field(repr=False)
    prior_runs: int = 0  # the finished runs the priors and the interval were learned from
    target_tokens: int | None = None  # the tokens trained on at the last step (None: tokens per step unknown)
    distance: float = 0.0  # from the nearest run learned from, in units (`forecast_features`; 0: not compared)
    nearest: str = ""  # that run
    reach: str = ""  # the distance in words: what sets this run apart from it
    source: str = "library"  # "library": its runs' shapes and the run's own law; "own fit": the run's law alone
    widening: float = 1.0  # the factor on the calibrated interval's half-width for the distance

    @property
    def target(self) -> str:
        """What is forecast, in words."""
        tokens = f" ({self.target_tokens:,} tokens)" if self.target_tokens else ""
        return f"training loss at step {self.total_steps}{tokens}, the last step, its batch noise averaged out"

    def to_dict(self) -> dict[str, float | int | str]:
        keys = ("final_loss", "low", "high", "confidence", "observed_fraction", "observed_step", "total_steps")
        keys += ("current_loss", "annealing_seen", "power_law", "power_low", "power_high", "prior_runs")
        keys += ("target", "target_tokens", "distance", "nearest", "reach", "source", "widening")
        out: dict[str, float | int | str] = {k: getattr(self, k) for k in keys}
        fit = self.fit
        out.update(L0=fit.L0, A=fit.A, alpha=fit.alpha, C=fit.C, D=fit.D, decay=fit.decay)
        return out


def fit_annealing_law(
    steps: Sequence[int],
    losses: Sequence[float],
    lr_fractions: Sequence[float],
    decay: float | None = None,
    *,
    total_steps: int | None = None,
    priors: LawPriors | None = None,
) -> LawFit:
    """Fit the law to logged (step, loss) records of a run whose updates use `lr_fractions` (the whole
    schedule, any scale). `decay` fixes lambda = 1 - 1/tau; None takes tau from the priors, or from the
    data once 30% of the annealing is behind the run. `priors`: default the shipped library's."""
    curve = Curve(steps, losses, lr_fractions, total_steps)
    priors = priors or default_library().priors
    if decay is not None:
        priors = replace(priors, log_tau=math.log(1.0 / (1.0 - decay) / curve.total_steps), tau_width=1e-6)
    return curve.fit(curve.window(), priors)[0]


def fit_power_law(steps: Sequence[int], losses: Sequence[float], skip: int = 0) -> PowerLawFit:
    """Fit L = a + b * s^-c (s: updates done) to the records after `skip` updates."""
    import numpy as np

    from liandan.plan.forecast_law import Window

    updates, loss = clean_records(steps, losses)
    keep = updates >= max(skip, 1)
    if keep.sum() < MIN_POINTS:
        raise ConfigError(f"only {int(keep.sum())} loss records to fit; a forecast needs at least {MIN_POINTS}")
    return fit_power(Window.make(updates[keep], np.asarray(loss[keep])))


def forecast_final_loss(
    steps: Sequence[int],
    losses: Sequence[float],
    lr_fractions: Sequence[float],
    total_steps: int | None = None,
    *,
    decay: float | None = None,
    confidence: float = 0.8,
    library: Library | None = None,
    features: RunFeatures | None = None,
    samples: int | None = None,
    seed: int | None = None,
) -> Forecast:
    """Forecast the training loss at the last step from the records logged so far; no run directory needed.

    steps, losses: the logged records (1-based steps, as in metrics.jsonl); non-finite losses are ignored.
    lr_fractions: the learning rate of every update of the whole run (any scale; divided by its peak).
    total_steps: the run's length (default len(lr_fractions)). decay: lambda, None to choose (see
    `fit_annealing_law`). library: the priors and calibration (default: the shipped library's; see
    `forecast_library.with_project`); `features` (model size, tokens per step, learning rate, data,
    optimizer) let the library's runs most like this one teach most and measure how far the run lies from
    them. `samples` and `seed` are accepted for callers of the earlier bootstrap interval and unused: the
    interval is conformal, one fit per forecast.
    Raises ConfigError, one line naming the steps it needs, when the curve is too short.
    """
    del samples, seed
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence = {confidence} must lie in (0, 1)")
    library = library or default_library()
    curve = Curve(steps, losses, lr_fractions, total_steps)
    priors = library.priors_for(features)
    curve.check_length(priors.skip)
    data = curve.window(skip_share=priors.skip)
    if decay is not None:
        priors = replace(priors, log_tau=math.log(1.0 / (1.0 - decay) / curve.total_steps), tau_width=1e-6)
    reach = library.reach(features)
    alike = library.alike(features)
    point, fit = combined_forecast(curve, data, alike, priors, own_only=reach.far)
    power_fit = fit_power(data)
    observed = int(data.updates[-1])
    fraction = min(1.0, curve.observed / curve.total_steps)
    # the calibration is read where a library run had seen as much curve after its warmup
    seen = library_equivalent(curve.observed, curve.warmup_end, curve.total_steps)
    calibration = library.calibration.of(None if features is None else features.optimizer)
    q = calibration.half_width(seen, confidence, "law")
    qp = calibration.half_width(seen, confidence, "power")
    if reach.far:  # the run's own law, whose errors the calibration does not hold: the wider of the two
        q = max(q, qp)
    else:  # corrected by the median error of the library's forecasts from as far into their runs
        point *= math.exp(-calibration.bias(seen, "law"))
    widening = reach.widening()
    q, qp = q * widening, qp * widening
    power_point = float(power_fit.at(curve.end))
    return Forecast(
        final_loss=point,
        low=point * math.exp(-q),
        high=point * math.exp(q),
        confidence=confidence,
        observed_fraction=fraction,
        observed_step=curve.observed,
        total_steps=curve.total_steps,
        current_loss=float(fit.at(observed)),
        annealing_seen=curve.annealing_seen(observed),
        power_law=power_point,
        power_low=power_point * math.exp(-qp),
        power_high=power_point * math.exp(qp),
        fit=fit,
        power_fit=power_fit,
        prior_runs=len(alike),
        target_tokens=None if features is None else round(curve.total_steps * features.tokens_per_step),
        distance=reach.distance,
        nearest=reach.nearest,
        reach=reach.describe(),
        source="own fit" if reach.far else "library",
        widening=widening,
    )


# ---------------------------------------------------------------------------------------------------------
# runs on disk


def forecast_run(
    run_dir: str | Path, upto_step: int | None = None, *, libraries: Sequence[str | Path] | None = None, **kwargs
) -> Forecast:
    """Forecast the final loss of the run in `run_dir` from its records up to `upto_step` (default: all).

    The priors learn from the shipped library and the finished runs in `libraries` (default: the run's
    parent directory, the run itself left out)."""
    run = read_run(run_dir)
    upto = upto_step if upto_step is not None else run.total_steps
    if run.diverged_at is not None and run.diverged_at <= upto:
        raise ConfigError(
            f"{run.run_dir}: the loss is not finite from step {run.diverged_at} on; a forecast from the finite "
            f"steps before it would hide the divergence (--upto {run.diverged_at - 1} forecasts from before it)"
        )
    keep = run.steps <= upto
    if not keep.any():
        raise ConfigError(f"{run.run_dir} has no loss records yet" + (f" up to step {upto_step}" if upto_step else ""))
    if "library" not in kwargs:
        dirs = [Path(run_dir).absolute().parent] if libraries is None else list(libraries)
        kwargs["library"] = with_project(dirs, exclude=[run_dir])
    try:
        return forecast_final_loss(
            run.steps[keep], run.losses[keep], run.lr_fractions, run.total_steps, features=run.features, **kwargs
        )
    except ConfigError as err:
        raise ConfigError(f"{run.run_dir}: {err}") from None


@dataclass(frozen=True)
class BacktestRow:
    run: str
    schedule: str
    fraction: float  # share of the steps the forecast saw
    upto_step: int
    total_steps: int
    actual: float  # measured final loss
    forecast: Forecast | None  # None when too few records were seen
    note: str = ""

    @property
    def error(self) -> float | None:
        """Relative error of the annealing-law forecast: (forecast - actual) / actual."""
        return None if self.forecast is None else (self.forecast.final_loss - self.actual) / self.actual

    @property
    def power_error(self) -> float | None:
        return None if self.forecast is None else (self.forecast.power_law - self.actual) / self.actual

    @property
    def covered(self) -> bool | None:
        f = self.forecast
        return None if f is None else f.low <= self.actual <= f.high

    @property
    def power_covered(self) -> bool | None:
        f = self.forecast
        return None if f is None else f.power_low <= self.actual <= f.power_high


def backtest_curves(
    runs: Sequence[RunCurve], fractions: Sequence[float] = (0.1, 0.2, 0.5), library: Library | None = None, **kwargs
) -> list[BacktestRow]:
    """Replay finished runs: forecast each from the first `fractions` of its steps, against its measured
    final loss (`measured_final_loss`)."""
    library = library or default_library()
    rows = []
    for run in runs:
        if run.diverged_at is not None:
            raise ConfigError(
                f"{run.run_dir}: the loss is not finite from step {run.diverged_at} on; nothing to replay"
            )
        if not run.finished:
            last = int(run.steps[-1]) if len(run.steps) else 0
            raise ConfigError(
                f"{run.run_dir} is not finished (step {last} of {run.total_steps}); backtests replay finished runs"
            )
        if str(run.run_dir) in library.runs or run.name in library.runs:
            raise ConfigError(f"{run.run_dir} is one of the runs the priors learned from; a backtest needs others")
        actual = measured_final_loss(run.steps, run.losses)
        for fraction in fractions:
            if not 0.0 < fraction <= 1.0:
                raise ConfigError(f"backtest fraction {fraction} must lie in (0, 1]")
            upto = max(1, round(fraction * run.total_steps))
            keep = run.steps <= upto
            forecast, note = None, ""
            try:
                forecast = forecast_final_loss(
                    run.steps[keep],
                    run.losses[keep],
                    run.lr_fractions,
                    run.total_steps,
                    library=library,
                    features=run.features,
                    **kwargs,
                )
            except ConfigError as err:
                note = str(err)
            rows.append(
                BacktestRow(str(run.run_dir), run.schedule, fraction, upto, run.total_steps, actual, forecast, note)
            )
    return rows


def backtest(
    run_dirs: Sequence[str | Path],
    fractions: Sequence[float] = (0.1, 0.2, 0.5),
    *,
    libraries: Sequence[str | Path] = (),
    **kwargs,
) -> list[BacktestRow]:
    """Replay finished run directories (none: the shipped held-out runs) with priors from the shipped library
    and the finished runs in `libraries`, the replayed runs left out."""
    runs = [read_run(d) for d in run_dirs] if run_dirs else library_runs("heldout")
    library = with_project(libraries, exclude=run_dirs) if libraries else default_library()
    return backtest_curves(runs, fractions, library, **kwargs)
