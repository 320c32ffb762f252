"""`liandan sweep`: real trials pruned and continued, the forecast pruner on synthetic curves, a diverging
trial stopped at once, and sweep-file mistakes as one line."""

import csv
import math
import re
import subprocess
import sys
import textwrap

import numpy as np
import optuna
import pytest

from helpers import MICRO_MODEL, run_liandan, tiny_config, write_corpus
from liandan.cli.main import main
from liandan.config import ConfigError, ScheduleSection
from liandan.plan.forecast import annealing_areas, schedule_fractions
from liandan.plan.pruner import ForecastPruner
from liandan.plan.sweep import Reporter, _MetricsTail, _Sweep, load_sweep, make_pruner
from liandan.plan.trial_process import stop_process

optuna.logging.set_verbosity(optuna.logging.ERROR)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A run config small enough that a trial is mostly process start-up: 20 steps of a 1-layer model."""
    root = tmp_path_factory.mktemp("sweep")
    corpus = write_corpus(root, n_docs=20)
    cfg = tiny_config(
        root,
        corpus,
        *MICRO_MODEL,
        "--train.steps=20",
        "--train.eval_every=20",
        "--train.eval_batches=2",
    )
    path = root / "base.toml"
    path.write_text(cfg.to_toml())
    return path


def write_sweep(directory, base, body: str, name: str = "sweep.toml"):
    path = directory / name
    head = f'base = "{base}"\noutput_dir = "{directory / "out"}"\n'
    path.write_text(head + textwrap.dedent(body))
    return path


def read_csv(path):
    with path.open() as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_sweep_prunes_continues_and_reports(base, tmp_path, capsys):
    # Seed 25 draws the sane learning rate for trial 0 and the absurd one (30: the loss climbs into the
    # thousands) for trial 1, which the loss-spike guard stops (early divergence, its rollbacks spent) or
    # successive halving stops at its first rung, step 5: either way the trial is pruned.
    sweep = write_sweep(
        tmp_path,
        base,
        """
        study = "lr"
        trials = 2
        pruner = "successive_halving"
        report_every = 5
        seed = 25
        [params]
        "optim.lr" = { choices = [3e-3, 30.0] }
        "schedule.warmup_steps" = { low = 2, high = 4 }
        """,
    )
    assert main(["sweep", str(sweep)]) == 0
    out = capsys.readouterr().out
    study_dir = tmp_path / "out" / "lr"
    rows = read_csv(study_dir / "trials.csv")
    assert [r["number"] for r in rows] == ["0", "1"]
    assert [float(r["optim.lr"]) for r in rows] == [3e-3, 30.0], "the sampler no longer draws this order"
    assert [r["state"] for r in rows] == ["complete", "pruned"]
    assert rows[0]["steps"] == "20" and int(rows[1]["steps"]) < 20
    assert rows[1]["note"] in ("pruned at step 5", f"stopped by the loss-spike guard at step {rows[1]['steps']}")
    assert rows[1]["value"] == ""
    assert 2 <= int(rows[0]["schedule.warmup_steps"]) <= 4
    value = float(rows[0]["value"])
    assert 0 < value < math.log(257)  # a validation loss below the uniform guess over the byte vocabulary
    assert f"best: trial 0, val_loss {value:.4f}" in out
    assert "pruned" in out and "0 finished before" in out
    assert (study_dir / "sweep.png").stat().st_size > 20_000
    assert (study_dir / "lr-trial-1" / "trial.log").is_file()

    # Running it again with a larger budget continues the study: one more trial, numbered 2.
    assert main(["sweep", str(sweep), "--trials=3"]) == 0
    out = capsys.readouterr().out
    again = read_csv(study_dir / "trials.csv")
    assert [r["number"] for r in again] == ["0", "1", "2"]
    assert again[:2] == rows
    assert "2 finished before" in out and again[2]["state"] in ("complete", "pruned")
    # ...and once more with nothing left to do
    assert main(["sweep", str(sweep), "--trials=3"]) == 0
    assert "3 finished before" in capsys.readouterr().out
    assert len(read_csv(study_dir / "trials.csv")) == 3
    completed = [float(r["value"]) for r in again if r["state"] == "complete"]
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{study_dir / 'study.db'}")
    assert study.best_value == min(completed)


def test_a_diverging_trial_is_stopped_at_once(base, tmp_path):
    """A trial process whose loss turns to nan is pruned and ended while it would go on running."""
    spec = load_sweep(write_sweep(tmp_path, base, '[params]\n"optim.lr" = { low = 1e-3, high = 1e-2 }\n'))
    metrics = tmp_path / "metrics.jsonl"
    writer = textwrap.dedent(
        f"""
        import json, time
        with open({str(metrics)!r}, "w") as f:
            for step, loss in [(1, 5.5), (2, 5.0), (3, "nan")]:
                f.write(json.dumps({{"step": step, "loss": loss}}) + "\\n")
                f.flush()
            time.sleep(600)  # a diverged run that trains on
        """
    )
    process = subprocess.Popen([sys.executable, "-c", writer])
    try:
        study = optuna.create_study()
        trial = study.ask()
        sweep = _Sweep(spec, Reporter())
        curve = sweep_curve(spec)
        verdict = sweep._follow(trial, process, _MetricsTail(metrics), curve, total=20)
    finally:
        stop_process(process)
    assert verdict == "diverged: loss nan at step 3"
    assert process.returncode is not None  # ended, not left behind
    assert curve.steps == [1, 2, 3]
    assert math.isnan(study.trials[0].intermediate_values[3])


def test_a_null_loss_reads_as_divergence(tmp_path):
    """Runs write a non-finite loss as null (older ones wrote "nan"); both read as nan, which prunes the trial."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 5.5}\n{"step": 2, "loss": null}\n{"step": 3, "loss": "inf"}\n{"step": 4')
    read = _MetricsTail(metrics).read()
    assert [step for step, _ in read] == [1, 2, 3]  # the half-written last line waits
    assert read[0][1] == 5.5 and math.isnan(read[1][1]) and read[2][1] == math.inf


def sweep_curve(spec):
    from liandan.plan.pruner import PartialCurve

    return PartialCurve([], [], schedule_fractions(spec.base_config.schedule, spec.base_config.train.steps))


@pytest.mark.slow
def test_trials_that_cannot_run_stop_the_sweep(base, tmp_path, capsys):
    """A tokenizer that is not there passes the config's checks and fails every trial as it starts: after
    three in a row the sweep stops with the reason."""
    body = '[params]\n"data.tokenizer" = { choices = ["/nonexistent/tokenizer.json"] }\n'
    sweep = write_sweep(tmp_path, base, body)
    assert main(["sweep", str(sweep)]) == 1
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines() == [
        (
            "liandan: error: sweep stopped: 3 trials in a row failed; the last: exit code 2: liandan: error:"
            " tokenizer file not found: /nonexistent/tokenizer.json"
        )
    ]
    rows = read_csv(tmp_path / "out" / "sweep" / "trials.csv")
    assert [r["state"] for r in rows] == ["fail"] * 3
    assert not (tmp_path / "out" / "sweep" / "sweep.png").exists()  # no run, no curve to draw


def test_a_storage_that_cannot_be_opened(base, tmp_path, capsys):
    body = 'storage = "nosuchdb://x"\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n'
    assert main(["sweep", str(write_sweep(tmp_path, base, body))]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("liandan: error: storage nosuchdb://x: ")


# --------------------------------------------------------------------------------------------------------
# the forecast pruner, through Optuna's API


def synthetic_curve(offset: float, steps=400, seed=0, noise=0.02):
    eta = schedule_fractions(ScheduleSection(kind="cosine", warmup_steps=20, min_lr_ratio=0.1), steps)
    s1, s2 = annealing_areas(eta, 0.9)
    updates = np.arange(steps)
    clean = 2.0 + offset + 3.0 * np.maximum(s1[updates], 1e-9) ** -0.5 - 4e-4 * s2[updates]
    return eta, clean + np.random.default_rng(seed).normal(0.0, noise, steps), clean


def report(trial, losses, upto):
    for step in range(1, upto + 1):
        trial.report(float(losses[step - 1]), step)


def test_forecast_pruner_prunes_a_clearly_worse_trial_and_keeps_a_good_one():
    eta, good, clean = synthetic_curve(0.0)
    pruner = ForecastPruner(eta, samples=8)
    study = optuna.create_study(pruner=pruner)
    first = study.ask()
    report(first, good, 200)
    assert not first.should_prune()  # nothing completed to compare with
    study.tell(first, float(clean[-1]))

    _, worse, _ = synthetic_curve(0.5, seed=1)  # the same curve shape, 0.5 nats higher
    bad = study.ask()
    report(bad, worse, 40)
    assert not bad.should_prune()  # 10% of the steps: too early to judge
    for step in range(41, 121):  # to 30%
        bad.report(float(worse[step - 1]), step)
    assert bad.should_prune()
    forecast, low, high, reference = pruner.last[bad.number]
    assert reference == pytest.approx(clean[-1]) and low > reference and low <= forecast <= high

    _, again, _ = synthetic_curve(0.0, seed=2)  # as good as the first, other noise
    fine = study.ask()
    report(fine, again, 120)
    assert not fine.should_prune()


def test_forecast_pruner_compares_training_losses_and_spares_trials_level_with_the_best():
    """The reference is the best trial's recorded final training loss; a trial level with the best trial at
    the same step is not pruned on its forecast, one a little behind it is."""
    eta, losses, _ = synthetic_curve(0.0)
    study = optuna.create_study(pruner=ForecastPruner(eta, samples=4))
    done = study.ask()
    report(done, losses, 400)
    done.set_user_attr("final_train_loss", 1.0)  # far below any forecast of these curves
    study.tell(done, 5.0)  # a validation loss far above it: not what the forecast is compared with
    level = study.ask()
    report(level, losses, 120)  # the best trial's own curve so far
    assert not level.should_prune()
    behind = study.ask()
    report(behind, losses + 0.01, 120)
    assert behind.should_prune()


def test_pruners_by_name(base, tmp_path):
    kinds = {
        "hyperband": optuna.pruners.HyperbandPruner,
        "successive_halving": optuna.pruners.SuccessiveHalvingPruner,
        "median": optuna.pruners.MedianPruner,
        "forecast": ForecastPruner,
        "none": optuna.pruners.NopPruner,
    }
    for name, cls in kinds.items():
        body = f'pruner = "{name}"\n[params]\n"optim.lr" = {{ low = 1e-4, high = 1e-2, log = true }}\n'
        spec = load_sweep(write_sweep(tmp_path, base, body, f"{name}.toml"))
        assert isinstance(make_pruner(spec), cls)
        assert spec.study == name and spec.scored_by == "val_loss"
    body = (
        'pruner = "median"\npruner_options = { n_startup_trials = 1 }\n[params]\n"model.dim" = { choices = [32, 64] }\n'
    )
    spec = load_sweep(write_sweep(tmp_path, base, body))
    assert make_pruner(spec)._n_startup_trials == 1
    assert isinstance(spec.params["model.dim"], optuna.distributions.CategoricalDistribution)
    body = 'overrides = ["--train.eval_every=0"]\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n'
    spec = load_sweep(write_sweep(tmp_path, base, body))
    assert spec.scored_by == "loss" and "scored by their final training loss" in spec.notes[0]


# --------------------------------------------------------------------------------------------------------
# mistakes in the sweep file


@pytest.mark.parametrize(
    "body, words",
    [
        ('trails = 3\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n', ["unknown key 'trails'", "'trials'"]),
        ('[params]\n"optim.lrr" = { low = 1e-4, high = 1e-2 }\n', ["optim.lrr", "did you mean 'optim.lr'"]),
        ('[params]\n"optim.lr" = { low = 1e-2, high = 1e-4 }\n', ['params."optim.lr"', "`low <= high` must hold"]),
        ('[params]\n"optim.lr" = { low = 0.0, high = 1e-2, log = true }\n', ["`low > 0` must hold for `log=True`"]),
        ('[params]\n"model.dim" = { low = 32.5, high = 64 }\n', ["model.dim", "must be an integer"]),
        ('[params]\n"schedule.warmup_steps" = { low = 2, high = 9, step = 2 }\n', ["not divisible by `step`"]),
        ('[params]\n"optim.lr" = { low = 1e-4, high = 1e-2, log = true, step = 1e-4 }\n', ["`step` is not supported"]),
        ('[params]\n"model.attention" = { low = 1, high = 2 }\n', ["model.attention is not a number"]),
        ('[params]\n"model.dim" = { choices = [32, 33] }\n', ["value 33 is refused", "divisible by model.n_heads"]),
        (
            '[params]\n"model.dim" = { choices = [36] }\n"model.n_heads" = { choices = [4] }\n',  # together: 9
            ['params."model.dim" value 36 is refused', "model.dim / model.n_heads = 9 must be even"],
        ),
        ('[params]\n"optim.lr" = { low = 1e-4, hihg = 1e-2 }\n', ["unknown key 'hihg'"]),
        ('[params]\n"run.name" = { choices = ["a", "b"] }\n', ["run.name is set by the sweep"]),
        ('pruner = "asha"\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n', ["pruner = 'asha'", "hyperband"]),
        (
            'pruner_options = { n_startup = 2 }\npruner = "median"\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n',
            ["n_startup"],
        ),
        (
            'overrides = ["--train.steps=5", "--schedule.warmup_steps=9"]\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n',
            ["warmup_steps = 9 exceeds"],
        ),
        ("[params]\n", ["params = {}", "must be a table of run-config keys"]),
        ('trials = 0\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n', ["trials = 0", "integer >= 1"]),
        ("[params\n", ["is not valid TOML"]),
    ],
)
def test_sweep_file_mistakes_are_one_line(base, tmp_path, capsys, body, words):
    sweep = write_sweep(tmp_path, base, body)
    assert main(["sweep", str(sweep)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: "), captured.err
    for word in words:
        assert word in lines[0]
    assert not (tmp_path / "out").exists()  # nothing ran


def test_params_may_mend_what_the_base_alone_gets_wrong(base, tmp_path):
    """Every trial sets every param: a base whose warm-up exceeds its steps is fine when the warm-up is swept
    below them, and a width is judged with the swept head count, not the base's."""
    long_warmup = tmp_path / "long-warmup.toml"
    long_warmup.write_text(re.sub(r"(?m)^warmup_steps = .*$", "warmup_steps = 30", base.read_text()))
    body = """[params]
    "schedule.warmup_steps" = { low = 2, high = 8, step = 2 }
    """
    spec = load_sweep(write_sweep(tmp_path, long_warmup, body, "warmup.toml"))
    assert spec.base_config.schedule.warmup_steps == 2 and spec.base_config.train.steps == 20
    body = """[params]
    "model.dim" = { choices = [30] }
    "model.n_heads" = { choices = [5] }
    "model.n_kv_heads" = { choices = [1] }
    """
    assert set(load_sweep(write_sweep(tmp_path, base, body, "width.toml")).params) == {
        "model.dim", "model.n_heads", "model.n_kv_heads"}  # fmt: skip


def test_sweep_file_mistake_through_a_real_process(tmp_path):
    sweep = tmp_path / "s.toml"
    sweep.write_text('base = "no/such.toml"\n[params]\n"optim.lr" = { low = 1e-4, high = 1e-2 }\n')
    done = run_liandan("sweep", sweep, timeout=120)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        f"liandan: error: {sweep}: base no/such.toml with the overrides: config file not found: no/such.toml"
    ]


def test_missing_sweep_file():
    with pytest.raises(ConfigError, match="sweep file not found"):
        load_sweep("no/such/sweep.toml")
