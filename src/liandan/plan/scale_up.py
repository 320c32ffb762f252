"""The final loss of a larger run, predicted before it starts from a ladder of small runs (the GPT-4 technical
report's "predictable scaling"): fit a law across the ladder, put in the planned run's size, tokens and
compute, and give an interval that says how far the run itself may land from the law.

The law. A ladder whose data grows with the model (a fixed number of tokens per parameter) lies on one line
of (N, D): along it the loss is a function of compute alone, L(C) = a·C^b + c, fitted as
`liandan.plan.scaling_fit.fit_compute_law` fits it. When the runs also vary the tokens per parameter (at least
1.5-fold) and there are five or more, L(N, D) = E + A/N^α + B/D^β is fitted too and predicts at the planned
run's own N and D, which L(C) cannot when the planned run leaves the ladder's line.

The interval is a parametric bootstrap of the ladder's noise. A run's final loss scatters around the law by
its seed (initialisation, data order, held-out split): σ in log loss, measured from repeated runs of the same
N and D when the ladder has them (pooled within-group spread), else from the fit's residuals (corrected for
the parameters the law spends), never below `NOISE_FLOOR`. Each replicate adds that noise to every ladder
run, refits the law, predicts, and adds the planned run's own noise; the interval is the replicates'
percentiles. It covers the ladder's noise carried through the fit and the run's own scatter; it does not
cover a law whose form is wrong far outside the ladder, so the prediction says how far it extrapolates.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from liandan.config import ConfigError, load_config
from liandan.plan.scaling_fit import fit_compute_law, fit_law
from liandan.plan.scaling_runs import Observations

NOISE_FLOOR = 0.005  # σ of log loss: half a percent, below what seeds of small runs ever scatter here
RATIO_SPREAD = 1.5  # tokens per parameter must vary this much across the runs for L(N, D) to see N apart from D


@dataclass(frozen=True)
class PlannedRun:
    """What a run config will train: N parameters (as the ladder counts them), D tokens, FLOPs per token."""

    name: str
    n: float
    d: float
    flops_per_token: float

    def compute(self, how: str) -> float:
        """C as the ladder's C was counted: "6nd" (6·N·D) or "reported" (FLOPs per token × D)."""
        return 6.0 * self.n * self.d if how == "6nd" else self.flops_per_token * self.d


def planned_run(path: str | Path, *, params: str = "non_embedding") -> PlannedRun:
    """The run a config file describes, counted as `liandan train` will count it (summary.json's
    parameters, tokens = steps × global batch × sequence length, flops_per_token)."""
    from liandan.model import count_params, flops_per_token
    from liandan.plan.run_plan import plan_model_args

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--predict {path}: no such run config")
    cfg = load_config(path, [])
    args = plan_model_args(cfg)
    counts = count_params(args)
    embedding = counts.total - counts.non_embedding
    n = {
        "non_embedding": counts.non_embedding,
        "total": counts.total,
        "active": counts.active - embedding,
        "active_total": counts.active,
    }[params]
    tokens = cfg.train.steps * cfg.train.global_batch * cfg.train.seq_len
    return PlannedRun(path.stem, float(n), float(tokens), float(flops_per_token(args, cfg.train.seq_len)))


@dataclass(frozen=True)
class ScaleUpPrediction:
    """The predicted final loss of a planned run under one law, with its interval."""

    run: PlannedRun
    law: str  # "L(C)" or "L(N, D)"
    loss: float
    low: float | None  # None without replicates
    high: float | None
    confidence: float
    noise: float  # σ of a run's log loss around the law, as used by the interval
    noise_source: str
    compute: float
    reach: float  # the run's compute over the largest ladder run's
    replicates: int


def run_noise(obs: Observations, residuals: np.ndarray, parameters: int) -> tuple[float, str]:
    """σ of a run's log loss around the law, and where it came from (see the module's docstring)."""
    groups: dict[tuple[float, float], list[float]] = defaultdict(list)
    for n, d, loss in zip(obs.n, obs.d, obs.loss):
        groups[(float(n), float(d))].append(math.log(loss))
    repeated = [g for g in groups.values() if len(g) > 1]
    if repeated:
        squares = sum(float(np.sum((np.asarray(g) - np.mean(g)) ** 2)) for g in repeated)
        dof = sum(len(g) - 1 for g in repeated)
        sigma, source = (
            math.sqrt(squares / dof),
            f"spread of {sum(map(len, repeated))} runs repeated at {len(repeated)} sizes",
        )
    else:
        dof = len(obs) - parameters
        sigma = math.sqrt(float(np.sum(residuals**2)) / dof) if dof > 0 else 0.0
        source = f"fit residuals ({dof} degree(s) of freedom)" if dof > 0 else "no repeated runs, no residual freedom"
    if sigma < NOISE_FLOOR:
        return NOISE_FLOOR, f"{source}; floor {NOISE_FLOOR:.1%}"
    return sigma, source


def varies_tokens_per_param(obs: Observations) -> bool:
    ratio = obs.d / obs.n
    return len(obs) >= 5 and float(ratio.max() / ratio.min()) >= RATIO_SPREAD and len(np.unique(obs.n)) >= 2


def predict_scale_up(
    obs: Observations,
    run: PlannedRun,
    *,
    compute: str = "6nd",
    confidence: float = 0.8,
    replicates: int = 200,
    seed: int = 0,
) -> list[ScaleUpPrediction]:
    """The planned run's final loss under L(C) and, when the ladder can tell N from D, under L(N, D).
    `obs.compute` must be counted as `compute` says ("6nd" or "reported")."""
    if compute not in ("6nd", "reported"):
        raise ConfigError(f"compute = {compute!r}; allowed: 6nd, reported")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence = {confidence} must lie between 0 and 1")
    c = run.compute(compute)
    reach = c / float(obs.compute.max())
    rng = np.random.default_rng(seed)
    out = []

    law, _ = fit_compute_law(obs)
    residuals = np.log(obs.loss) - np.log(law.loss(obs.compute))
    sigma, source = run_noise(obs, residuals, 3)

    def refit_compute(sample: Observations) -> float:
        return fit_compute_law(sample, starts=1, init=[law])[0].loss(c)

    values = _replicates(obs, sigma, replicates, rng, refit_compute)
    out.append(_prediction(run, "L(C)", law.loss(c), values, confidence, sigma, source, c, reach))

    if varies_tokens_per_param(obs):
        nd_law, _ = fit_law(obs)
        residuals = np.log(obs.loss) - np.log(nd_law.loss(obs.n, obs.d))
        sigma, source = run_noise(obs, residuals, 5)

        def refit_nd(sample: Observations) -> float:
            return fit_law(sample, starts=1, init=[nd_law])[0].loss(run.n, run.d)

        values = _replicates(obs, sigma, replicates, rng, refit_nd)
        out.append(_prediction(run, "L(N, D)", nd_law.loss(run.n, run.d), values, confidence, sigma, source, c, reach))
    return out


def _replicates(obs: Observations, sigma: float, k: int, rng: np.random.Generator, refit) -> list[float]:
    """k predictions, each from the law refitted to the ladder with fresh noise, times the run's own noise."""
    values = []
    for _ in range(k):
        noisy = Observations(obs.n, obs.d, obs.loss * np.exp(rng.normal(0.0, sigma, len(obs))), obs.compute, obs.names)
        own = math.exp(rng.normal(0.0, sigma))
        try:
            values.append(refit(noisy) * own)
        except ConfigError:  # a replicate the optimiser cannot fit says nothing
            continue
    return [v for v in values if math.isfinite(v)]


def _prediction(run, name, loss, values, confidence, sigma, source, c, reach) -> ScaleUpPrediction:
    low = high = None
    if values:
        tail = 50.0 * (1.0 - confidence)
        low, high = (float(x) for x in np.percentile(values, [tail, 100.0 - tail]))
    return ScaleUpPrediction(run, name, float(loss), low, high, confidence, sigma, source, c, reach, len(values))
