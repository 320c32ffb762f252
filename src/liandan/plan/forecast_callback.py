"""The live loss forecast as a training callback, registered as "forecast" (`--forecast.every=N`).

Importing this module registers it; `liandan train` does so in every process that trains.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from liandan.config import Config
from liandan.train.callbacks import Callback

if TYPE_CHECKING:
    from liandan.plan.forecast_worker import ForecastWorker
    from liandan.plan.live_forecast import LiveForecast, LiveForecaster
    from liandan.train.context import TrainContext


class ForecastCallback(Callback):
    """Every `forecast.every` steps, on the main rank, a forecast of the final loss, fitted in a background
    thread (`ForecastWorker`) so that no step waits for it. When it is ready, after a later step, it becomes a
    "forecast" event in events.jsonl, a record of forecast_* metrics at the step it saw, and a console line;
    once, when even the forecast's lower bound is worse than `forecast.reference_loss`, a
    "forecast_worse_than_reference" event and a warning. Training itself is untouched."""

    order = 12  # right after the metrics it reads are logged

    def __init__(self, forecaster: LiveForecaster):
        self.forecaster = forecaster
        self.worker: ForecastWorker | None = None

    def on_train_start(self, ctx: TrainContext) -> None:
        if not ctx.dist.is_main:
            return
        from liandan.plan.forecast_worker import ForecastWorker

        self.worker = ForecastWorker(self.forecaster.compute)
        if ctx.step > 0:  # resumed: the curve so far is in metrics.jsonl
            records = [
                (r["step"], r["loss"])
                for r in ctx.room.read_metrics()
                if r["step"] <= ctx.step and isinstance(r.get("loss"), (int, float))
            ]
            self.forecaster.resume([s for s, _ in records], [x for _, x in records])

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        if self.worker is None:
            return
        for f in self.worker.poll():
            self._publish(ctx, f, step)
        if not isinstance(metrics.get("loss"), (int, float)):
            return
        self.forecaster.observe(step, metrics["loss"])
        if self.forecaster.due():
            self.worker.submit(*self.forecaster.take_due())

    def on_train_end(self, ctx: TrainContext, result) -> None:
        if self.worker is None:
            return
        worker, self.worker = self.worker, None
        for f in worker.close(drain=True):  # the last forecasts of a short run are still worth writing
            self._publish(ctx, f, ctx.step)

    def on_error(self, ctx: TrainContext, err: BaseException) -> None:
        if self.worker is not None:
            self.worker.close(drain=False)  # the loggers may be what failed: write nothing more
            self.worker = None

    def _publish(self, ctx: TrainContext, f: LiveForecast, now: int) -> None:
        f = dataclasses.replace(f, published_step=now)
        ctx.logger.log_event("forecast", **f.to_event())
        # metrics at the step the forecast saw, beside that step's training record: curves of the forecast
        ctx.logger.log_metrics(
            f.step, {"forecast_final_loss": f.final_loss, "forecast_low": f.low, "forecast_high": f.high}
        )
        pct = round(100 * f.confidence)
        ctx.say(
            f"step {f.step}: forecast final loss {f.final_loss:.4f}, {pct}% interval [{f.low:.4f}, {f.high:.4f}]"
            f" at step {f.total_steps} ({f.seconds:.2f}s, ready at step {now})"
            + (f"; {f.distance:.1f} units from the library: the run's own fit" if f.source == "own fit" else "")
        )
        if self.forecaster.newly_flagged(f):
            ref = f.reference_loss
            ctx.logger.log_event(
                "forecast_worse_than_reference",
                step=f.step,
                final_loss=f.final_loss,
                low=f.low,
                high=f.high,
                reference_loss=ref,
                observed_fraction=f.observed_fraction,
            )
            ctx.say(
                f"warning: step {f.step}: forecast final loss {f.final_loss:.4f} is worse than the reference"
                f" {ref:.4f} even at the low end of its {pct}% interval ({f.low:.4f});"
                f" from {100 * f.observed_fraction:.0f}% of the run"
            )


def forecast_callback(cfg: Config) -> ForecastCallback | None:
    if not cfg.forecast.every:
        return None
    from liandan.plan.live_forecast import LiveForecaster  # numpy, scipy: only when asked for

    return ForecastCallback(LiveForecaster.from_config(cfg))
