"""The live loss forecast as a training callback, registered as "forecast" (`--forecast.every=N`).

Importing this module registers it; `liandan train` does so in every process that trains.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liandan.config import Config
from liandan.train.callbacks import Callback, register_callback

if TYPE_CHECKING:
    from liandan.plan.live_forecast import LiveForecaster
    from liandan.train.trainer import Trainer


class ForecastCallback(Callback):
    """Every `forecast.every` steps, on the main rank, a "forecast" event in events.jsonl and a console line;
    once, when even the forecast's lower bound is worse than `forecast.reference_loss`, a
    "forecast_worse_than_reference" event and a warning. Training itself is untouched."""

    order = 12  # right after the metrics it reads are logged

    def __init__(self, forecaster: LiveForecaster):
        self.forecaster = forecaster
        self.active = False

    def on_train_start(self, trainer: Trainer) -> None:
        self.active = trainer.dist.is_main
        if self.active and trainer.step > 0:  # resumed: the curve so far is in metrics.jsonl
            records = [
                (r["step"], r["loss"])
                for r in trainer.room.read_metrics()
                if r["step"] <= trainer.step and isinstance(r.get("loss"), (int, float))
            ]
            self.forecaster.resume([s for s, _ in records], [x for _, x in records])

    def after_step(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if not self.active or not isinstance(metrics.get("loss"), (int, float)):
            return
        self.forecaster.observe(step, metrics["loss"])
        if not self.forecaster.due():
            return
        f = self.forecaster.forecast()
        if f is None:
            return
        trainer.logger.log_event("forecast", **f.to_event())
        pct = round(100 * f.confidence)
        trainer.say(
            f"step {step}: forecast final loss {f.final_loss:.4f}, {pct}% interval [{f.low:.4f}, {f.high:.4f}]"
            f" at step {f.total_steps} ({f.seconds:.2f}s)"
        )
        if self.forecaster.newly_flagged(f):
            ref = f.reference_loss
            trainer.logger.log_event(
                "forecast_worse_than_reference",
                step=step,
                final_loss=f.final_loss,
                low=f.low,
                high=f.high,
                reference_loss=ref,
                observed_fraction=f.observed_fraction,
            )
            trainer.say(
                f"warning: step {step}: forecast final loss {f.final_loss:.4f} is worse than the reference"
                f" {ref:.4f} even at the low end of its {pct}% interval ({f.low:.4f});"
                f" from {100 * f.observed_fraction:.0f}% of the run"
            )


@register_callback("forecast")
def forecast_callback(cfg: Config) -> ForecastCallback | None:
    if not cfg.forecast.every:
        return None
    from liandan.plan.live_forecast import LiveForecaster  # numpy, scipy: only when asked for

    return ForecastCallback(LiveForecaster.from_config(cfg))
