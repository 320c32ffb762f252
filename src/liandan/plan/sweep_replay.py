"""Pruners measured on the same study: finished trials' loss curves replayed through an Optuna study, trial by
trial in a given order, reported exactly as `liandan sweep` reports a running trial (the mean training loss of
every `report_every` steps), so that each pruner decides from the same numbers. Nothing trains: a replay is
cheap and deterministic, and every pruner meets the same trials in the same order.

What a replay measures: whether the pruner stopped the trial that would have won (the lowest measured final
training loss of all the trials), the regret (the best final loss among the trials it let finish, minus the
winner's), and the compute saved (the share of all the trials' steps it did not run). Needs the [sweep]
extra (Optuna).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from liandan.config import ConfigError, ScheduleSection, load_config
from liandan.plan.forecast import Forecast, forecast_final_loss, measured_final_loss, schedule_fractions
from liandan.plan.pruner import ForecastPruner, PartialCurve
from liandan.run import RunDir

PRUNER_NAMES = ("forecast", "hyperband", "median", "none")


@dataclass
class RecordedTrial:
    """A finished trial: its logged training losses (1-based steps) and its schedule."""

    name: str
    steps: list[int]
    losses: list[float]
    total_steps: int
    schedule: dict  # the [schedule] section: kind, warmup_steps, min_lr_ratio, decay_fraction

    @property
    def final(self) -> float:
        return measured_final_loss(self.steps, self.losses)

    @property
    def lr_fractions(self) -> np.ndarray:
        return schedule_fractions(ScheduleSection(**self.schedule), self.total_steps)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "total_steps": self.total_steps,
            "schedule": self.schedule,
            "steps": self.steps,
            "losses": [round(x, 5) for x in self.losses],
        }


def read_trials(study_dir: Path) -> list[RecordedTrial]:
    """Every finished run directory under a sweep's study directory, in name order."""
    trials = []
    for run in sorted(p for p in Path(study_dir).iterdir() if RunDir(p).summary.is_file()):
        room = RunDir(run)
        cfg = load_config(room.config, [])
        records = [r for r in room.read_metrics() if isinstance(r.get("loss"), (int, float))]
        if not records or records[-1]["step"] < cfg.train.steps:
            continue
        s = cfg.schedule
        schedule = {
            "kind": s.kind,
            "warmup_steps": s.warmup_steps,
            "min_lr_ratio": s.min_lr_ratio,
            "decay_fraction": s.decay_fraction,
        }
        trials.append(
            RecordedTrial(
                run.name, [r["step"] for r in records], [r["loss"] for r in records], cfg.train.steps, schedule
            )
        )
    if not trials:
        raise ConfigError(f"{study_dir}: no finished trials under it")
    return trials


def save_trials(trials: Sequence[RecordedTrial], path: Path) -> None:
    Path(path).write_text(json.dumps([t.to_dict() for t in trials], separators=(",", ":")) + "\n")


def load_trials(path: Path) -> list[RecordedTrial]:
    return [RecordedTrial(**t) for t in json.loads(Path(path).read_text())]


class MemoForecast:
    """forecast_final_loss remembered per partial curve: a trial's curve up to a step is the same in every
    replay order, and so is its forecast (seeded), so each is fitted once however many orders are replayed."""

    def __init__(self) -> None:
        self.memo: dict[tuple, Forecast] = {}

    def __call__(self, steps, losses, lr_fractions, **kwargs) -> Forecast:
        key = (len(steps), steps[-1], losses[0], losses[-1], len(lr_fractions), tuple(sorted(kwargs.items())))
        if key not in self.memo:
            self.memo[key] = forecast_final_loss(steps, losses, lr_fractions, **kwargs)
        return self.memo[key]


FORECASTS = MemoForecast()


def make_replay_pruner(
    name: str, trials: Sequence[RecordedTrial], report_every: int, curve
) -> optuna.pruners.BasePruner:
    """The pruner `liandan sweep` builds for `name`, with its defaults (plan.sweep.make_pruner)."""
    steps = max(t.total_steps for t in trials)
    if name == "forecast":
        return ForecastPruner(curve=curve, fit=FORECASTS)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(min_resource=report_every, max_resource=steps)
    if name == "median":
        return optuna.pruners.MedianPruner()
    if name == "none":
        return optuna.pruners.NopPruner()
    raise ConfigError(f"pruner {name!r}; allowed: {', '.join(PRUNER_NAMES)}")


@dataclass(frozen=True)
class ReplayResult:
    pruner: str
    order: tuple[int, ...]
    winner: int  # index of the trial with the lowest final loss
    winner_pruned: bool
    best_found: float  # lowest final loss among the trials let finish
    regret: float  # best_found minus the winner's final loss
    steps_run: int
    steps_total: int
    pruned: int

    @property
    def saved(self) -> float:
        return 1.0 - self.steps_run / self.steps_total


def replay(
    trials: Sequence[RecordedTrial],
    pruner_name: str,
    order: Sequence[int],
    report_every: int,
    pruner_factory: Callable[..., optuna.pruners.BasePruner] = make_replay_pruner,
) -> ReplayResult:
    """Run the trials in `order` through a fresh in-memory study with the named pruner, as `liandan sweep`
    would have run them."""
    if report_every < 1:
        raise ConfigError(f"report_every = {report_every} must be at least 1")
    seen: dict[int, tuple[RecordedTrial, int]] = {}  # study trial number -> (recorded trial, steps so far)

    def curve(frozen: FrozenTrial) -> PartialCurve | None:
        if frozen.number not in seen:
            return None
        t, upto = seen[frozen.number]
        return PartialCurve(t.steps[:upto], t.losses[:upto], t.lr_fractions)

    pruner = pruner_factory(pruner_name, trials, report_every, curve)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="replay", direction="minimize", pruner=pruner)
    finals = [t.final for t in trials]
    steps_run = pruned = 0
    best_found = math.inf
    winner = int(np.argmin(finals))
    winner_pruned = False
    for index in order:
        t = trials[index]
        trial = study.ask()
        stopped_at = None
        next_report, window = report_every, []
        for i, (step, loss) in enumerate(zip(t.steps, t.losses)):
            window.append(loss)
            if step >= next_report:
                seen[trial.number] = (t, i + 1)
                trial.report(sum(window) / len(window), step)
                next_report, window = (step // report_every + 1) * report_every, []
                if trial.should_prune():
                    stopped_at = step
                    break
        if stopped_at is not None:
            study.tell(trial, state=TrialState.PRUNED)
            steps_run += stopped_at
            pruned += 1
            winner_pruned = winner_pruned or index == winner
        else:
            trial.set_user_attr("final_train_loss", finals[index])
            study.tell(trial, finals[index])
            steps_run += t.total_steps
            best_found = min(best_found, finals[index])
    return ReplayResult(
        pruner=pruner_name,
        order=tuple(order),
        winner=winner,
        winner_pruned=winner_pruned,
        best_found=best_found,
        regret=best_found - finals[winner],
        steps_run=steps_run,
        steps_total=sum(trials[i].total_steps for i in order),
        pruned=pruned,
    )


def orders(n: int, count: int, seed: int = 0) -> list[list[int]]:
    """`count` seeded orders of n trials (the first the recorded order), for replays to share."""
    rng = np.random.default_rng(seed)
    return [list(range(n))] + [rng.permutation(n).tolist() for _ in range(count - 1)]
