"""Forecasts of a run's final loss while it runs, from its loss curve so far and its known schedule
(the learning-rate-annealing law of `liandan.plan.forecast`): inside training, and for a sweep's pruner.

`LiveForecaster` collects a run's (step, loss) records and every `every` steps forecasts its final loss. It
knows nothing of the trainer: the callback in `liandan.plan.forecast_callback` feeds it and writes each forecast
as a "forecast" event into the run's events.jsonl. It never raises: with a curve too short to forecast from it skips
quietly, and a fit that fails is skipped with a debug note.

The flag: a run is flagged as worse than `reference_loss` when the forecast's lower bound, not its central
value, lies above it. The lower bound of the 80% interval is the optimistic end, so a flag says that even the
optimistic outcome is worse; early in a run the central forecast of small runs is biased high by up to 20%
(docs/planning.md), and flagging on it would raise alarms for runs that end up fine. Each forecast event
also says whether the central value is worse, the softer signal.

`ForecastPruner` (`liandan.plan.pruner`, with Optuna) prunes a sweep's trials on the same grounds.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from liandan.config import Config, ConfigError
from liandan.plan.forecast import forecast_final_loss, schedule_fractions
from liandan.plan.forecast_features import RunFeatures, features_of

log = logging.getLogger(__name__)

LIVE_SAMPLES = 16  # accepted for configs of the earlier bootstrap interval; the interval is conformal now (one fit)


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
    seconds: float  # what the fit took (in the forecast thread, not the training loop, when run in the background)
    target: str = ""  # what is forecast, in words (`Forecast.target`)
    distance: float = 0.0  # from the nearest library run (`Forecast.distance`)
    source: str = "library"  # "own fit" when the run is far from the library
    reference_loss: float | None = None
    worse_than_reference: bool | None = None  # the flag: the lower bound is worse than the reference
    central_worse_than_reference: bool | None = None  # the softer signal: the central value is
    published_step: int | None = None  # the step after which the training loop wrote it (background forecasts)

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
        features: RunFeatures | None = None,
    ):
        if every < 1:
            raise ValueError(f"every = {every} must be at least 1")
        self.lr_fractions = np.asarray(lr_fractions, dtype=np.float64)
        self.total_steps = int(total_steps)
        self.every = int(every)
        self.reference_loss = float(reference_loss) or None
        self.samples, self.confidence = samples, confidence
        self.features = features  # the run's, for the library's runs most like it and its distance from them
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
        kwargs.setdefault("features", features_of(cfg))
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
        return self.compute(*self.take_due())

    def take_due(self) -> tuple[list[int], list[float]]:
        """The records to forecast from now (copies, for another thread to fit), the next forecast falling
        due at the next multiple of `every`."""
        self._next_due = (self.steps[-1] // self.every + 1) * self.every
        return list(self.steps), list(self.losses)

    def compute(self, steps: Sequence[int], losses: Sequence[float]) -> LiveForecast | None:
        """The forecast from these records, or None. Reads nothing of the forecaster that changes while a run
        trains, so it may run in another thread while the records grow. Never raises."""
        step = steps[-1]
        started = time.perf_counter()
        try:
            f = forecast_final_loss(
                steps,
                losses,
                self.lr_fractions,
                self.total_steps,
                samples=self.samples,
                confidence=self.confidence,
                features=self.features,
            )
        except ConfigError:  # the curve is too short yet
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
            target=f.target,
            distance=round(f.distance, 3),
            source=f.source,
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
