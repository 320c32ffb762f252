"""Forecasts of runs unlike the library: the run's distance from it (the optimizer among its features), the
interval widening with that distance and with little curve past the warmup, the fall back to the run's own
fit, the refusal of a curve too short, and the target every forecast states."""

import math
import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from liandan.config import ConfigError, ScheduleSection, load_config
from liandan.plan.forecast import forecast_final_loss, schedule_fractions
from liandan.plan.forecast_features import (
    FALLBACK_DISTANCE,
    OPTIMIZER_DISTANCE,
    WIDEN_PER_UNIT,
    RunFeatures,
    features_of,
    library_equivalent,
)
from liandan.plan.forecast_library import default_library, library_runs
from liandan.plan.live_forecast import LiveForecaster


@pytest.fixture(scope="module")
def run():
    """A run of the library set itself: its features are the library's, its distance 0."""
    return next(r for r in library_runs("library") if r.name == "wsd-m-1500-lr0.002")


def forecast(run, upto, features):
    keep = run.steps <= upto
    return forecast_final_loss(run.steps[keep], run.losses[keep], run.lr_fractions, run.total_steps, features=features)


def half_width(f):
    return math.log(f.high / f.final_loss)


def test_the_optimizer_is_a_feature_of_every_run():
    assert {r.features.optimizer for r in library_runs("all")} == {"adamw", "muon"}
    assert {t.features.optimizer for t in default_library().taught} == {"adamw", "muon"}
    adamw = RunFeatures(1e5, 1024, 2e-3, "byte:a.txt")
    muon = replace(adamw, optimizer="muon")
    assert adamw.distance(muon) == OPTIMIZER_DISTANCE and adamw.distance(adamw) == 0.0
    cfg = load_config(None, ["--optim.lr=0.002", "--data.tokenizer=byte", '--data.paths=["x/a.txt"]'])
    assert features_of(cfg) == RunFeatures(
        12.0 * cfg.model.llama.n_layers * cfg.model.llama.dim**2,
        cfg.train.global_batch * cfg.train.seq_len,
        0.002,
        "byte:a.txt",
        cfg.optim.name,
    )
    # the shipped fixtures and fits.json name their data as a run's config does: files, not corpus names
    names = {t.features.data for t in default_library().taught}
    assert "byte:en-shakespeare.txt,en-wikitext2.jsonl" in names and "byte:zh-classics.jsonl" in names


def test_a_muon_run_is_forecast_from_muon_curves():
    """Muon's curves differ in shape from AdamW's: a Muon run learns from the library's Muon runs alone, an
    AdamW run from its AdamW runs, and a run with an optimizer the library lacks from all, two units away."""
    library = default_library()
    muon = next(r for r in library_runs("library") if r.name == "cosine-m-1000-lr0.002-muon")
    adamw = next(r for r in library_runs("library") if r.name == "cosine-m-1200-lr0.002")
    assert replace(muon.features, optimizer="adamw") == adamw.features  # alike but for the optimizer

    def teachers(features):
        return {t.name: t.features.optimizer for t in library.alike(features)}

    assert set(teachers(muon.features).values()) == {"muon"} and len(teachers(muon.features)) >= 3
    assert set(teachers(adamw.features).values()) == {"adamw"} and adamw.name in teachers(adamw.features)
    assert teachers(replace(adamw.features, optimizer="lion")).keys() == {t.name for t in library.taught}
    seen = muon.steps <= 200
    f = forecast_final_loss(muon.steps[seen], muon.losses[seen], muon.lr_fractions, muon.total_steps,
                            features=replace(muon.features, lr=3e-3))  # fmt: skip
    assert f.nearest.endswith("-muon") and f.distance < 0.5 and f.source == "library"


def test_distance_widens_the_interval(run):
    alike = forecast(run, 300, run.features)
    assert alike.distance == 0.0 and alike.nearest and alike.widening == 1.0
    slow = forecast(run, 300, replace(run.features, lr=2.5e-4))  # 4x below the library's lowest rate: one unit
    assert slow.distance == pytest.approx(1.0) and slow.widening == pytest.approx(1.0 + WIDEN_PER_UNIT)
    assert half_width(slow) == pytest.approx(slow.widening * half_width(alike))  # the same calibration, widened
    other = forecast(run, 300, replace(run.features, optimizer="lion"))  # an optimizer no run used: two units
    assert other.distance == pytest.approx(2.0) and other.source == "library"
    assert "(optimizer lion, not " in other.reach and other.widening == 1.0 + 2.0 * WIDEN_PER_UNIT
    assert half_width(other) > 1.3 * half_width(alike) and half_width(other) > half_width(slow)


def test_a_run_far_from_the_library_falls_back_to_its_own_fit(run):
    far = replace(run.features, optimizer="lion", data="bpe4096:other.txt")
    f = forecast(run, 300, far)
    assert f.distance == pytest.approx(math.sqrt(8.0)) and f.distance > FALLBACK_DISTANCE and f.source == "own fit"
    assert f.final_loss == pytest.approx(f.fit.at(run.total_steps - 1))  # the run's own law alone, uncorrected
    near = forecast(run, 300, run.features)
    assert half_width(f) >= f.widening * half_width(near)  # at least as wide as the library's, widened
    assert f.low < f.final_loss < f.high


def test_little_curve_past_a_long_warmup_widens_the_interval():
    assert library_equivalent(200, 51, 1000) == pytest.approx(0.2, abs=0.002)  # the library's warmup: as seen
    assert library_equivalent(400, 301, 1000) == pytest.approx(0.05 + 0.95 * 99 / 699)  # a long one: less
    steps = 2000
    curves = {}
    for warmup in (100, 600):
        eta = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=warmup), steps)
        s1 = np.cumsum(np.concatenate([[0.0], eta]))[:steps]
        clean = 2.0 + 3.0 * np.maximum(s1, 1e-9) ** -0.5
        loss = clean + np.random.default_rng(0).normal(0.0, 0.02, steps)
        upto = 700
        curves[warmup] = forecast_final_loss(np.arange(1, upto + 1), loss[:upto], eta)
    short, long = curves[100], curves[600]
    assert short.observed_fraction == long.observed_fraction == 0.35
    assert half_width(long) > 1.5 * half_width(short)


def test_a_curve_too_short_is_refused_naming_the_steps_it_needs():
    eta = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=100), 1000)
    for steps in (np.arange(5, 51, 5), np.arange(5, 106, 5)):  # logged every 5 steps: within the warmup, 2 past it
        with pytest.raises(ConfigError) as err:
            forecast_final_loss(steps, 5.0 - 0.01 * steps, eta)
        message = str(err.value)
        assert "\n" not in message and message.startswith("too short to forecast: ")
        assert "a forecast needs at least 8 records and 1%" in message
        more, until = (int(x) for x in re.search(r"(\d+) more steps \(to step (\d+) of 1000\)", message).groups())
        assert until == steps[-1] + more and more % 5 == 0
        enough = np.arange(5, until + 1, 5)  # the steps it named are enough, 5 fewer are not
        assert forecast_final_loss(enough, 5.0 - 0.01 * enough, eta).observed_step == until
        with pytest.raises(ConfigError, match="5 more steps"):
            forecast_final_loss(enough[:-1], 5.0 - 0.01 * enough[:-1], eta)


def test_a_long_run_needs_a_share_of_its_steps_past_the_warmup():
    eta = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=100), 100_000)
    steps = np.arange(1, 301)  # 200 records past the warmup: plenty of records, 0.2% of the run
    with pytest.raises(ConfigError) as err:
        forecast_final_loss(steps, 5.0 - 0.001 * steps, eta)
    message = str(err.value)
    assert "\n" not in message and "200 loss records and 0.2% of the steps after the warmup (step 100)" in message
    assert ": 799 more steps (to step 1099 of 100000)" in message
    enough = np.arange(1, 1100)
    assert forecast_final_loss(enough, 5.0 - 0.001 * np.sqrt(enough), eta).observed_step == 1099


def test_every_forecast_states_its_target(run):
    f = forecast(run, 300, run.features)
    tokens = run.total_steps * run.features.tokens_per_step
    assert f.target_tokens == tokens
    assert f.target.startswith(f"training loss at step {run.total_steps} ({tokens:,} tokens), the last step")
    record = f.to_dict()
    assert record["target"] == f.target and record["source"] == "library" and record["distance"] == 0.0
    bare = forecast(run, 300, None)  # no features: the target in steps alone, the distance not measured
    assert bare.target_tokens is None and "tokens" not in bare.target and bare.distance == 0.0


def test_a_live_forecast_knows_the_run_and_states_its_target():
    cfg = load_config(None, ["--train.steps=200", "--forecast.every=50", "--schedule.warmup_steps=10"])
    forecaster = LiveForecaster.from_config(cfg)
    assert forecaster.features == features_of(cfg)
    steps = list(range(1, 101))
    live = forecaster.compute(steps, [4.0 / math.sqrt(s) + 1.5 for s in steps])
    assert live is not None and live.target.startswith("training loss at step 200")
    assert live.to_event()["source"] in ("library", "own fit") and live.distance > 0.0


def test_backtest_on_the_kept_runs_unlike_the_library():
    """The held-out runs of benchmarks/forecast_unlike.py (docs/benchmarks.md has the tables): the 80%
    intervals hold 70 to 95% of their final losses (93% when written, above the 70-90% aimed at), none of the
    kinds of unlikeness at 0%, the run past 2.5 units from every library run (and only it) forecast by its own
    fit, the runs with long warmups refused from within them."""
    from liandan.plan.forecast import backtest_curves
    from liandan.plan.forecast_library import load_fixture

    kept = sorted((Path(__file__).parents[1] / "benchmarks" / "forecast_unlike").glob("*.json.gz"))
    assert len(kept) == 31
    rows = backtest_curves([load_fixture(p) for p in kept], (0.1, 0.2, 0.5))
    done = [r for r in rows if r.forecast is not None]
    assert {Path(r.run).name for r in rows if r.forecast is None} == {
        "schedule-cosine-m-600-lr0.002-warmup30",
        "schedule-constant-m-600-lr0.002-warmup25",
        "schedule-cosine-s-800-lr0.003-warmup15-floor30",
    }
    assert all(r.note.startswith("too short to forecast") for r in rows if r.forecast is None)
    assert 0.7 <= sum(r.covered for r in done) / len(done) <= 0.9  # 78 of 88 when written
    kinds = {Path(r.run).name.split("-")[0] for r in done}
    for kind in kinds:
        assert any(r.covered for r in done if Path(r.run).name.startswith(kind + "-")), kind
    assert {Path(r.run).name for r in done if r.forecast.source == "own fit"} == {"several-wsd-xs-b2-800-lr0.01-gsm8k"}
    assert all((r.forecast.source == "own fit") == (r.forecast.distance > 2.5) for r in done)
