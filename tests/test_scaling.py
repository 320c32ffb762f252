"""Scaling-law fits and compute-optimal plans: the closed form against numeric minimisation, recovery of known
laws from noisy synthetic runs, bootstrap intervals, and `liandan fit` / `liandan optimal` end to end."""

import json

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from helpers import liandan_here
from liandan.cli.fit_cmd import _num as shown
from liandan.cli.main import main
from liandan.config import ConfigError
from liandan.plan import scaling, scaling_fit, scaling_runs
from liandan.plan.scaling import CHINCHILLA, ComputeLaw, ScalingLaw
from liandan.plan.scaling_runs import Observations

TRUE = ScalingLaw(E=1.8, A=520.0, B=900.0, alpha=0.36, beta=0.32)


def assert_one_line_error(code, err, *words):
    assert code == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: "), err
    for word in words:
        assert word in lines[0], lines[0]


def synthetic_runs(law=TRUE, noise=0.004, seed=0, ns=None, ds=None):
    """Runs on a grid of N and D whose losses follow `law` times lognormal noise of relative size `noise`."""
    ns = np.logspace(6.5, 9, 5) if ns is None else ns
    ds = np.logspace(8.5, 11, 5) if ds is None else ds
    n, d = (x.ravel() for x in np.meshgrid(ns, ds))
    rng = np.random.default_rng(seed)
    loss = law.loss(n, d) * np.exp(rng.normal(0.0, noise, n.size))
    return Observations(n, d, loss, 6 * n * d)


def write_csv(path, obs, compute_column=False):
    with path.open("w") as f:
        f.write("# synthetic runs\nN,C,loss\n" if compute_column else "N,D,loss\n")
        for n, d, c, l_ in zip(obs.n, obs.d, obs.compute, obs.loss):
            f.write(f"{n:.6g},{c if compute_column else d:.6g},{l_:.6f}\n")
    return path


# ---------------------------------------------------------------------------------------------------- laws


@pytest.mark.parametrize("law", [CHINCHILLA, TRUE, ScalingLaw(E=0.5, A=50.0, B=3000.0, alpha=0.25, beta=0.45)])
@pytest.mark.parametrize("flops", [1e17, 1e20, 5.76e23, 1e26])
def test_closed_form_optimum_matches_numeric_minimisation(law, flops):
    n_opt, d_opt = law.optimal(flops)
    assert 6 * n_opt * d_opt == pytest.approx(flops, rel=1e-12)
    res = minimize_scalar(
        lambda log_n: law.loss(np.exp(log_n), flops / (6 * np.exp(log_n))),
        bounds=(np.log(1e2), np.log(1e18)),
        method="bounded",
        options={"xatol": 1e-9},
    )
    assert np.exp(res.x) == pytest.approx(n_opt, rel=1e-4)
    # and no point of a dense grid along the budget does better
    grid = np.logspace(2, 18, 20001)
    assert law.loss(grid, flops / (6 * grid)).min() >= law.loss(n_opt, d_opt) - 1e-12


def test_tokens_for_a_size_inverts_the_optimum():
    for flops in (1e19, 1e22, 1e25):
        n, d = CHINCHILLA.optimal(flops)
        assert CHINCHILLA.tokens_for_params(n) == pytest.approx(d, rel=1e-9)
        assert CHINCHILLA.params_for_tokens(d) == pytest.approx(n, rel=1e-9)
    assert CHINCHILLA.a == pytest.approx(0.28 / 0.62) and CHINCHILLA.b == pytest.approx(0.34 / 0.62)
    # proposed_run fills in what is not given
    n, d, c = scaling.proposed_run(CHINCHILLA, n=7e9)
    assert d == pytest.approx(CHINCHILLA.tokens_for_params(7e9)) and c == pytest.approx(6 * 7e9 * d)
    assert scaling.proposed_run(CHINCHILLA, n=1e9, flops=6e20) == pytest.approx((1e9, 1e11, 6e20))
    assert scaling.proposed_run(CHINCHILLA, flops=1e21)[:2] == pytest.approx(CHINCHILLA.optimal(1e21))
    with pytest.raises(ConfigError, match="at most two"):
        scaling.proposed_run(CHINCHILLA, n=1.0, d=1.0, flops=6.0)


# ---------------------------------------------------------------------------------------------------- fits


def test_fit_recovers_a_known_law_and_the_bootstrap_covers_it():
    obs = synthetic_runs()
    result = scaling_fit.fit(obs, bootstrap=40, seed=1)
    law = result.law
    assert law.alpha == pytest.approx(TRUE.alpha, abs=0.03)
    assert law.beta == pytest.approx(TRUE.beta, abs=0.03)
    assert law.E == pytest.approx(TRUE.E, abs=0.1)
    assert law.a == pytest.approx(TRUE.a, abs=0.03)
    assert np.sqrt(np.mean(result.residuals() ** 2)) < 0.01
    assert len(result.samples) >= 35
    for name in ("E", "alpha", "beta", "a"):
        lo, hi = result.interval(lambda s, name=name: getattr(s, name), 0.95)
        assert lo <= getattr(TRUE, name) <= hi, (name, lo, hi)
        assert hi - lo < {"E": 0.5, "alpha": 0.1, "beta": 0.1, "a": 0.1}[name]
    # the predicted loss of a much larger run lands near the truth, and inside its interval
    n, d = 2e10, 4e11
    lo, hi = result.interval(lambda s: s.loss(n, d))
    assert lo <= TRUE.loss(n, d) <= hi and law.loss(n, d) == pytest.approx(TRUE.loss(n, d), rel=0.02)


def test_fit_without_noise_is_exact():
    law, objective = scaling_fit.fit_law(synthetic_runs(noise=0.0))
    for name in ("E", "A", "B", "alpha", "beta"):
        assert getattr(law, name) == pytest.approx(getattr(TRUE, name), rel=1e-3), name
    assert objective < 1e-10


def test_fit_is_robust_to_an_outlier():
    obs = synthetic_runs(noise=0.0)
    obs.loss[7] *= 1.3  # one diverged run
    law, _ = scaling_fit.fit_law(obs)
    assert law.alpha == pytest.approx(TRUE.alpha, abs=0.01) and law.beta == pytest.approx(TRUE.beta, abs=0.01)


def test_compute_law_recovers_known_constants():
    truth = ComputeLaw(a=250.0, b=-0.11, c=1.6)
    rng = np.random.default_rng(3)
    c = np.logspace(15, 21, 14)
    loss = truth.loss(c) * np.exp(rng.normal(0, 0.002, c.size))
    obs = Observations(np.ones_like(c), c / 6, loss, c)
    law, _ = scaling_fit.fit_compute_law(obs)
    assert law.b == pytest.approx(truth.b, abs=0.01)
    assert law.c == pytest.approx(truth.c, abs=0.1)
    assert law.loss(1e23) == pytest.approx(truth.loss(1e23), rel=0.02)
    exact, _ = scaling_fit.fit_compute_law(Observations(np.ones_like(c), c / 6, truth.loss(c), c))
    assert (exact.a, exact.b, exact.c) == pytest.approx((truth.a, truth.b, truth.c), rel=1e-3)


def test_too_few_runs_or_one_size_is_a_user_error():
    obs = synthetic_runs()
    with pytest.raises(ConfigError, match="4 run.*5 parameters"):
        scaling_fit.fit_law(obs.take(np.arange(4)))
    with pytest.raises(ConfigError, match="2 run.*3 parameters"):
        scaling_fit.fit_compute_law(obs.take(np.arange(2)))
    same_n = obs.take(np.flatnonzero(obs.n == obs.n[0]))
    with pytest.raises(ConfigError, match="same N"):
        scaling_fit.fit_law(same_n)


def test_huber_is_quadratic_then_linear():
    r = np.array([0.0, 5e-4, -1e-3, 0.01, -0.1])
    expected = [0.0, 0.5 * 25e-8, 0.5e-6, 1e-3 * (0.01 - 5e-4), 1e-3 * (0.1 - 5e-4)]
    assert scaling_fit.huber(r, 1e-3) == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------------- input


def test_csv_with_compute_instead_of_tokens(tmp_path):
    obs = synthetic_runs()
    back = scaling_runs.read_csv(write_csv(tmp_path / "runs.csv", obs, compute_column=True))
    assert back.d == pytest.approx(obs.d, rel=1e-5) and back.loss == pytest.approx(obs.loss, rel=1e-5)


@pytest.mark.parametrize(
    "text, words",
    [
        ("", ["empty"]),
        ("N,loss\n1e6,3.0\n", ["needs columns N, loss and D or C"]),
        ("N,D,loss\n1e6,1e9\n", ["row 2 has 2 fields"]),
        ("N,D,loss\n1e6,lots,3.0\n", ["row 2, column D", "'lots' is not a number"]),
        ("N,D,loss\n1e6,1e9,-3\n", ["row 2, column loss", "must be positive"]),
    ],
)
def test_malformed_csv(tmp_path, text, words):
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        scaling_runs.read_csv(path)
    for word in words:
        assert word in str(err.value)


def fake_runs(root, law=TRUE, seed=0):
    """Run directories as `liandan train` leaves them, with summary.json only."""
    obs = synthetic_runs(law, seed=seed, ns=np.logspace(6.5, 8.5, 3), ds=np.logspace(8.5, 10.5, 3))
    for i, (n, d, l_) in enumerate(zip(obs.n, obs.d, obs.loss)):
        run = root / f"run-{i}"
        run.mkdir(parents=True)
        summary = {
            "steps": 100,
            "tokens": int(d),
            "final_loss": l_ * 1.01,
            "final_loss_smoothed": l_,
            "val_loss": None,
            "parameters": int(n + 5e6),
            "non_embedding_parameters": int(n),
            "flops_per_token": 6.5 * n,
        }
        (run / "summary.json").write_text(json.dumps(summary))
        (run / "metrics.jsonl").write_text("")
    return obs


def test_read_runs_counts_a_mixture_of_experts_by_its_active_parameters(tmp_path):
    """A MoE run's summary gives its active parameters beside its totals: N may be either."""
    run = tmp_path / "runs" / "moe"
    run.mkdir(parents=True)
    summary = {"tokens": 10**8, "final_loss_smoothed": 3.0, "flops_per_token": 6e6, "parameters": 9_000_000,
               "non_embedding_parameters": 8_000_000, "active_parameters": 3_000_000}  # fmt: skip
    (run / "summary.json").write_text(json.dumps(summary))
    n = {p: scaling_runs.load_observations([run], params=p).n[0] for p in scaling_runs.PARAM_COUNTS}
    assert n == {"non_embedding": 8e6, "total": 9e6, "active": 2e6, "active_total": 3e6}
    with pytest.raises(ConfigError, match="allowed: non_embedding, total, active, active_total"):
        scaling_runs.load_observations([run], params="experts")


def test_read_runs_options(tmp_path):
    obs = fake_runs(tmp_path / "runs")
    got = scaling_runs.load_observations([tmp_path / "runs"])
    assert got.names[0] == "run-0" and len(got) == 9
    assert got.n == pytest.approx(obs.n, rel=1e-6) and got.loss == pytest.approx(obs.loss)
    assert got.compute == pytest.approx(6.5 * got.n * got.d)  # flops_per_token x tokens
    assert "final_loss_smoothed" in got.source  # auto: no run has a validation loss
    total = scaling_runs.load_observations([tmp_path / "runs"], params="total", loss="final")
    assert total.n == pytest.approx(got.n + 5e6) and total.loss == pytest.approx(got.loss * 1.01)
    # Summaries from before active counts are of dense models: active counts equal the totals.
    active = scaling_runs.load_observations([tmp_path / "runs"], params="active")
    assert active.n == pytest.approx(got.n) and "active" in active.source
    assert scaling_runs.load_observations([tmp_path / "runs"], params="active_total").n == pytest.approx(total.n)
    with pytest.raises(ConfigError, match="no positive val_loss.*--loss smoothed"):
        scaling_runs.load_observations([tmp_path / "runs"], loss="val")
    with pytest.raises(ConfigError, match="no such file or directory"):
        scaling_runs.load_observations([tmp_path / "nowhere"])


# ---------------------------------------------------------------------------------------------------- CLI


def test_cli_fit_csv_save_and_optimal(tmp_path, capsys):
    csv_path = write_csv(tmp_path / "runs.csv", synthetic_runs())
    saved = tmp_path / "fit.json"
    done = liandan_here("fit", csv_path, "--bootstrap", 12, "--predict-flops", "1e22", "--save", saved)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for words in (
        "25 runs",
        "L(N, D) = E + A/N^α + B/D^β",
        "95% interval",
        "L(C) = a·C^b + c",
        "Prediction",
        "loss, L(N, D)",
        "loss, L(C)",
        "extrapolation",
        "saved:",
    ):
        assert words in out, out
    data = json.loads(saved.read_text())
    assert data["law"]["alpha"] == pytest.approx(TRUE.alpha, abs=0.03) and len(data["bootstrap"]) == 12
    law, _, _ = scaling.load_law(saved)
    n_opt, d_opt = law.optimal(1e22)
    assert shown(n_opt) in out and shown(d_opt) in out

    assert main(["optimal", "--law", str(saved), "--flops", "1e21", "--params", "7B"]) == 0
    out = capsys.readouterr().out
    assert "C = 1.000e21" in out and "N = 7.000e9" in out and "95% intervals" in out
    assert shown(law.tokens_for_params(7e9)) in out


def test_cli_fit_run_directories(tmp_path):
    fake_runs(tmp_path / "runs")
    done = liandan_here(
        "fit",
        *sorted((tmp_path / "runs").iterdir())[:6],
        tmp_path / "runs" / "run-8",
        "--bootstrap",
        5,
        "--predict-n",
        "1e9",
        "--compute",
        "reported",
    )
    assert done.returncode == 0, done.stderr
    assert "7 runs (N = non-embedding parameters, D = tokens, loss = final_loss_smoothed)" in done.stdout
    assert "run-8" in done.stdout and "parameters N" in done.stdout and "reported FLOPs" in done.stdout


def test_cli_fit_over_a_shell_glob_of_a_project_passes_over_its_databases(tmp_path):
    import sqlite3

    from liandan.track.store import RunStore

    fake_runs(tmp_path / "runs")
    RunStore(tmp_path / "runs").close()  # liandan.db, as training leaves beside the runs
    sqlite3.connect(tmp_path / "runs" / "mlflow.db").execute("CREATE TABLE t (x)").connection.close()
    done = liandan_here("fit", *sorted((tmp_path / "runs").iterdir()), "--bootstrap", 5)
    assert done.returncode == 0, done.stderr
    assert "runs (N = non-embedding parameters" in done.stdout


def test_optimal_with_published_hoffmann_constants_in_process(capsys):
    assert main(["optimal", "--law", "hoffmann", "--flops", "5.76e23", "--params", "70B", "--tokens", "1.4T"]) == 0
    out = capsys.readouterr().out
    n, d = CHINCHILLA.optimal(5.76e23)
    assert "hoffmann: Hoffmann et al. 2022" in out and shown(n) in out and shown(d) in out


# Hoffmann et al. 2022, Table 3 (approach 1): parameters, compute-optimal FLOPs and tokens.
CHINCHILLA_TABLE_3 = [
    (400e6, 1.92e19, 8.0e9),
    (1e9, 1.21e20, 20.2e9),
    (10e9, 1.23e22, 205.1e9),
    (67e9, 5.76e23, 1.5e12),
    (175e9, 3.85e24, 3.7e12),
    (280e9, 9.90e24, 5.9e12),
    (520e9, 3.43e25, 11.0e12),
    (1e12, 1.27e26, 21.2e12),
]


@pytest.mark.parametrize("n, flops, tokens", CHINCHILLA_TABLE_3)
def test_default_law_agrees_with_chinchillas_table_3(n, flops, tokens):
    law, samples, name = scaling.named_or_saved_law(None)
    assert name.startswith("epoch:") and not samples
    assert law.tokens_for_params(n) == pytest.approx(tokens, rel=0.25)
    assert law.optimal(flops)[0] == pytest.approx(n, rel=0.2)


def test_published_hoffmann_constants_do_not_fit_table_3():
    """Why they are not the default (Besiroglu et al. 2024): about twice the tokens at 1B, 9x at 1T."""
    assert CHINCHILLA.tokens_for_params(1e9) / 20.2e9 > 2.0
    assert CHINCHILLA.tokens_for_params(1e12) / 21.2e12 > 8.0


def test_optimal_default_names_its_law_in_process(capsys):
    assert main(["optimal", "--flops", "5.76e23"]) == 0
    out = capsys.readouterr().out
    n, d = scaling.EPOCH_REFIT.optimal(5.76e23)
    assert "Besiroglu et al. 2024" in out and shown(n) in out and shown(d) in out
    assert 60e9 < n < 80e9 and 15 < d / n < 25


def test_cli_missing_file_is_one_line():
    done = liandan_here("fit", "/no/such/runs.csv")
    assert_one_line_error(done.returncode, done.stderr, "no such file or directory: /no/such/runs.csv")


@pytest.mark.parametrize(
    "args, words",
    [
        (["fit", "{few}"], ["4 run(s) cannot fit", "give at least 5 runs"]),
        (["fit", "{bad}"], ["row 3, column loss", "'n/a' is not a number"]),
        (["fit", "{empty_dir}"], ["no summary.json"]),
        (["fit", "{good}", "--predict-n", "lots"], ["--predict-n = 'lots'"]),
        (["fit", "{good}", "--predict-n", "1e9", "--predict-d", "1e9", "--predict-flops", "1e20"], ["at most two"]),
        (["fit", "{good}", "--confidence", "95"], ["--confidence = 95.0"]),
        (["fit", "{good}", "--save", "{few}/law.json"], ["cannot write", "few.csv is not a directory"]),
        (["fit", "{good}", "--save", "{empty_dir}"], ["cannot write", "it is a directory; name a file in it"]),
        (["optimal"], ["give --flops C"]),
        (["optimal", "--flops", "-1"], ["--flops = '-1'"]),
        # negative numbers in the forms argparse would take for options reach the tool's own check
        (["optimal", "--flops", "-1e21"], ["--flops = '-1e21'", "expected a positive number"]),
        (["fit", "{good}", "--predict-n", "-7B"], ["--predict-n = '-7B'"]),
        (["optimal", "--law", "{bad}", "--flops", "1e20"], ["not valid JSON"]),
        (["optimal", "--law", "{nolaw}", "--flops", "1e20"], ["needs numbers E, A, B, alpha and beta"]),
        (
            ["optimal", "--law", "kaplan", "--flops", "1e20"],
            ["--law kaplan: neither a published law (epoch, hoffmann)"],
        ),
        (["optimal", "--law", "{binary}", "--flops", "1e20"], ["binary.bin: not a law", "not UTF-8"]),
        (["fit", "{binary}"], ["binary.bin: not a CSV of runs (not UTF-8 text)"]),
    ],
)
def test_cli_bad_input_in_process(tmp_path, capsys, args, words):
    obs = synthetic_runs()
    files = {
        "few": write_csv(tmp_path / "few.csv", obs.take(np.arange(4))),
        "good": write_csv(tmp_path / "good.csv", obs),
        "bad": tmp_path / "bad.csv",
        "empty_dir": tmp_path / "empty",
        "nolaw": tmp_path / "nolaw.json",
        "binary": tmp_path / "binary.bin",
    }
    files["binary"].write_bytes(bytes(range(256)) * 4)

    files["bad"].write_text("N,D,loss\n1e6,1e9,4.0\n1e7,1e9,n/a\n")
    files["empty_dir"].mkdir()
    files["nolaw"].write_text('{"law": {"E": 1.0}}')
    code = main([a.format(**files) for a in args])
    assert_one_line_error(code, capsys.readouterr().err, *words)
