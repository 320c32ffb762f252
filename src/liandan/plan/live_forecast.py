"""Forecasts of a run's final loss while it runs, from its loss curve so far and its known schedule
(the learning-rate-annealing law of `liandan.plan.forecast`): inside training, and for a sweep's pruner.

`LiveForecaster` collects a run's (step, loss) records and every `every` steps forecasts its final loss. It
knows nothing of the trainer: the callback in `liandan.plan.forecast_callback` feeds it and writes each forecast
as a "forecast" event into the run's events.jsonl. It never raises: with too few records past the warmup it skips
quietly, and a fit that fails is skipped with a debug note.

The flag: a run is flagged as worse than `reference_loss` when the forecast's lower bound, not its central
value, lies above it. The lower bound of the 80% interval is the optimistic end, so a flag says that even the
optimistic outcome is worse; early in a run the central forecast of small runs is biased high by up to 20%
(docs/planning.md), and flagging on it would raise alarms for runs that end up fine. Each forecast event
also says whether the central value is worse, the softer signal.

`ForecastPruner` is an Optuna pruner on the same grounds: it prunes a trial when the low end of its forecast
is worse than the best completed trial's final training loss.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from liandan.config import Config, ConfigError
from liandan.plan.forecast import forecast_final_loss, schedule_fractions

log = logging.getLogger(__name__)

LIVE_SAMPLES = 16  # bootstrap refits per live forecast: about half a second each here, a third of the default 48


@dataclass(frozen=True)
class LiveForecast:
    """One forecast, as the "forecast" event of events.jsonl holds it (`to_event`)."""

    step: int  # the last step whose loss the forecast saw
    total_steps: int
    final_loss: float  # forecast training loss at the last step (central value)
    low: float  # interval at `confidence`
    high: float
    confidence: float
    observed_fraction: float
    annealing_seen: float
    power_law: float  # the schedule-free power law's forecast, for comparison
    seconds: float  # what the forecast cost the training process
    reference_loss: float | None = None
    worse_than_reference: bool | None = None  # the flag: the lower bound is worse than the reference
    central_worse_than_reference: bool | None = None  # the softer signal: the central value is

    def to_event(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


class LiveForecaster:
    """Holds a run's loss curve and forecasts its final loss every `every` steps.

    lr_fractions: the learning rate of every update of the run (`schedule_fractions`); total_steps its
    length. reference_loss: 0 for no flag. `samples` and `confidence` as in `forecast_final_loss`.
    """

    def __init__(
        self,
        lr_fractions: Sequence[float],
        total_steps: int,
        every: int,
        reference_loss: float = 0.0,
        *,
        samples: int = LIVE_SAMPLES,
        confidence: float = 0.8,
    ):
        if every < 1:
            raise ValueError(f"every = {every} must be at least 1")
        self.lr_fractions = np.asarray(lr_fractions, dtype=np.float64)
        self.total_steps = int(total_steps)
        self.every = int(every)
        self.reference_loss = float(reference_loss) or None
        self.samples, self.confidence = samples, confidence
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.flagged = False  # the flag is raised once; later forecasts still say whether they are worse
        self._next_due = self.every

    @classmethod
    def from_config(cls, cfg: Config, **kwargs) -> LiveForecaster | None:
        """The forecaster `[forecast]` asks for, or None when `forecast.every` is 0."""
        if not cfg.forecast.every:
            return None
        lr = schedule_fractions(cfg.schedule, cfg.train.steps)
        return cls(lr, cfg.train.steps, cfg.forecast.every, cfg.forecast.reference_loss, **kwargs)

    def observe(self, step: int, loss: float) -> None:
        """Add the loss logged at `step` (1-based, as in metrics.jsonl). Steps already seen are ignored."""
        if self.steps and step <= self.steps[-1]:
            return
        self.steps.append(int(step))
        self.losses.append(float(loss))

    def resume(self, steps: Sequence[int], losses: Sequence[float]) -> None:
        """Take the records a resumed run logged before; the next forecast is due at the next multiple of
        `every` after them."""
        for step, loss in zip(steps, losses):
            self.observe(step, loss)
        if self.steps:
            self._next_due = (self.steps[-1] // self.every + 1) * self.every

    def due(self) -> bool:
        """Whether a forecast is due at the last observed step: the first logged step at or past each
        multiple of `every`, never at the last step (there is nothing left to forecast) nor after a
        non-finite loss (the trainer reports those itself)."""
        if not self.steps:
            return False
        step = self.steps[-1]
        return step >= self._next_due and step < self.total_steps and math.isfinite(self.losses[-1])

    def forecast(self) -> LiveForecast | None:
        """Forecast from the records so far, or None (too few records, or the fit failed). Never raises."""
        step = self.steps[-1]
        self._next_due = (step // self.every + 1) * self.every
        started = time.perf_counter()
        try:
            f = forecast_final_loss(
                self.steps,
                self.losses,
                self.lr_fractions,
                self.total_steps,
                samples=self.samples,
                confidence=self.confidence,
            )
        except ConfigError:  # too few records past the warmup yet
            return None
        except Exception as err:  # noqa: BLE001 - a failed fit must never stop the training it describes
            log.debug("forecast at step %d skipped: %s: %s", step, type(err).__name__, err)
            return None
        if not all(map(math.isfinite, (f.final_loss, f.low, f.high))):
            log.debug("forecast at step %d skipped: non-finite result %r", step, f)
            return None
        ref = self.reference_loss
        return LiveForecast(
            step=step,
            total_steps=self.total_steps,
            final_loss=f.final_loss,
            low=f.low,
            high=f.high,
            confidence=f.confidence,
            observed_fraction=f.observed_fraction,
            annealing_seen=f.annealing_seen,
            power_law=f.power_law,
            seconds=round(time.perf_counter() - started, 4),
            reference_loss=ref,
            worse_than_reference=None if ref is None else f.low > ref,
            central_worse_than_reference=None if ref is None else f.final_loss > ref,
        )

    def newly_flagged(self, forecast: LiveForecast) -> bool:
        """True the first time a forecast's lower bound is worse than the reference."""
        if forecast.worse_than_reference and not self.flagged:
            self.flagged = True
            return True
        return False


# ---------------------------------------------------------------------------------------------------------
# the forecast pruner


@dataclass
class PartialCurve:
    """A trial's training losses so far (1-based steps, as logged) and its whole learning-rate schedule."""

    steps: list[int]
    losses: list[float]
    lr_fractions: np.ndarray


class ForecastPruner(optuna.pruners.BasePruner):
    """Prune a trial when the low end of its final-loss forecast is above the best completed trial's final
    training loss, so that even the optimistic outcome would not beat it, and the trial is behind that trial
    at the same step.

    `curve(trial)` gives the trial's loss curve so far; without it the curve is the trial's reported
    intermediate values (step -> loss) under the schedule `lr_fractions`. The reference is the best completed
    trial's user attribute `reference_attr` (the sweep records its measured final training loss there, which a
    training-loss forecast can be compared with whatever the objective is), else its value. Two guards against
    the high bias of early forecasts (docs/planning.md): no pruning before `min_fraction` of the steps, and
    none while the trial's last reported value is no worse than the best trial's at the same step. Only for
    studies that minimize a loss.
    """

    def __init__(
        self,
        lr_fractions: Sequence[float] | None = None,
        *,
        curve: Callable[[FrozenTrial], PartialCurve | None] | None = None,
        confidence: float = 0.8,
        samples: int = 16,
        min_fraction: float = 0.3,
        reference_attr: str = "final_train_loss",
        seed: int = 0,
    ):
        if curve is None and lr_fractions is None:
            raise ValueError("ForecastPruner needs lr_fractions or a curve function")
        if not 0.0 < confidence < 1.0:
            raise ValueError(f"confidence = {confidence} must lie in (0, 1)")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 0:
            raise ValueError(f"samples = {samples!r} must be a non-negative integer")
        if not 0.0 <= min_fraction < 1.0:
            raise ValueError(f"min_fraction = {min_fraction} must lie in [0, 1)")
        self._lr = None if lr_fractions is None else np.asarray(lr_fractions, dtype=np.float64)
        self._curve = curve or self._reported_curve
        self.confidence, self.samples, self.min_fraction = confidence, samples, min_fraction
        self.reference_attr, self.seed = reference_attr, seed
        self.last: dict[int, tuple[float, float, float, float]] = {}  # trial number -> (forecast, low, high, reference)

    def _reported_curve(self, trial: FrozenTrial) -> PartialCurve | None:
        steps = sorted(trial.intermediate_values)
        return PartialCurve(steps, [trial.intermediate_values[s] for s in steps], self._lr)

    def prune(self, study: optuna.Study, trial: FrozenTrial) -> bool:
        if study.direction != optuna.study.StudyDirection.MINIMIZE:
            return False
        completed = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
        curve = self._curve(trial)
        if not completed or curve is None or not curve.steps:
            return False
        if curve.steps[-1] < self.min_fraction * len(curve.lr_fractions):
            return False
        best = min(completed, key=lambda t: t.value)
        step = trial.last_step
        ours, theirs = trial.intermediate_values.get(step), best.intermediate_values.get(step)
        if ours is not None and theirs is not None and ours <= theirs:
            return False  # level with the best so far: an early forecast's bias is likelier than a worse end
        reference = float(best.user_attrs.get(self.reference_attr, best.value))
        try:
            f = forecast_final_loss(
                curve.steps,
                curve.losses,
                curve.lr_fractions,
                confidence=self.confidence,
                samples=self.samples,
                seed=self.seed,
            )
        except Exception:  # noqa: BLE001 - too few records past the warmup or a failed fit: no grounds to prune
            return False
        self.last[trial.number] = (f.final_loss, f.low, f.high, reference)
        return f.low > reference
