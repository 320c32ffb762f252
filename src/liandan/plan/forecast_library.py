"""Finished runs that teach the forecast: the shipped library of real tiny runs and a project's own runs.

Each finished run is fitted whole (`Curve.fit(free=True)`); across the runs, the fits give the priors of a
forecast (`LawPriors`: alpha, the annealing gain D relative to the loss at the end of the warmup, the
response time tau / steps), and leave-one-run-out forecasts of each run from the start of its curve give the
conformal calibration of the interval (`Calibration`): the 80% interval's half-width at a share of the steps
is the conformal 80% quantile of |log(forecast / actual)| of the other runs forecast from that share.

The library (src/liandan/plan/library/*.json.gz, made by benchmarks/forecast_library.py) holds a library
set, the default prior, and a held-out set, never used as a prior, for backtests. Its whole-run fits and
calibration scores are kept beside it in fits.json (remade by `benchmarks/forecast_library.py --fit`).
"""

from __future__ import annotations

import gzip
import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from liandan.config import ConfigError, ScheduleSection, load_config
from liandan.plan.forecast_features import (
    LIBRARY_WARMUP,
    Reach,
    RunFeatures,
    data_key,
    features_of,
    fixture_data_key,
    reach,
)
from liandan.plan.forecast_law import MIN_PAST_WARMUP, Curve, LawPriors, fit_power
from liandan.run import RunDir

LIBRARY = Path(__file__).with_name("library")
FITS = LIBRARY / "fits.json"
CALIBRATION_FRACTIONS = (0.1, 0.15, 0.2, 0.3, 0.5, 0.7, 0.9)
FLOOR_WEIGHT = 0.02  # every run teaches at least this much, so that unlike runs still give a prior
PROJECT_WEIGHT = 3.0  # a project's own runs count this many times a library run in its priors
PROJECT_MAX = 16  # the most recently finished runs of a project directory that teach (about 1 s each)
MIN_WIDTH = {"alpha": 0.1, "gain": 0.2, "tau": 0.3}  # floors on the priors' widths, in e-folds
DEFAULT_OPTIMIZER = "adamw"  # a run whose optimizer is not known is taken for one of the default's
MIN_TEACHERS = 2  # an optimizer's runs teach its runs alone once there are this many (`weighed`)
MIN_CALIBRATION_RUNS = 5  # an optimizer's runs calibrate its forecasts alone once there are this many
EVIDENCE = 64.0  # the records' weight cap of a forecast without a library (the library's runs choose theirs)


@dataclass(frozen=True)
class RunCurve:
    run_dir: Path | str  # a run directory, or the name of a library run
    steps: np.ndarray
    losses: np.ndarray
    lr_fractions: np.ndarray
    total_steps: int
    schedule: str
    diverged_at: int | None = None
    """The first logged step whose loss was not finite (NaN, inf, or null as the run writes it), if any."""
    heldout: bool = False  # a library run kept out of the priors, for backtests
    features: RunFeatures | None = None

    @property
    def finished(self) -> bool:
        return len(self.steps) > 0 and int(self.steps[-1]) >= self.total_steps

    @property
    def name(self) -> str:
        return Path(self.run_dir).name


def read_run(run_dir: str | Path) -> RunCurve:
    """A run directory's logged training losses and its whole schedule (from its resolved config.toml)."""
    from liandan.plan.forecast_law import schedule_fractions

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir} is not a run directory (no such directory)")
    room = RunDir(run_dir)
    config, metrics = room.config, room.metrics
    if not config.is_file() or not metrics.is_file():
        missing = config.name if not config.is_file() else metrics.name
        raise ConfigError(f"{run_dir} is not a run directory ({missing} missing)")
    cfg = load_config(config)
    steps, losses, diverged_at = [], [], None
    for record in room.read_metrics():  # a run in progress may have a half-written last line: skipped
        try:
            step, loss = int(record["step"]), record.get("loss")
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(loss, (int, float)) and math.isfinite(loss):
            steps.append(step)
            losses.append(float(loss))
        elif "loss" in record and diverged_at is None:
            diverged_at = step
    total = cfg.train.steps
    features = features_of(cfg)
    return RunCurve(
        run_dir,
        np.array(steps, dtype=np.int64),
        np.array(losses, dtype=np.float64),
        schedule_fractions(cfg.schedule, total),
        total,
        cfg.schedule.kind,
        diverged_at,
        features=features,
    )


def measured_final_loss(steps: Sequence[int], losses: Sequence[float], share: float = 0.1) -> float:
    """The loss at the last record with the batch noise averaged out: a straight line fitted to the last
    `share` of the records (at least 8), evaluated at the last step. A step logged twice keeps its last
    record, as in a forecast."""
    from liandan.plan.forecast_law import clean_records

    s, y = clean_records(steps, losses)
    if not len(y):
        raise ConfigError("no finite loss records")
    k = min(len(y), max(8, round(share * len(y))))
    s, y = s[-k:].astype(np.float64), y[-k:]
    if k < 3 or np.ptp(s) == 0:
        return float(np.mean(y))
    slope, intercept = np.polyfit(s, y, 1)
    return float(slope * s[-1] + intercept)


# ---------------------------------------------------------------------------------------------------------
# the shipped library and a project's runs


def library_runs(which: str = "library") -> list[RunCurve]:
    """The shipped runs of one set: "library" (the default prior), "heldout" or "all"."""
    return [run for run in _shipped() if which == "all" or (run.heldout == (which == "heldout"))]


@lru_cache(maxsize=1)
def _shipped() -> tuple[RunCurve, ...]:
    return tuple(load_fixture(path) for path in sorted(LIBRARY.glob("*.json.gz")))


def load_fixture(path: str | Path) -> RunCurve:
    """One library fixture: its records and its schedule, from the fixture's own config."""
    from liandan.plan.forecast_law import schedule_fractions

    with gzip.open(path, "rt") as handle:
        data = json.load(handle)
    total = int(data["train"]["steps"])
    schedule = ScheduleSection(**data["schedule"])
    records = data["records"]
    losses = np.array([np.nan if v is None else v for v in records["loss"]], dtype=np.float64)
    model, train = data["model"], data["train"]
    corpus = (
        data_key(data["tokenizer"], data["files"]) if "files" in data else fixture_data_key(f"byte:{data['corpus']}")
    )
    features = RunFeatures(
        12.0 * model["n_layers"] * model["dim"] ** 2,
        train["global_batch"] * train["seq_len"],
        data["optim"]["lr"],
        corpus,
        data["optim"].get("name", "adamw"),
    )
    return RunCurve(
        data["name"],
        np.array(records["step"], dtype=np.int64),
        losses,
        schedule_fractions(schedule, total),
        total,
        schedule.kind,
        heldout=data["set"] != "library",
        features=features,
    )


def project_runs(directory: str | Path, exclude: Iterable[str | Path] = ()) -> list[RunCurve]:
    """The finished runs directly under `directory` (each with config.toml and metrics.jsonl), whose loss
    stayed finite, the PROJECT_MAX most recent; `exclude` leaves out run directories (the run being
    forecast)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"--library {directory}: no such directory")
    skip = {Path(p).resolve() for p in exclude}
    out = []
    for child in sorted(directory.iterdir()):
        if child.resolve() in skip or not (child / "config.toml").is_file() or not (child / "metrics.jsonl").is_file():
            continue
        try:
            run = read_run(child)
        except ConfigError:
            continue
        if run.finished and run.diverged_at is None and len(run.steps) >= 4 * 8:
            out.append(run)
    # each run is fitted and replayed on every forecast: the newest teach, a bounded number of them
    out.sort(key=lambda run: RunDir(run.run_dir).metrics.stat().st_mtime, reverse=True)
    return out[:PROJECT_MAX]


# ---------------------------------------------------------------------------------------------------------
# what the runs teach


@dataclass(frozen=True)
class Taught:
    """One finished run's whole-curve fit, in the quantities that carry over to other runs."""

    name: str
    log_alpha: float
    log_gain: float | None  # log(D / loss at the end of the warmup); None without annealing
    log_tau: float | None  # log(tau / steps)
    weight: float = 1.0
    features: RunFeatures | None = None
    L0: float = 0.0  # the rest of the law, for its shape (`shapes_forecast`)
    A: float = 0.0


def teach(run: RunCurve, weight: float = 1.0) -> Taught:
    curve = Curve(run.steps, run.losses, run.lr_fractions, run.total_steps)
    data = curve.window()
    fit, _ = curve.fit(data, LawPriors(), free=True)
    annealing = curve.has_annealing
    return Taught(
        run.name,
        math.log(fit.alpha),
        math.log(max(fit.D, 1e-12) / curve.reference_loss()) if annealing else None,
        math.log((1.0 / (1.0 - fit.decay)) / run.total_steps) if annealing else None,
        weight,
        run.features,
        fit.L0,
        fit.A,
    )


def weighed(taught: Sequence[Taught], features: RunFeatures | None, likeness: float = 1.0) -> list[Taught]:
    """The runs' weights scaled by their likeness to a run with `features` (unscaled without features):
    exp(-likeness * distance / 2), plus FLOOR_WEIGHT. Only the runs trained with the run's optimizer teach
    when there are MIN_TEACHERS of them: the optimizer shapes the curve (Muon's falls faster early)."""
    if features is None:
        return of_optimizer(taught, None)
    out = []
    for t in of_optimizer(taught, features.optimizer):
        like = math.exp(-0.5 * likeness * features.distance(t.features)) if t.features is not None else 0.0
        out.append(replace(t, weight=t.weight * (FLOOR_WEIGHT + like)))
    return out


def of_optimizer(taught: Sequence[Taught], optimizer: str | None) -> list[Taught]:
    """The runs trained with `optimizer` (None: DEFAULT_OPTIMIZER) when there are MIN_TEACHERS of them, else
    all the runs."""
    optimizer = optimizer or DEFAULT_OPTIMIZER
    same = [t for t in taught if t.features is not None and t.features.optimizer == optimizer]
    return same if len(same) >= MIN_TEACHERS else list(taught)


def priors_from(taught: Sequence[Taught], evidence: float = EVIDENCE) -> LawPriors:
    """Weighted mean and spread of what the runs teach (defaults for a quantity no run teaches)."""
    base = LawPriors(evidence=evidence)

    def centre_width(values, default_c, default_w, floor):
        pairs = [(v, t.weight) for v, t in values if v is not None]
        if len(pairs) < 2:
            return default_c, default_w
        v = np.array([p[0] for p in pairs])
        w = np.array([p[1] for p in pairs])
        mean = float(np.average(v, weights=w))
        sd = float(np.sqrt(np.average((v - mean) ** 2, weights=w)))
        return mean, max(sd, floor)

    a = centre_width([(t.log_alpha, t) for t in taught], base.log_alpha, base.alpha_width, MIN_WIDTH["alpha"])
    g = centre_width([(t.log_gain, t) for t in taught], base.log_gain, base.gain_width, MIN_WIDTH["gain"])
    u = centre_width([(t.log_tau, t) for t in taught], base.log_tau, base.tau_width, MIN_WIDTH["tau"])
    return replace(
        base,
        log_alpha=a[0],
        alpha_width=a[1],
        log_gain=g[0],
        gain_width=g[1],
        log_tau=u[0],
        tau_width=u[1],
        runs=len(taught),
    )


# ---------------------------------------------------------------------------------------------------------
# calibration


@dataclass(frozen=True)
class Score:
    """One leave-one-run-out forecast: log(forecast / actual) from a share of a run's steps."""

    name: str
    fraction: float
    law: float
    power: float
    optimizer: str = "adamw"  # the run's


@dataclass(frozen=True)
class Calibration:
    scores: tuple[Score, ...]

    def of(self, optimizer: str | None) -> Calibration:
        """The scores of the runs trained with `optimizer` (None: DEFAULT_OPTIMIZER) when there are MIN_CALIBRATION_RUNS of them (how
        far a forecast errs depends on the curve's shape, and the optimizer shapes it), else all of them."""
        mine = tuple(s for s in self.scores if s.optimizer == (optimizer or DEFAULT_OPTIMIZER))
        return Calibration(mine) if len({s.name for s in mine}) >= MIN_CALIBRATION_RUNS else self

    def _by_fraction(self, which: str) -> list[tuple[float, np.ndarray]]:
        out = []
        for f in CALIBRATION_FRACTIONS:
            values = np.array([getattr(s, which) for s in self.scores if s.fraction == f])
            if len(values):
                out.append((f, values))
        return out

    def bias(self, fraction: float, which: str = "law") -> float:
        """The median log(forecast / actual) of the runs forecast from about `fraction` of their steps: what
        a forecast from there is corrected by."""
        qs = self._by_fraction(which)
        if len(qs) < 2 or min(len(v) for _, v in qs) < 5:
            return 0.0
        fs = np.log([f for f, _ in qs])
        return float(np.interp(math.log(fraction), fs, [float(np.median(v)) for _, v in qs]))

    def half_width(self, fraction: float, confidence: float, which: str = "law") -> float:
        """Half-width in e-folds of the interval at `confidence` around a corrected forecast from `fraction`
        of the steps: the conformal quantile of the runs' |score - bias| there, interpolated between the
        calibration fractions and never narrower for less seen. The power law, the plain baseline, is not
        corrected: its |score| alone."""
        qs = []
        for f, values in self._by_fraction(which):
            centre = float(np.median(values)) if len(values) >= 5 and which == "law" else 0.0
            spread = np.sort(np.abs(values - centre))
            k = math.ceil((len(spread) + 1) * confidence)  # split conformal: the k-th smallest of n
            qs.append((f, float(spread[min(k, len(spread)) - 1])))
        if not qs:
            return 0.05 * math.log(1.0 / max(fraction, 1e-3)) + 0.01  # no calibration: a rough guess
        fs = np.array([f for f, _ in qs])
        vs = np.maximum.accumulate(np.array([v for _, v in qs])[::-1])[::-1]
        if fraction < fs[0]:  # less seen than any calibrated share: wider as 1 / sqrt(the curve past the warmup)
            past = max(fraction - LIBRARY_WARMUP, MIN_PAST_WARMUP)
            return float(vs[0] * math.sqrt(max(fs[0] - LIBRARY_WARMUP, past) / past))
        return float(np.interp(math.log(fraction), np.log(fs), vs))


def shapes_forecast(curve: Curve, data, taught: Sequence[Taught], priors: LawPriors) -> float | None:
    """The final loss from the shapes of other runs: each run's whole-curve law, put on this run's schedule
    and length (its annealing gain scaled by this run's loss after the warmup), its level scaled to fit the
    records in `data`; the forecasts weighed by how well each fits them (likelihood, the records' weight
    capped at `priors.evidence`) and by the runs' own weights (their likeness to this run), then averaged
    in log. None without usable runs."""
    ref = curve.reference_loss()
    s1 = curve.s1
    logs, logw = [], []
    total = float(data.count.sum())
    for t in taught:
        if t.A <= 0 or t.weight <= 0:
            continue
        alpha = math.exp(t.log_alpha)
        base = data.bin_mean(t.L0 + t.A * np.maximum(s1[data.updates], 1e-12) ** -alpha)
        gain, tau = 0.0, None
        if curve.has_annealing:  # runs at a constant rate teach no annealing: the priors' gain stands in
            gain = math.exp(t.log_gain if t.log_gain is not None else priors.log_gain) * ref
            tau = math.exp(t.log_tau if t.log_tau is not None else priors.log_tau) * curve.total_steps
        r = curve.response(tau) if tau is not None else np.zeros(len(s1))
        lifted = data.y + gain * data.bin_mean(r[data.updates])
        scale = float(np.sum(data.count * lifted * base) / np.sum(data.count * base * base))
        chi2 = float(np.sum(data.count * ((lifted - scale * base) / data.noise) ** 2))
        end = scale * (t.L0 + t.A * float(s1[curve.end]) ** -alpha) - gain * float(r[curve.end])
        if not (end > 0 and math.isfinite(end)):
            continue
        logs.append(math.log(end))
        logw.append(-0.5 * chi2 * min(1.0, priors.evidence / total) + math.log(t.weight))
    if not logs:
        return None
    w = np.exp(np.array(logw) - max(logw))
    return float(math.exp(np.sum(w * np.array(logs)) / np.sum(w)))


OWN_EVIDENCE = 256.0  # the records' weight cap of the run's own fit, which late in a run should follow them


def combined_forecast(curve: Curve, data, alike: Sequence[Taught], priors: LawPriors, own_only: bool = False):
    """(final loss, the run's own fit): the other runs' shapes (`shapes_forecast`) and the run's own law
    (MAP under `priors`) averaged in log, the own law weighing (share of the run seen)^2: little early,
    when a prefix cannot tell its own future, all at the end, where the curve is its own best witness.
    `own_only`: the run's own law alone (no run is like this one: their shapes may mislead)."""
    fit, _ = curve.fit(data, replace(priors, evidence=OWN_EVIDENCE))
    own = float(fit.at(curve.end))
    shapes = None if own_only else shapes_forecast(curve, data, alike, priors)
    if shapes is None or own <= 0:
        return (own if shapes is None else shapes), fit
    w = min(1.0, curve.observed / curve.total_steps) ** 2
    return math.exp((1.0 - w) * math.log(shapes) + w * math.log(own)), fit


def forecast_scores(
    run: RunCurve, others: Sequence[Taught], settings: dict, fractions=CALIBRATION_FRACTIONS
) -> list[Score]:
    """log(forecast / actual) of the forecast (with `settings`, learned from `others`) and of the power law,
    forecasting `run` from `fractions` of its steps."""
    actual = measured_final_loss(run.steps, run.losses)
    alike = weighed(others, run.features, settings.get("likeness", 1.0))
    priors = replace(priors_from(alike), **{k: v for k, v in settings.items() if k != "likeness"})
    out = []
    for fraction in fractions:
        seen = run.steps <= max(1, round(fraction * run.total_steps))  # the prefix alone, as in a live forecast
        curve = Curve(run.steps[seen], run.losses[seen], run.lr_fractions, run.total_steps)
        try:
            data = curve.window(None, priors.skip)
        except ConfigError:
            continue
        law_point = combined_forecast(curve, data, alike, priors)[0]
        power_point = float(fit_power(data).at(curve.end))
        if law_point > 0 and power_point > 0:
            optimizer = run.features.optimizer if run.features is not None else "adamw"
            law, power = math.log(law_point / actual), math.log(power_point / actual)
            out.append(Score(run.name, fraction, law, power, optimizer))
    return out


@dataclass(frozen=True)
class Library:
    """The priors and the calibration a forecast uses, and the runs they came from."""

    priors: LawPriors  # from all the runs alike
    calibration: Calibration
    runs: tuple[str, ...] = ()
    taught: tuple[Taught, ...] = ()
    settings: dict = field(default_factory=dict)

    def priors_for(self, features: RunFeatures | None) -> LawPriors:
        """The priors for a run with `features`: the runs most like it teach most."""
        if features is None or not self.taught:
            return self.priors
        return replace(priors_from(self.alike(features)), **self.law_settings)

    def reach(self, features: RunFeatures | None) -> Reach:
        """How far a run with `features` lies from the nearest of the runs that teach it (`of_optimizer`)."""
        pool = of_optimizer(self.taught, None if features is None else features.optimizer)
        return reach(features, [(t.name, t.features) for t in pool])

    def alike(self, features: RunFeatures | None) -> list[Taught]:
        return weighed(self.taught, features, self.settings.get("likeness", 1.0))

    @property
    def law_settings(self) -> dict:
        return {k: v for k, v in self.settings.items() if k != "likeness"}


CHOICES = {  # the forecast's settings that the library's own leave-one-run-out forecasts choose among
    "evidence": (4.0, 16.0, 64.0),
    "skip": (0.0, 0.3),
    "likeness": (0.5, 1.0, 2.0),  # how much more the runs alike teach (`weighed`)
}
CHOICE_FRACTIONS = (0.1, 0.2, 0.5)


def build(
    runs: Sequence[RunCurve],
    weights: Sequence[float] | None = None,
    taught: Sequence[Taught] | None = None,
    settings: dict | None = None,
) -> tuple[Library, list[Taught], dict]:
    """Teach and calibrate from `runs`: priors from all of them; the forecast's settings (`settings`, or
    the CHOICES with the least mean |error| of leave-one-run-out forecasts from CHOICE_FRACTIONS of the
    runs' steps); the calibration's scores from leave-one-run-out forecasts with those settings."""
    weights = list(weights) if weights is not None else [1.0] * len(runs)
    taught = list(taught) if taught is not None else [teach(r, w) for r, w in zip(runs, weights)]
    loo = [[t for j, t in enumerate(taught) if j != i] for i in range(len(runs))]
    if settings is None:
        best = None
        for values in itertools.product(*CHOICES.values()):
            trial = dict(zip(CHOICES, values))
            errors = [
                abs(s.law)
                for run, others in zip(runs, loo)
                for s in forecast_scores(run, others, trial, CHOICE_FRACTIONS)
            ]
            mean = float(np.mean(errors)) if errors else math.inf
            if best is None or mean < best[0]:
                best = (mean, trial)
        settings = best[1]
    scores: list[Score] = []
    for run, others in zip(runs, loo):
        scores += forecast_scores(run, others, settings)
    names = tuple(r.name for r in runs)
    law_settings = {k: v for k, v in settings.items() if k != "likeness"}
    library = Library(
        replace(priors_from(of_optimizer(taught, None)), **law_settings),
        Calibration(tuple(scores)),
        names,
        tuple(taught),
        settings,
    )
    return library, taught, settings


def save_fits(path: Path = FITS, settings: dict | None = None) -> Library:
    """Fit and calibrate the shipped library set and keep the results in fits.json; `settings` as given, or
    chosen again (None)."""
    runs = library_runs("library")
    library, taught, settings = build(runs, settings=settings)
    payload = {
        "settings": settings,
        "runs": [asdict(t) for t in taught],
        "scores": [asdict(s) for s in library.calibration.scores],
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")
    default_library.cache_clear()
    return library


def _saved() -> tuple[list[Taught], list[Score], dict] | None:
    """fits.json's whole-run fits, scores and settings, when they are of the shipped library set."""
    if not FITS.is_file():
        return None
    payload = json.loads(FITS.read_text())
    taught = [Taught(**{**t, "features": _stored_features(t.get("features"))}) for t in payload["runs"]]
    if tuple(t.name for t in taught) != tuple(r.name for r in library_runs("library")):
        return None
    return taught, [Score(**s) for s in payload["scores"]], payload["settings"]


@lru_cache(maxsize=1)
def default_library() -> Library:
    """The shipped library set's priors and calibration (from fits.json; fitted here when it is missing or
    stale)."""
    runs = library_runs("library")
    saved = _saved()
    if saved is not None:
        taught, scores, settings = saved
        names = tuple(t.name for t in taught)
        law_settings = {k: v for k, v in settings.items() if k != "likeness"}
        priors = replace(priors_from(of_optimizer(taught, None)), **law_settings)
        return Library(priors, Calibration(tuple(scores)), names, tuple(taught), settings)
    if not runs:
        return Library(LawPriors(evidence=EVIDENCE), Calibration(()), ())
    return build(runs)[0]


def with_project(directories: Sequence[str | Path], exclude: Iterable[str | Path] = ()) -> Library:
    """The default library joined by the finished runs in `directories`, each counting PROJECT_WEIGHT times:
    priors from all, and each project run's leave-one-out scores added to the calibration."""
    base = default_library()
    own = [run for d in directories for run in project_runs(d, exclude)]
    if not own:
        return base
    saved = _saved()
    shipped = saved[0] if saved is not None else [teach(r) for r in library_runs("library")]
    settings = dict(base.settings)
    theirs = [teach(r, PROJECT_WEIGHT) for r in own]
    scores = list(base.calibration.scores)
    for i, run in enumerate(own):
        others = shipped + [t for j, t in enumerate(theirs) if j != i]
        scores += forecast_scores(run, others, settings)
    names = base.runs + tuple(str(r.run_dir) for r in own)
    everyone = tuple(shipped + theirs)
    priors = replace(priors_from(of_optimizer(everyone, None)), **base.law_settings)
    return Library(priors, Calibration(tuple(scores)), names, everyone, settings)


def _stored_features(stored: dict | None) -> RunFeatures | None:
    """fits.json's features of a run (written before the optimizer was one, and with the corpus by name)."""
    if not stored:
        return None
    return RunFeatures(**{**stored, "data": fixture_data_key(stored["data"])})
