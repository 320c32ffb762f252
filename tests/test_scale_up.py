"""Scale-up prediction: a larger run's final loss from a ladder of small ones, before it starts. The ladder
and the larger run in tests/fixtures/ladder/ were trained by benchmarks/ladder.py on the shared data."""

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from liandan.cli.main import main
from liandan.config import ConfigError
from liandan.plan import scale_up
from liandan.plan.scaling import ScalingLaw
from liandan.plan.scaling_runs import Observations, read_csv

LADDER = Path(__file__).parent / "fixtures" / "ladder"


LARGEST_FOUR = ("w48", "w64", "w80", "w96")  # the rungs trained for a few hundred steps or more, seed 1


def target():
    return json.loads((LADDER / "target.json").read_text())


def ladder_runs(rungs=LARGEST_FOUR, seeds=("1",)):
    """The fixture's runs of those rungs and seeds (C = 6·N·D)."""
    rows = list(csv.DictReader(line for line in (LADDER / "ladder.csv").open() if not line.startswith("#")))
    keep = np.array([i for i, r in enumerate(rows) if r["rung"] in rungs and r["seed"] in seeds])
    return read_csv(LADDER / "ladder.csv").take(keep)


# --------------------------------------------------------------------------------------------------------
# the recorded ladder


def test_the_planned_run_is_counted_as_training_counted_it():
    run = scale_up.planned_run(LADDER / "target.toml")
    t = target()
    assert run.n == t["non_embedding_parameters"]
    assert run.d == t["tokens"]
    assert run.flops_per_token == t["flops_per_token"]


def test_the_ladder_predicts_the_larger_runs_final_loss():
    obs, t = ladder_runs(), target()
    run = scale_up.planned_run(LADDER / "target.toml")
    (p,) = scale_up.predict_scale_up(
        obs, run, confidence=0.8, replicates=100
    )  # one tokens-per-parameter line: L(C) alone
    assert p.law == "L(C)" and p.reach > 3  # three times the largest rung's compute
    assert abs(p.loss / t["val_loss"] - 1) <= 0.03
    assert p.low <= t["val_loss"] <= p.high


def test_rungs_of_too_few_steps_bend_the_law_and_the_prediction_misses():
    # docs/benchmarks.md: the smallest four rungs (78 to 457 steps) reach 13.6 times out and miss by 7-14%
    run = scale_up.planned_run(LADDER / "target.toml")
    (p,) = scale_up.predict_scale_up(ladder_runs(("w24", "w32", "w48", "w64")), run, replicates=0)
    assert p.reach > 10 and p.loss / target()["val_loss"] - 1 > 0.1
    (p,) = scale_up.predict_scale_up(ladder_runs(("w24", "w32", "w48", "w64"), ("1", "2")), run, replicates=0)
    assert p.noise_source.startswith("spread of 8 runs repeated at 4 sizes")


def test_liandan_fit_predicts_a_config(capsys, tmp_path):
    obs = ladder_runs()
    ladder = tmp_path / "ladder.csv"
    ladder.write_text("N,D,loss\n" + "".join(f"{n:.0f},{d:.0f},{x}\n" for n, d, x in zip(obs.n, obs.d, obs.loss)))
    code = main(["fit", str(ladder), "--predict", str(LADDER / "target.toml"), "--bootstrap", "40"])
    out = capsys.readouterr().out
    assert code == 0
    row = next(line for line in out.splitlines() if line.startswith("│ target"))
    assert "4 runs" in out
    cells = [c.strip() for c in row.strip("│").split("│")]
    assert cells[5] == "L(C)"
    low, high = (float(x) for x in cells[7].strip("[]").split(","))
    assert low < float(cells[6]) < high
    assert "L(C) = " in out and "a run's noise σ" in out


def test_a_missing_or_broken_config_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no such run config"):
        scale_up.planned_run(tmp_path / "absent.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\ndim = -3\n")
    with pytest.raises(ConfigError):
        scale_up.planned_run(bad)


# --------------------------------------------------------------------------------------------------------
# the interval, on ladders drawn from a known law


LAW = ScalingLaw(E=1.6, A=40.0, B=300.0, alpha=0.35, beta=0.38)


def drawn_ladder(ratios, sizes, sigma, seed, repeats=1):
    rng = np.random.default_rng(seed)
    n = np.repeat(np.array(sizes, dtype=float), len(ratios) * repeats)
    d = n * np.tile(np.repeat(ratios, repeats), len(sizes))
    loss = LAW.loss(n, d) * np.exp(rng.normal(0.0, sigma, len(n)))
    return Observations(n, d, loss, 6 * n * d)


def test_noise_comes_from_repeated_runs_else_the_residuals_and_never_below_the_floor():
    repeated = drawn_ladder([4.0], [2e4, 4e4, 8e4, 1.6e5], sigma=0.02, seed=1, repeats=3)
    sigma, source = scale_up.run_noise(repeated, np.zeros(len(repeated)), 3)
    assert 0.01 < sigma < 0.04 and source.startswith("spread of 12 runs repeated at 4 sizes")
    clean = drawn_ladder([4.0], [2e4, 4e4, 8e4, 1.6e5, 3.2e5], sigma=0.0, seed=1)
    sigma, source = scale_up.run_noise(clean, np.zeros(len(clean)), 3)
    assert sigma == scale_up.NOISE_FLOOR and "floor" in source


def test_intervals_cover_the_truth_about_as_often_as_they_say():
    planned = scale_up.PlannedRun("big", 1.28e6, 5.12e6, 6 * 1.28e6)
    truth = LAW.loss(planned.n, planned.d)
    covered = 0
    for seed in range(10):
        obs = drawn_ladder([4.0], [2e4, 4e4, 8e4, 1.6e5, 3.2e5], sigma=0.01, seed=seed, repeats=2)
        (p,) = scale_up.predict_scale_up(obs, planned, confidence=0.8, replicates=30, seed=seed)
        covered += p.low <= truth <= p.high
        assert abs(p.loss / truth - 1) < 0.05
    assert covered >= 7  # an 80% interval that also carries the run's own noise: if anything, wider


def test_a_ladder_that_varies_tokens_per_parameter_also_predicts_with_l_of_n_and_d():
    obs = drawn_ladder([2.0, 8.0], [2e4, 4e4, 8e4, 1.6e5], sigma=0.003, seed=3)
    planned = scale_up.PlannedRun("long", 1.6e5, 1.6e5 * 40, 6 * 1.6e5)  # off both of the ladder's lines
    by_law = {p.law: p for p in scale_up.predict_scale_up(obs, planned, replicates=30)}
    assert set(by_law) == {"L(C)", "L(N, D)"}
    truth = LAW.loss(planned.n, planned.d)
    assert abs(by_law["L(N, D)"].loss / truth - 1) < 0.03
    assert math.isfinite(by_law["L(N, D)"].low) and by_law["L(N, D)"].low <= by_law["L(N, D)"].high
