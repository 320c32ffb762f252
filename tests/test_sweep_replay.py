"""Pruners replayed on recorded trials (benchmarks/pruner_regret.py): the trials of tests/fixtures/regret-trials.json
are real tiny runs of `liandan sweep benchmarks/sweep-regret.toml`, every one run to its end."""

from pathlib import Path

import pytest

from liandan.config import ConfigError
from liandan.plan import sweep_replay as R

TRIALS = Path(__file__).parent / "fixtures" / "regret-trials.json"


@pytest.fixture(scope="module")
def trials():
    return R.load_trials(TRIALS)


def test_recorded_trials_round_trip_and_know_their_winner(trials, tmp_path):
    assert len(trials) >= 12 and all(t.steps[-1] == t.total_steps for t in trials)
    copy = tmp_path / "trials.json"
    R.save_trials(trials, copy)
    again = R.load_trials(copy)
    assert [t.final for t in again] == pytest.approx([t.final for t in trials], abs=1e-4)


def test_without_a_pruner_every_trial_finishes_and_nothing_is_saved(trials):
    r = R.replay(trials, "none", range(len(trials)), 12)
    assert r.pruned == 0 and r.saved == 0 and r.regret == 0 and not r.winner_pruned
    assert r.steps_run == sum(t.total_steps for t in trials)


@pytest.mark.parametrize("name", ["hyperband", "median"])
def test_a_replay_is_deterministic_and_regret_means_the_winner_was_lost(trials, name):
    for order in R.orders(len(trials), 3, seed=1):
        first, second = R.replay(trials, name, order, 12), R.replay(trials, name, order, 12)
        assert first == second
        assert 0 <= first.steps_run <= first.steps_total and first.regret >= 0
        assert first.winner_pruned == (first.regret > 0)
        assert (first.pruned > 0) == (first.saved > 0)


def test_the_forecast_pruner_replays_from_the_curves_it_was_shown(trials):
    few = trials[:5]
    r = R.replay(few, "forecast", range(len(few)), 12)
    assert r.winner_pruned == (r.regret > 0) and 0 <= r.saved < 1
    fitted = len(R.FORECASTS.memo)
    assert R.replay(few, "forecast", range(len(few)), 12) == r  # the second replay fits nothing new
    assert len(R.FORECASTS.memo) == fitted


def test_unknown_pruner_and_bad_report_interval_are_one_line(trials):
    with pytest.raises(ConfigError, match="pruner 'asha'; allowed: forecast, hyperband, median, none"):
        R.replay(trials, "asha", [0], 12)
    with pytest.raises(ConfigError, match="report_every = 0"):
        R.replay(trials, "none", [0], 0)
