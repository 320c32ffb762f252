"""Forecasting a run's final loss: the schedule's areas, the law's fit on synthetic curves, the shipped
library's held-out runs, learning from a project's runs, spikes and restarts, and `liandan forecast` end to
end on real tiny runs trained here."""

import json
import math
import shutil

import numpy as np
import pytest
import torch

from helpers import liandan_here, tiny_config, write_corpus
from liandan.common.schedule import lr_multiplier
from liandan.config import ConfigError, ScheduleSection
from liandan.plan.forecast import (
    annealing_areas,
    backtest,
    fit_annealing_law,
    forecast_final_loss,
    forecast_run,
    measured_final_loss,
    read_run,
    schedule_fractions,
)
from liandan.plan.forecast_law import LawPriors, clean_records
from liandan.plan.forecast_library import (
    Calibration,
    Library,
    Score,
    default_library,
    library_runs,
    project_runs,
    with_project,
)
from liandan.train import Trainer

# --------------------------------------------------------------------------------------------------------
# the areas


def test_areas_of_a_hand_computed_schedule():
    # warmup 0.5 -> 1, hold, then drops of 0.5 and 0.25; decay 0.5
    s1, s2 = annealing_areas([0.5, 1.0, 1.0, 0.5, 0.25], decay=0.5)
    assert s1.tolist() == [0.0, 0.5, 1.5, 2.5, 3.0, 3.25]
    # m = 0, 0 (warmup rise not counted), 0, 0.5, 0.5 * 0.5 + 0.25 = 0.5
    assert s2.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.0, 0.5, 1.0])
    s1, s2 = annealing_areas([1.0, 1.0, 1.0], decay=0.999)
    assert s1.tolist() == [0.0, 1.0, 2.0, 3.0] and s2.tolist() == [0.0] * 4


def test_annealing_area_matches_the_double_sum():
    rng = np.random.default_rng(0)
    warmup = np.linspace(0.1, 1.0, 10)
    later = np.clip(1.0 - np.cumsum(rng.uniform(-0.02, 0.05, 60)), 0.05, 1.0)  # with some re-warming
    eta = np.concatenate([warmup, later])
    lam = 0.97
    _, s2 = annealing_areas(eta, lam)
    drops = np.concatenate([[0.0], eta[:-1] - eta[1:]])
    drops[:10] = 0.0  # the warmup's rise
    for s in (0, 5, 11, 30, len(eta)):
        brute = sum(drops[k] * lam ** (i - k) for i in range(s) for k in range(i + 1))
        assert s2[s] == pytest.approx(brute, abs=1e-12)


def test_schedule_fractions_follow_the_trainer():
    cfg = ScheduleSection(kind="wsd", warmup_steps=7, decay_fraction=0.3)
    assert schedule_fractions(cfg, 50).tolist() == [lr_multiplier(j, 50, cfg) for j in range(50)]


# --------------------------------------------------------------------------------------------------------
# the law on synthetic curves


# the law alone: priors that the records override, no calibration (the interval is a rough guess)
WEAK = Library(LawPriors(evidence=1e12), Calibration(()))


def synthetic(kind: str, steps=2000, noise=0.02, seed=0, L0=2.0, A=3.0, alpha=0.6, C=4e-4, lam=0.99):
    eta = schedule_fractions(ScheduleSection(kind=kind, warmup_steps=50, min_lr_ratio=0.1, decay_fraction=0.2), steps)
    s1, s2 = annealing_areas(eta, lam)
    updates = np.arange(steps)
    clean = L0 + A * np.maximum(s1[updates], 1e-9) ** -alpha - C * s2[updates]
    rng = np.random.default_rng(seed)
    return updates + 1, clean + rng.normal(0.0, noise, steps), clean, eta


@pytest.mark.parametrize("kind", ["cosine", "wsd"])
def test_fit_recovers_the_law(kind):
    steps, losses, clean, eta = synthetic(kind)
    weak = LawPriors(evidence=1e12, runs=0)  # the whole curve decides, as for a library run
    fit = fit_annealing_law(steps, losses, eta, decay=0.99, priors=weak)
    assert fit.L0 == pytest.approx(2.0, abs=0.05)
    assert fit.A == pytest.approx(3.0, rel=0.15)
    assert fit.alpha == pytest.approx(0.6, abs=0.05)
    assert fit.C == pytest.approx(4e-4, rel=0.15)
    assert fit.noise == pytest.approx(0.02, rel=0.15)
    assert fit.at(len(eta) - 1) == pytest.approx(clean[-1], abs=0.005)


@pytest.mark.parametrize("kind, seen", [("cosine", 0.6), ("wsd", 0.9)])
def test_forecast_of_a_synthetic_curve(kind, seen):
    steps, losses, clean, eta = synthetic(kind, seed=1)
    k = int(seen * len(eta))
    f = forecast_final_loss(steps[:k], losses[:k], eta, library=WEAK)
    assert f.final_loss == pytest.approx(clean[-1], rel=0.01)
    assert f.low <= clean[-1] <= f.high
    assert f.observed_step == k and f.total_steps == len(eta)
    assert f.observed_fraction == pytest.approx(seen)
    assert 0.2 < f.annealing_seen < 1.0
    # the learning rates' scale does not matter, and neither does the order of the records
    g = forecast_final_loss(steps[:k][::-1], losses[:k][::-1], 3e-4 * eta, library=WEAK)
    assert g.final_loss == pytest.approx(f.final_loss, rel=1e-6)


def test_constant_learning_rate_has_no_annealing_term():
    steps, losses, clean, eta = synthetic("constant", C=0.0)
    f = forecast_final_loss(steps[:1000], losses[:1000], eta, library=WEAK)
    assert f.fit.C == 0.0 and f.annealing_seen == 1.0
    assert f.final_loss == pytest.approx(clean[-1], rel=0.01)
    assert f.power_law == pytest.approx(clean[-1], rel=0.02)  # no schedule to know: the two agree


def test_too_few_records_and_bad_input():
    steps, losses, _, eta = synthetic("cosine")
    with pytest.raises(ConfigError, match="a forecast needs at least"):
        forecast_final_loss(steps[:12], losses[:12], eta)  # all but a few within the warmup
    with pytest.raises(ValueError):
        forecast_final_loss(steps[:500], losses[:500], eta[:100])  # records past the end of the schedule
    nan = losses[:500].copy()
    nan[::7] = float("nan")  # non-finite records are ignored
    assert math.isfinite(forecast_final_loss(steps[:500], nan, eta).final_loss)


# --------------------------------------------------------------------------------------------------------
# the shipped library: real tiny runs trained by benchmarks/forecast_library.py

SCHEDULES = {"cosine", "wsd", "linear", "constant"}


def test_the_library_ships_both_sets_of_every_schedule():
    library, heldout = library_runs("library"), library_runs("heldout")
    assert {r.schedule for r in heldout} == SCHEDULES == {r.schedule for r in library}
    assert not {r.name for r in library} & {r.name for r in heldout}
    assert all(r.finished for r in library + heldout)
    assert {t.name for t in default_library().taught} == {r.name for r in library}  # fits.json is of the set
    adamw = [r for r in library if r.features.optimizer == "adamw"]
    assert default_library().priors.runs == len(adamw)  # a run of unknown optimizer is taken for an AdamW run


@pytest.fixture(scope="module")
def heldout_rows():
    return backtest([], (0.1, 0.2, 0.5))


def test_heldout_runs_are_forecast_within_tolerance(heldout_rows):
    """The issue's bar on the held-out runs (docs/benchmarks.md has the tables): from a fifth of the steps a
    mean |error| of at most 3%, clearly below the power law's; from a tenth at most 6%."""
    from liandan.cli.forecast_cmd import summarize

    assert {r.schedule for r in heldout_rows} == SCHEDULES and all(r.forecast for r in heldout_rows)
    overall = {s["fraction"]: s for s in summarize(heldout_rows) if s["schedule"] == "all"}
    assert overall[0.2]["mean_error"] <= 0.03
    assert overall[0.2]["mean_error"] < 0.6 * overall[0.2]["power_mean_error"]
    assert overall[0.1]["mean_error"] <= 0.06
    assert overall[0.1]["mean_error"] < overall[0.1]["power_mean_error"]


def test_heldout_coverage_of_the_calibrated_interval(heldout_rows):
    from liandan.cli.forecast_cmd import summarize

    inside = [r.covered for r in heldout_rows]
    assert sum(inside) / len(inside) == pytest.approx(
        np.mean([s["coverage"] for s in summarize(heldout_rows) if s["schedule"] == "all"])
    )
    assert 0.7 <= sum(inside) / len(inside) <= 0.9  # 80% intervals, 30 forecasts
    for r in heldout_rows:
        f = r.forecast
        assert f.low < f.final_loss < f.high and f.confidence == 0.8


def test_conformal_half_width():
    """The k-th smallest |score - median| of n runs, k = ceil((n + 1) * confidence), per share of steps;
    interpolated between shares and never narrower for a forecast that saw less."""
    scores = [Score(f"run{i}", 0.2, 0.01 * i, 0.0) for i in range(-4, 6)]  # median 0.005
    scores += [Score(f"run{i}", 0.5, 0.002 * i, 0.0) for i in range(-4, 6)]
    calibration = Calibration(tuple(scores))
    spread = sorted(abs(0.01 * i - 0.005) for i in range(-4, 6))
    assert calibration.bias(0.2) == pytest.approx(0.005)
    assert calibration.half_width(0.2, 0.8) == pytest.approx(spread[8])  # ceil(11 * 0.8) = 9th
    assert calibration.half_width(0.2, 0.5) == pytest.approx(spread[5])
    # less seen than any share calibrated: wider as 1 / sqrt(the share past a library run's warmup, 5%)
    assert calibration.half_width(0.1, 0.8) == pytest.approx(calibration.half_width(0.2, 0.8) * math.sqrt(3.0))
    assert calibration.half_width(0.5, 0.8) < calibration.half_width(0.3, 0.8) < calibration.half_width(0.2, 0.8)
    assert calibration.half_width(0.2, 0.8, "power") == 0.0  # the baseline's own scores


def test_a_restart_keeps_the_resumed_records():
    steps, losses = clean_records([1, 2, 3, 4, 2, 3, 4, 5], [9.0, 8.0, 7.0, 6.0, 8.5, 7.5, 6.5, 5.5])
    assert steps.tolist() == [0, 1, 2, 3, 4] and losses.tolist() == [9.0, 8.5, 7.5, 6.5, 5.5]


def test_a_spike_and_a_restart_do_not_move_a_forecast():
    run = next(r for r in library_runs("heldout") if r.schedule == "linear" and "spike" not in r.name)
    upto = run.steps <= 0.4 * run.total_steps
    steps, losses = run.steps[upto], run.losses[upto].copy()
    base = forecast_final_loss(steps, losses, run.lr_fractions).final_loss
    spiked = losses.copy()
    middle = len(spiked) // 2
    spiked[middle : middle + 6] += 3.0  # six records of a loss spike
    assert forecast_final_loss(steps, spiked, run.lr_fractions).final_loss == pytest.approx(base, rel=0.005)
    # a run killed and resumed from an earlier checkpoint logs those steps again: the resumed records count
    lost = slice(len(steps) // 3, len(steps) // 2)
    again_steps = np.concatenate([steps[: lost.stop], steps[lost], steps[lost.stop :]])
    again_losses = np.concatenate([losses[: lost.start], losses[lost] + 0.5, losses[lost], losses[lost.stop :]])
    resumed = forecast_final_loss(again_steps, again_losses, run.lr_fractions).final_loss
    assert resumed == pytest.approx(base, rel=1e-9)


def test_real_spike_and_restart_runs(heldout_rows):
    """The held-out runs with a learning-rate burst at step 300 of 1000 and with a kill and resume: forecast
    from after the spike and its recovery, and from before and after the restart, as well as the rest."""
    (spike,) = [r for r in heldout_rows if "spike" in r.run and r.fraction == 0.5]
    assert abs(spike.error) < 0.03 and spike.covered
    for row in [r for r in heldout_rows if "restart" in r.run]:
        assert abs(row.error) < 0.03 and row.covered


# --------------------------------------------------------------------------------------------------------
# real tiny runs

RUNS = {
    # name: schedule, shape, steps, peak learning rate
    "cosine": ("cosine", ["--model.dim=32", "--model.n_layers=1"], 300, 1e-2),
    "wsd": ("wsd", ["--model.dim=48", "--model.n_layers=1"], 300, 5e-3),
    "linear": ("linear", ["--model.dim=48", "--model.n_layers=1"], 200, 5e-3),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three finished runs of small models over the language reference (two thirds of an epoch at most)."""
    root = tmp_path_factory.mktemp("forecast")
    corpus = write_corpus(root, n_docs=100)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is fastest, and the machine is shared
    try:
        out = {}
        for name, (kind, shape, steps, lr) in RUNS.items():
            cfg = tiny_config(
                root,
                corpus,
                f"--run.name={name}",
                f"--schedule.kind={kind}",
                f"--train.steps={steps}",
                f"--optim.lr={lr}",
                "--schedule.warmup_steps=15",
                "--train.global_batch=32",
                "--train.seq_len=32",
                "--model.n_heads=2",
                "--model.n_kv_heads=1",
                *shape,
            )
            out[name] = Trainer(cfg, say=lambda m: None).train().run_dir
    finally:
        torch.set_num_threads(threads)
    return out


def test_learning_from_a_project_directory(runs):
    """The project's finished runs join the priors and the calibration; a run is not its own prior."""
    project = runs["wsd"].parent
    found = project_runs(project)
    assert {r.name for r in found} == set(runs)
    shipped = default_library()
    library = with_project([project], exclude=[runs["wsd"]])
    assert library.priors.runs == shipped.priors.runs + 2
    assert str(runs["wsd"]) not in library.runs and str(runs["cosine"]) in library.runs
    assert library.priors.log_alpha != shipped.priors.log_alpha  # what the project's runs teach moves it
    assert len(library.calibration.scores) > len(shipped.calibration.scores)  # their own backtests count too
    f = forecast_run(runs["wsd"], upto_step=150)  # the default: the run's parent directory
    assert f.prior_runs == library.priors.runs
    alone = forecast_run(runs["wsd"], upto_step=150, libraries=[])
    assert alone.prior_runs == shipped.priors.runs
    (row,) = backtest([runs["wsd"]], (0.5,), libraries=[project])  # the replayed run never teaches itself
    assert row.forecast.prior_runs == shipped.priors.runs + 2


def test_forecast_of_a_run_in_progress(runs):
    run = read_run(runs["wsd"])
    assert run.finished and run.schedule == "wsd" and len(run.steps) == 300
    f = forecast_run(runs["wsd"], upto_step=150)
    assert f.observed_step == 150 and f.observed_fraction == pytest.approx(0.5)
    assert f.annealing_seen == 0.0  # the cooldown is the last fifth
    assert f.final_loss < f.current_loss  # the rest of the run, cooldown included, lowers the loss
    full = forecast_run(runs["wsd"])
    assert full.final_loss == pytest.approx(measured_final_loss(run.steps, run.losses), rel=0.02)


def test_a_run_still_writing(runs, tmp_path):
    """A copy of a run cut at step 150 with a half-written record, as a run in progress leaves it."""
    copy = tmp_path / "live"
    shutil.copytree(runs["wsd"], copy, ignore=shutil.ignore_patterns("data", "*.png"))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join(lines[:150]) + "\n" + lines[150][:20])
    (copy / "summary.json").unlink()
    run = read_run(copy)
    assert not run.finished and run.steps[-1] == 150
    f = forecast_run(copy, libraries=[])
    assert f.observed_step == 150
    assert f.final_loss == pytest.approx(forecast_run(runs["wsd"], upto_step=150, libraries=[]).final_loss)
    with pytest.raises(ConfigError, match="not finished"):
        backtest([copy])


# --------------------------------------------------------------------------------------------------------
# the command line


def test_cli_forecast_and_reference(runs, tmp_path):
    done = liandan_here("forecast", runs["wsd"], "--upto=150", f"--reference={runs['linear']}")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "step 150 of 300 (50% observed)" in out
    assert "forecast final loss" in out and "80% interval" in out and "power law" in out
    assert "priors and interval learned from" in out
    assert "  target: training loss at step 300 (" in out  # what is forecast, stated
    assert "units from the nearest run learned from" in out
    wsd = forecast_run(runs["wsd"], upto_step=150).final_loss
    linear = measured_final_loss(read_run(runs["linear"]).steps, read_run(runs["linear"]).losses)
    if wsd > linear:
        assert "WORSE than reference" in out
    else:
        assert "not worse than reference" in out
    # against a reference one cannot beat (a loss of 0.5), flagged, exit 3
    reference = tmp_path / "best"
    shutil.copytree(runs["cosine"], reference, ignore=shutil.ignore_patterns("data", "*.png"))
    records = [json.loads(line) for line in (reference / "metrics.jsonl").read_text().splitlines()]
    (reference / "metrics.jsonl").write_text("".join(json.dumps({**r, "loss": 0.5}) + "\n" for r in records))
    done = liandan_here(
        "forecast", runs["cosine"], "--upto=60", f"--reference={reference}", "--fail-if-worse", "--json"
    )  # fmt: skip
    record = json.loads(done.stdout)
    assert record["worse"] and record["final_loss"] > record["reference_loss"] == pytest.approx(0.5)
    assert record["observed_step"] == 60 and record["total_steps"] == 300
    assert record["target"].startswith("training loss at step 300") and record["source"] in ("library", "own fit")
    assert done.returncode == 3


def test_cli_backtest(runs):
    done = liandan_here("forecast", "--backtest", *runs.values(), "--fractions=0.2,0.5")
    assert done.returncode == 0, done.stderr
    for name in runs:
        assert name in done.stdout
    assert "by share of the steps seen and schedule" in done.stdout and "power law" in done.stdout


def assert_one_line_error(done, *words):
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: "), done.stderr
    for word in words:
        assert word in lines[0]


def test_cli_bad_input(runs, tmp_path):
    assert_one_line_error(liandan_here("forecast", tmp_path), "not a run directory")
    assert_one_line_error(liandan_here("forecast", runs["cosine"], "--upto=10"), "a forecast needs at least")
    assert_one_line_error(liandan_here("forecast", runs["cosine"], "--upto=-5"), "--upto = -5 must be a step")
    assert_one_line_error(liandan_here("forecast", "--backtest", runs["cosine"], "--fractions=0,2"), "--fractions")


@pytest.mark.parametrize("bad", ["NaN", "null", "Infinity"])
def test_a_diverged_run_is_not_forecast_from_its_finite_prefix(runs, tmp_path, bad):
    """A run whose loss turned non-finite at step 120: forecasting it from the steps before would hide the
    divergence, so it is refused, naming the step; a forecast from before it still works."""
    copy = tmp_path / "diverged"
    shutil.copytree(runs["wsd"], copy, ignore=shutil.ignore_patterns("data", "*.png"))
    lines = (copy / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines[:150]]
    out = [json.dumps(r) if r["step"] < 120 else json.dumps(r).replace(f'"loss": {r["loss"]}', f'"loss": {bad}')
           for r in records]  # fmt: skip
    (copy / "metrics.jsonl").write_text("\n".join(out) + "\n")
    (copy / "summary.json").unlink()
    assert read_run(copy).diverged_at == 120
    with pytest.raises(ConfigError, match="not finite from step 120"):
        forecast_run(copy)
    assert forecast_run(copy, upto_step=119).observed_step == 119
    assert_one_line_error(liandan_here("forecast", copy), "not finite from step 120", "--upto 119")


def test_cli_fractions_only_with_backtest(runs):
    assert_one_line_error(liandan_here("forecast", runs["wsd"], "--fractions=0.5"), "--fractions goes with --backtest")
