"""Hyperparameter sweeps: Optuna studies whose trials are real `liandan train` runs (docs/planning.md).

`load_sweep` reads a sweep file (base run config, overrides, [params] to search) and checks it against the
run config before anything runs. `run_sweep` runs trials, each a `liandan train` subprocess whose metrics.jsonl
is followed as it grows, until the study holds `trials` completed or pruned ones: every `report_every` steps
the mean training loss of those steps goes to the pruner, a pruned trial's process is terminated, and a
trial whose loss turns non-finite is pruned at once. The study lives in Optuna storage (a SQLite file in the
study directory, or an RDB URL several machines share), so running a sweep again continues it.
"""

from __future__ import annotations

import difflib
import json
import math
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import (
    BaseDistribution,
    CategoricalDistribution,
    FloatDistribution,
    IntDistribution,
    distribution_to_json,
)
from optuna.trial import FrozenTrial, TrialState
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from liandan.config import Config, ConfigError, describe, load_config
from liandan.plan.forecast import measured_final_loss, schedule_fractions
from liandan.plan.pruner import ForecastPruner, PartialCurve
from liandan.plan.trial_process import last_error, stop_process
from liandan.run import JsonlTail, RunDir

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

POLL_S = 0.2  # how often a running trial's metrics.jsonl is read
HEARTBEAT_S = 20  # trials whose driver has not written a heartbeat for GRACE_S are failed as stale
GRACE_S = 120
MAX_FAILURES_IN_A_ROW = 3  # then the sweep stops: the failure is probably not the sampled values' fault
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


# ---------------------------------------------------------------------------------------------------------
# the sweep file

PRUNERS = ("hyperband", "successive_halving", "median", "forecast", "none")
METRICS = ("val_loss", "loss")
DIRECTIONS = ("minimize", "maximize")
SET_BY_SWEEP = ("run.name", "run.output_dir", "resilience.supervise")  # each trial gets its own
PARAM_KEYS = ("low", "high", "log", "step", "choices")  # of a [params] entry
_STUDY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _is_url(text: str) -> bool:
    try:
        return bool(make_url(text).drivername)
    except ArgumentError:
        return False


def _is(kind: type, test: Callable[[Any], Any] = bool) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, kind) and not isinstance(x, bool) and bool(test(x))


_KEYS: dict[str, tuple[Any, Callable[[Any], bool], str]] = {  # key: (default, test, what a failing value must be)
    "base": (None, _is(str), "must name a run config"),
    "params": (None, _is(dict), "must be a table of run-config keys to search"),
    "overrides": ([], _is(list, lambda x: all(isinstance(o, str) for o in x)), "must be a list of strings"),
    "study": ("", _is(str, _STUDY_NAME.match), "must be letters, digits, '.', '_' or '-'"),
    "storage": ("", _is(str, lambda x: not x or _is_url(x)), "must be empty or a database URL"),
    "output_dir": ("runs/sweeps", _is(str), "must name a directory"),
    "trials": (10, _is(int, lambda x: x >= 1), "must be an integer >= 1"),
    "direction": ("minimize", DIRECTIONS.__contains__, f"must be one of {', '.join(DIRECTIONS)}"),
    "metric": ("val_loss", METRICS.__contains__, f"must be one of {', '.join(METRICS)}"),
    "pruner": ("hyperband", PRUNERS.__contains__, f"must be one of {', '.join(PRUNERS)}"),
    "pruner_options": ({}, _is(dict, lambda x: True), "must be a table"),
    "report_every": (10, _is(int, lambda x: x >= 1), "must be an integer >= 1"),
    "seed": (0, _is(int, lambda x: x >= 0), "must be an integer >= 0"),
    "target_dim": (0, _is(int, lambda x: x >= 0), "must be a width >= 0 (0: no target)"),
}
DEFAULTS = {key: default for key, (default, _, _) in _KEYS.items()}  # base and params are required


@dataclass
class SweepSpec:
    path: Path
    base: Path
    overrides: list[str]
    study: str
    storage: str
    output_dir: Path
    trials: int
    direction: str
    metric: str
    pruner: str
    pruner_options: dict[str, Any]
    report_every: int
    seed: int
    params: dict[str, BaseDistribution]  # run-config key: the values to search
    base_config: Config  # the base with the overrides, as every trial starts
    target_dim: int = 0  # the width to print the best trial's settings for (0: none)
    notes: list[str] = field(default_factory=list)

    @property
    def study_dir(self) -> Path:
        return self.output_dir / self.study

    @property
    def storage_url(self) -> str:
        return self.storage or f"sqlite:///{(self.study_dir / 'study.db').resolve()}"

    @property
    def shown_storage(self) -> str:
        """The storage URL with any password masked, for messages."""
        return make_url(self.storage_url).render_as_string(hide_password=True)

    @property
    def scored_by(self) -> str:
        """val_loss, or loss (the measured final training loss) when the runs do not evaluate."""
        return "val_loss" if self.metric == "val_loss" and self.base_config.train.eval_every else "loss"

    def identity(self) -> dict[str, Any]:
        """What makes two sweep files the same sweep, as stored with the study."""
        params = {key: distribution_to_json(d) for key, d in self.params.items()}
        return {"base": str(self.base), "overrides": self.overrides, "metric": self.metric, "params": params}


def suggest(trial: optuna.Trial, key: str, d: BaseDistribution) -> Any:
    if isinstance(d, CategoricalDistribution):
        return trial.suggest_categorical(key, list(d.choices))
    if isinstance(d, IntDistribution):
        return trial.suggest_int(key, d.low, d.high, step=d.step, log=d.log)
    return trial.suggest_float(key, d.low, d.high, step=d.step, log=d.log)


def override(key: str, value: Any) -> str:
    """`--section.key=value` with the value as a TOML literal."""
    if isinstance(value, bool):
        return f"--{key}={str(value).lower()}"
    return f"--{key}={json.dumps(value) if isinstance(value, str) else repr(value)}"


def load_sweep(path: str | Path, trials: int | None = None, target_dim: int | None = None) -> SweepSpec:
    """Read and check a sweep file; every mistake is a ConfigError of one line naming the file and key.
    `trials` and `target_dim` override the file's. Relative paths in the file are relative to the current
    directory."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"sweep file not found: {path}")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path} is not valid TOML: {err}") from None
    for key in raw:
        if key not in DEFAULTS:
            raise ConfigError(f"{path}: {_unknown(key, list(DEFAULTS), 'key')}")
    for key in ("base", "params"):
        if key not in raw:
            raise ConfigError(f"{path}: '{key}' is missing")
    if trials is not None:
        raw["trials"] = trials
    if target_dim is not None:
        raw["target_dim"] = target_dim
    v = {**DEFAULTS, **raw}
    v["study"] = v["study"] or path.stem  # an empty study name takes the file's
    for key, (_, ok, what) in _KEYS.items():
        if not ok(v[key]):
            raise ConfigError(f"{path}: {key} = {v[key]!r} {what}")
    if v["pruner"] == "forecast" and v["direction"] != "minimize":
        raise ConfigError(f"{path}: pruner = 'forecast' forecasts a loss: it needs direction = 'minimize'")
    overrides = v["overrides"]
    for item in overrides:
        if not (item.startswith("--") and "=" in item and "." in item.split("=", 1)[0]):
            raise ConfigError(f"{path}: override {item!r} must look like --section.key=value")
        if item[2:].split("=", 1)[0] in SET_BY_SWEEP:
            raise ConfigError(f"{path}: override {item!r}: the sweep sets {item[2:].split('=', 1)[0]} for each trial")
    base = Path(v["base"])
    params = {key: _distribution(path, key, value, overrides) for key, value in v["params"].items()}
    # Every trial sets every param: the base is judged with them set (at their first values), so that a param
    # may mend what the base alone gets wrong (a warm-up the base's steps cannot hold, heads of another width).
    first = {key: d.choices[0] if isinstance(d, CategoricalDistribution) else d.low for key, d in params.items()}
    try:
        base_config = load_config(base, overrides)
    except ConfigError as err:
        try:
            base_config = load_config(base, [*overrides, *(override(k, value) for k, value in first.items())])
        except ConfigError:
            raise ConfigError(f"{path}: base {base} with the overrides: {err}") from None
    same = ("study", "storage", "trials", "direction", "metric", "pruner", "pruner_options", "report_every", "seed",
            "target_dim")  # fmt: skip
    spec = SweepSpec(
        path=path,
        base=base,
        overrides=list(overrides),
        output_dir=Path(v["output_dir"]),
        params=params,
        base_config=base_config,
        **{k: v[k] for k in same},
    )
    for key, d in spec.params.items():  # each value, the other params at their first, must be one runs accept
        others = [override(k, value) for k, value in first.items() if k != key]
        for value in d.choices if isinstance(d, CategoricalDistribution) else (d.low, d.high):
            try:
                load_config(base, [*overrides, *others, override(key, value)])
            except ConfigError as err:
                raise ConfigError(f'{path}: params."{key}" value {value!r} is refused: {err}') from None
    make_pruner(spec)  # its options are checked now, not at the first trial
    if spec.metric == "val_loss" and spec.scored_by == "loss":
        spec.notes.append("train.eval_every = 0 in the base config: trials are scored by their final training loss")
    return spec


def _distribution(path: Path, key: Any, raw: Any, overrides: list[str]) -> BaseDistribution:
    where = f'{path}: params."{key}"'
    defaults = {k: default for k, default, _ in describe()}
    for dotted, default in list(defaults.items()):  # a plug-in's key written flat, as run configs may
        section, *rest = dotted.split(".")
        if len(rest) == 2:
            defaults.setdefault(f"{section}.{rest[1]}", default)
    if key not in defaults:
        raise ConfigError(f"{path}: params: {_unknown(key, list(defaults), 'run-config key')}")
    if key in SET_BY_SWEEP:
        raise ConfigError(f"{where}: {key} is set by the sweep for each trial")
    if any(o[2:].split("=", 1)[0] == key for o in overrides):
        raise ConfigError(f"{where}: {key} is also in overrides; keep it in one place")
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{where} must be a table: {{ low = ..., high = ... }} (log, step optional) or {{ choices = [...] }}"
        )
    for name in raw:
        if name not in PARAM_KEYS:
            raise ConfigError(f"{where}: {_unknown(name, list(PARAM_KEYS), 'key')}")
    default = defaults[key]
    if isinstance(default, list):
        raise ConfigError(f"{where}: {key} holds a list and cannot be searched")
    if "choices" in raw:
        choices = raw["choices"]
        if len(raw) > 1:
            raise ConfigError(f"{where}: choices cannot be combined with {', '.join(k for k in raw if k != 'choices')}")
        if not isinstance(choices, list) or not all(isinstance(c, (str, int, float, bool)) for c in choices):
            raise ConfigError(f"{where}: choices = {choices!r} must be a list of numbers, strings or booleans")
        cls: type[BaseDistribution] = CategoricalDistribution
    elif isinstance(default, (bool, str)):
        raise ConfigError(f"{where}: {key} is not a number; give choices = [...]")
    elif "low" not in raw or "high" not in raw:
        raise ConfigError(f"{where} needs low and high, or choices")
    else:
        kind = int if isinstance(default, int) else float
        for name, value in raw.items():
            if name == "log" and not isinstance(value, bool):
                raise ConfigError(f"{where}: log = {value!r} must be true or false")
            if name != "log" and (isinstance(value, bool) or not isinstance(value, (kind, int))):
                what = "an integer" if kind is int else "a number"
                raise ConfigError(f"{where}: {name} = {value!r} must be {what} ({key} is {kind.__name__})")
        cls = IntDistribution if kind is int else FloatDistribution
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # e.g. a range that is not a multiple of the step
            return cls(**raw)
    except (ValueError, UserWarning) as err:
        raise ConfigError(f"{where}: {err}") from None


def _unknown(name: Any, allowed: list[str], what: str) -> str:
    close = difflib.get_close_matches(str(name), allowed, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    shown = allowed if len(allowed) <= 20 else [*allowed[:20], "..."]
    return f"unknown {what} '{name}'{hint}; allowed: {', '.join(shown)}"


def make_pruner(
    spec: SweepSpec, curve: Callable[[FrozenTrial], PartialCurve | None] | None = None
) -> optuna.pruners.BasePruner:
    """The pruner the sweep names, with its `pruner_options`; resources are training steps."""
    options = dict(spec.pruner_options)
    steps = spec.base_config.train.steps
    try:
        if spec.pruner == "hyperband":
            swept = "train.steps" in spec.params
            options = {"min_resource": spec.report_every, "max_resource": "auto" if swept else steps, **options}
            return optuna.pruners.HyperbandPruner(**options)
        if spec.pruner == "successive_halving":
            return optuna.pruners.SuccessiveHalvingPruner(**{"min_resource": spec.report_every, **options})
        if spec.pruner == "median":
            return optuna.pruners.MedianPruner(**options)
        if spec.pruner == "forecast":
            lr = schedule_fractions(spec.base_config.schedule, steps)
            return ForecastPruner(lr, curve=curve, **{"seed": spec.seed, **options})
        return optuna.pruners.NopPruner()
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"{spec.path}: pruner {spec.pruner!r} with pruner_options {spec.pruner_options}: {err}"
        ) from None


# ---------------------------------------------------------------------------------------------------------
# running trials


class TrialFailed(Exception):
    """A trial that could not run or crashed; the study records it as failed and the sweep goes on."""


class Reporter:
    """What a sweep tells its user; the command line shows a progress bar, Python callers may ignore it."""

    def trial_started(self, number: int, params: dict[str, Any]) -> None: ...

    def trial_step(self, number: int, step: int, total: int, loss: float) -> None: ...

    def trial_finished(self, trial: FrozenTrial, finished: int) -> None: ...


class _MetricsTail:
    """The (step, loss) records appended to a metrics.jsonl since the last read; a half-written last line
    waits for the next read."""

    def __init__(self, path: Path):
        self.tail = JsonlTail(path)

    def read(self) -> list[tuple[int, float]]:
        out = []
        for record in self.tail.read():
            try:
                loss = record["loss"]  # a non-finite loss is logged as null (as "nan" by older versions)
                out.append((int(record["step"]), math.nan if loss is None else float(loss)))
            except (ValueError, KeyError, TypeError):
                continue
        return out


@dataclass
class _Sweep:
    spec: SweepSpec
    reporter: Reporter
    curves: dict[int, PartialCurve] = field(default_factory=dict)
    pruner: optuna.pruners.BasePruner | None = None
    failures_in_a_row: int = 0
    gave_up: str = ""

    def objective(self, trial: optuna.Trial) -> float:
        spec = self.spec
        params = {key: suggest(trial, key, d) for key, d in spec.params.items()}
        name = f"{spec.study}-trial-{trial.number}"
        run_dir = spec.study_dir / name
        trial.set_user_attr("run_dir", str(run_dir))
        self.reporter.trial_started(trial.number, params)
        overrides = [*spec.overrides, *(override(k, v) for k, v in params.items())]
        try:
            cfg = load_config(spec.base, overrides)
        except ConfigError as err:  # a combination of values the config refuses
            raise self._failed(trial, f"config refused: {err}") from None
        room = RunDir(run_dir)
        if room.metrics.exists():
            raise self._failed(trial, f"{run_dir} already holds a run (of an earlier study of this name?)")
        run_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "liandan.cli", "train", str(spec.base), *overrides, f"--run.name={name}"]
        command += [f"--run.output_dir={spec.study_dir}", "--resilience.supervise=false"]
        curve = PartialCurve([], [], schedule_fractions(cfg.schedule, cfg.train.steps))
        self.curves[trial.number] = curve
        started = time.perf_counter()
        with room.trial_log.open("w") as log:
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
            try:
                verdict = self._follow(trial, process, _MetricsTail(room.metrics), curve, cfg.train.steps)
            except KeyboardInterrupt:
                trial.set_user_attr("note", "interrupted")
                raise
            finally:
                stop_process(process)
                trial.set_user_attr("steps", curve.steps[-1] if curve.steps else 0)
                trial.set_user_attr("seconds", round(time.perf_counter() - started, 2))
        if verdict is not None:
            trial.set_user_attr("note", verdict)
            raise optuna.TrialPruned(verdict)
        if process.returncode != 0:
            error = last_error(room.trial_log)
            if "the loss-spike guard stopped the run" in error:  # it diverged: a verdict on the trial, not a failure
                note = f"stopped by the loss-spike guard at step {curve.steps[-1] if curve.steps else 0}"
                trial.set_user_attr("note", note)
                raise optuna.TrialPruned(note)
            raise self._failed(trial, f"exit code {process.returncode}: {error}")
        summary_path = room.summary
        if not summary_path.is_file() or not curve.steps:
            raise self._failed(trial, f"no summary.json or no loss records in {run_dir}")
        try:
            summary = room.load_summary()
        except (OSError, ValueError) as err:
            raise self._failed(trial, f"unreadable {summary_path}: {err}") from None
        final_train = measured_final_loss(curve.steps, curve.losses)
        trial.set_user_attr("final_train_loss", final_train)
        value = summary.get("val_loss") if spec.scored_by == "val_loss" else final_train
        if value is None or not math.isfinite(value):
            raise self._failed(trial, f"no finite {spec.scored_by} in {summary_path}")
        return float(value)

    def _follow(self, trial, process, tail: _MetricsTail, curve: PartialCurve, total: int) -> str | None:
        """Read the trial's records until it exits; report every `report_every` steps. Returns why the trial
        was pruned, or None when it ran to its end."""
        every = self.spec.report_every
        next_report, window = every, []
        while True:
            exited = process.poll() is not None  # before reading: records written before the exit get read
            for step, loss in tail.read():
                curve.steps.append(step)
                curve.losses.append(loss)
                window.append(loss)
                if not math.isfinite(loss):
                    trial.report(math.nan, step)
                    return f"diverged: loss {loss} at step {step}"
                if step >= next_report:
                    trial.report(sum(window) / len(window), step)
                    next_report, window = (step // every + 1) * every, []
                    if trial.should_prune():
                        return f"pruned at step {step}" + self._forecast_note(trial.number)
                self.reporter.trial_step(trial.number, step, total, loss)
            if exited:
                return None
            time.sleep(POLL_S)

    def _forecast_note(self, number: int) -> str:
        last = self.pruner.last.get(number) if isinstance(self.pruner, ForecastPruner) else None
        if not last:
            return ""
        final, low, high, reference = last
        return f": forecast {final:.4f} [{low:.4f}, {high:.4f}] above the best trial's {reference:.4f}"

    def _failed(self, trial: optuna.Trial, note: str) -> TrialFailed:
        trial.set_user_attr("note", note)
        return TrialFailed(note)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        finished = len(study.get_trials(deepcopy=False, states=FINISHED))
        self.reporter.trial_finished(trial, finished)
        self.curves.pop(trial.number, None)
        if trial.state == TrialState.FAIL and trial.user_attrs.get("note") != "interrupted":
            self.failures_in_a_row += 1
            if self.failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
                self.gave_up = (
                    f"{self.failures_in_a_row} trials in a row failed; the last: {trial.user_attrs.get('note')}"
                )
                study.stop()
        else:
            self.failures_in_a_row = 0
        if finished >= self.spec.trials:
            study.stop()


# ---------------------------------------------------------------------------------------------------------
# the study


@dataclass
class SweepResult:
    study: optuna.Study
    ran: int  # trials started by this call
    notes: list[str]  # about the study, beside the sweep file's own `spec.notes`
    gave_up: str  # why the sweep stopped early, or ""


def open_study(spec: SweepSpec, pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
    """The sweep's study, created or loaded from its storage."""
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # the sweep reports trials itself
    spec.study_dir.mkdir(parents=True, exist_ok=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            storage = optuna.storages.RDBStorage(spec.storage_url, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
        study = optuna.create_study(
            storage=storage, study_name=spec.study, direction=spec.direction, pruner=pruner, load_if_exists=True
        )
    except (SQLAlchemyError, ImportError, ValueError) as err:  # a bad URL, a missing driver, no database there
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"storage {spec.shown_storage}: {first}") from None
    if study.direction.name.lower() != spec.direction:
        raise ConfigError(
            f"study {spec.study!r} in {spec.shown_storage} was created to {study.direction.name.lower()}, the sweep says"
            f" direction = {spec.direction!r}; use another study name"
        )
    return study


def run_sweep(spec: SweepSpec, reporter: Reporter | None = None) -> SweepResult:
    """Run trials until the study holds `spec.trials` completed or pruned ones."""
    sweep = _Sweep(spec, reporter or Reporter())
    sweep.pruner = make_pruner(spec, curve=lambda trial: sweep.curves.get(trial.number))
    study = open_study(spec, sweep.pruner)
    notes = []
    identity = spec.identity()
    if not study.user_attrs.get("sweep"):
        study.set_user_attr("sweep", identity)
    elif study.user_attrs["sweep"] != identity:
        notes.append(f"the sweep file changed since study {spec.study!r} began; its trials are continued all the same")
    # The seed moves on with the study, so that a continued sweep does not draw its first trials again.
    study.sampler = optuna.samplers.TPESampler(seed=spec.seed + len(study.trials))
    before = len(study.trials)
    finished = len(study.get_trials(deepcopy=False, states=FINISHED))
    if finished < spec.trials:
        study.optimize(sweep.objective, catch=(TrialFailed,), callbacks=[sweep.after_trial])
    return SweepResult(study, len(study.trials) - before, notes, sweep.gave_up)
