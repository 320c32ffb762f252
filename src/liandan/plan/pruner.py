"""`ForecastPruner`: an Optuna pruner on the grounds of `liandan.plan.live_forecast`. It prunes a trial when
the low end of its final-loss forecast is worse than the best completed trial's final training loss. Needs the
[sweep] extra (Optuna)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from liandan.plan.forecast import Forecast, forecast_final_loss


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
    studies that minimize a loss. `fit` is the forecast (`forecast_final_loss`'s signature).
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
        fit: Callable[..., Forecast] = forecast_final_loss,
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
        self._fit = fit  # forecast_final_loss, or a replay's memo of it (plan.sweep_replay)
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
            f = self._fit(
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
