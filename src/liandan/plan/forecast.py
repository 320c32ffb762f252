"""Forecast a run's final loss from its partial loss curve, knowing its whole learning-rate schedule.

The model is the learning-rate-annealing scaling law of Tissue et al. 2024 ("Scaling Law with Learning Rate
Annealing", arXiv:2408.11029):

    L(s) = L0 + A * S1(s)^(-alpha) - C * S2(s)

    S1(s) = sum_{i<=s} eta_i                                  forward area
    S2(s) = sum_{i<=s} m_i,  m_i = lam * m_{i-1} + (eta_{i-1} - eta_i)     annealing area

with eta the learning rate as a fraction of the peak and lam the momentum decay of the annealing effect
(0.999 in the paper). Unrolled, S2(s) = sum_{i<=s} sum_{k<=i} (eta_{k-1} - eta_k) lam^(i-k); the recursion
computes it in O(steps). The warmup's rise is not annealing: differences count from the first step at which
the learning rate stops rising.

Since the whole schedule is known from the run's config, S1 and S2 at the last step are known while the run
is still going. The law is fitted to the observed (step, loss) records past the warmup (robust least
squares on records averaged into bins) and evaluated at the last step.

What a partial curve cannot tell, and how it is filled in (each choice measured in docs/planning.md):

- C. Until 30% of the annealing area is behind the run, C comes from a prior alone (a fitted C would soak up
  curvature of other origins and extrapolate it), after that the data fit it under the prior. The prior is
  log-normal (width ln 2.5) and centres the final gain C * S2(end) on 0.4 * |dL/dS1|(end) * steps *
  (1 - eta(end)): annealing from the peak to the final rate gains what 40% of the run would gain at the
  forward rate of the end, scaled by the drop (the geometric mean over the backtests' finished runs).
- lam. The paper's 0.999 (a response over ~1000 steps) suits runs of 50,000 steps and more; in runs of a
  few hundred steps the loss answers a cooldown within tens of steps. The default is 1 - 1/tau with tau =
  steps / 50 between 10 and 1000; once 30% of the annealing area is behind the run, the data choose lam from
  DECAY_GRID by likelihood.
- alpha: a weak prior (centre 0.5, width ln 2.5) keeps fits on short stretches of curve from running off.

The interval: refits on block-bootstrapped residuals, with fit windows starting up to 30% later, lam drawn
by its likelihood and the priors' centres drawn from the priors, each forecast then scaled by the law's own
error, exp(N(0, 0.05 * ln(steps / observed steps))), calibrated on the backtests.

A schedule-free power law in steps, L = a + b * s^(-c), is fitted alongside for comparison.

Indexing: a loss logged at step s (metrics.jsonl, 1-based) was measured before the s-th optimizer update,
after s - 1 updates; `lr_fractions[j]` is the multiplier of update j + 1 (`lr_multiplier(j, ...)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from liandan.config import ConfigError, ScheduleSection, load_config
from liandan.run import RunDir
from liandan.spec.schedule import lr_multiplier

PAPER_DECAY = 0.999  # Tissue et al. 2024
DECAY_GRID = (0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999, 0.9995)  # the choices when the data pick the decay
PRIOR_RATIO = 0.4  # the annealing's gain against the forward slope at the end, see the module doc
PRIOR_WIDTH = math.log(2.5)  # one standard deviation of log(C), in e-folds
PRIOR_ALPHA = 0.5  # centre of the weak prior on alpha...
PRIOR_ALPHA_WIDTH = math.log(2.5)  # ...and its standard deviation in e-folds
MODEL_ERROR = 0.05  # relative error of the law per e-fold of extrapolation, from backtests (docs/planning.md)
SEEN_TO_FIT_C = 0.3  # share of the annealing area seen before the data, not the prior alone, set C and lam
MIN_POINTS = 8  # loss records in the fit window below which no forecast is made
MAX_BINS = 256  # longer curves are averaged into this many bins of consecutive records
_ROBUST_SCALE = 3.0  # soft-L1 loss: residuals beyond 3 noise sigmas count linearly


# ---------------------------------------------------------------------------------------------------------
# the schedule and its areas


def schedule_fractions(schedule: ScheduleSection, total_steps: int) -> np.ndarray:
    """The learning rate of every optimizer update of a run, as a fraction of the peak (length total_steps)."""
    return np.array([lr_multiplier(j, total_steps, schedule) for j in range(total_steps)], dtype=np.float64)


def annealing_areas(lr_fractions: Sequence[float], decay: float = PAPER_DECAY) -> tuple[np.ndarray, np.ndarray]:
    """(S1, S2), each of length len(lr_fractions) + 1, indexed by the number of updates done (S[0] = 0).

    S1[n] is the sum of the first n learning rates. S2[n] sums the annealing momentum m_i = decay * m_{i-1}
    + (eta_{i-1} - eta_i) over i <= n; differences within the warmup (the leading run of non-decreasing
    rates) are left out, later rises (a re-warmup) count negatively as in the paper.
    """
    eta = np.asarray(lr_fractions, dtype=np.float64)
    if eta.ndim != 1 or not len(eta):
        raise ValueError("lr_fractions must be a non-empty 1-D sequence")
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"decay = {decay} must lie in [0, 1]")
    drops = np.zeros_like(eta)
    drops[1:] = eta[:-1] - eta[1:]
    falling = np.flatnonzero(drops > 0)
    drops[: falling[0] if len(falling) else len(eta)] = 0.0  # the warmup's rise is not annealing
    from scipy.signal import lfilter

    momentum = lfilter([1.0], [1.0, -decay], drops)  # m_i = decay * m_{i-1} + drop_i, in C
    s1 = np.concatenate([[0.0], np.cumsum(eta)])
    s2 = np.concatenate([[0.0], np.cumsum(momentum)])
    return s1, s2


# ---------------------------------------------------------------------------------------------------------
# fits


@dataclass(frozen=True)
class AnnealingFit:
    """L(s) = L0 + A * S1^-alpha - C * S2, fitted; S1 and S2 of the schedule it was fitted with."""

    L0: float
    A: float
    alpha: float
    C: float
    decay: float
    noise: float  # standard deviation of one loss record around the curve (robust estimate)
    rmse: float  # root mean square residual of the fitted records
    points: int  # loss records in the fit window
    s1: np.ndarray = field(repr=False)
    s2: np.ndarray = field(repr=False)

    def at(self, updates: int | np.ndarray) -> np.ndarray | float:
        """The fitted loss after `updates` optimizer updates (the loss logged at step updates + 1)."""
        n = np.asarray(updates)
        out = _law((self.L0, self.A, self.alpha, self.C), self.s1[n], self.s2[n])
        return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class PowerLawFit:
    """L(s) = a + b * s^-c in optimizer updates, blind to the schedule."""

    a: float
    b: float
    c: float

    def at(self, updates: int | np.ndarray) -> np.ndarray | float:
        n = np.maximum(np.asarray(updates, dtype=np.float64), 1.0)
        out = self.a + self.b * n ** (-self.c)
        return float(out) if out.ndim == 0 else out


@dataclass(frozen=True)
class Forecast:
    final_loss: float  # expected training loss at the last step, annealing law
    low: float  # interval at `confidence`
    high: float
    confidence: float
    observed_fraction: float  # last observed step / total steps
    observed_step: int
    total_steps: int
    current_loss: float  # the fitted curve at the last observed step
    annealing_seen: float  # share of the final annealing area S2 already behind the run (1 for constant LR)
    power_law: float  # the schedule-free forecast, with its interval
    power_low: float
    power_high: float
    fit: AnnealingFit = field(repr=False)
    power_fit: PowerLawFit = field(repr=False)

    def to_dict(self) -> dict[str, float | int]:
        keys = ("final_loss", "low", "high", "confidence", "observed_fraction", "observed_step", "total_steps")
        keys += ("current_loss", "annealing_seen", "power_law", "power_low", "power_high")
        out: dict[str, float | int] = {k: getattr(self, k) for k in keys}
        out.update(L0=self.fit.L0, A=self.fit.A, alpha=self.fit.alpha, C=self.fit.C, decay=self.fit.decay)
        return out


def _law(theta, s1, s2):
    L0, A, alpha, C = theta
    with np.errstate(divide="ignore", over="ignore"):
        return L0 + A * np.power(np.maximum(s1, 1e-12), -alpha) - C * s2


@dataclass
class _Data:
    """The fit window, averaged into at most MAX_BINS bins of consecutive records."""

    updates: np.ndarray  # per record
    loss: np.ndarray
    bins: np.ndarray  # bin index per record
    y: np.ndarray  # per bin: mean loss, record count, mean updates
    count: np.ndarray
    x: np.ndarray
    noise: float

    @classmethod
    def make(cls, updates: np.ndarray, loss: np.ndarray, noise: float | None = None) -> _Data:
        n = len(loss)
        bins = np.minimum((np.arange(n) * min(MAX_BINS, n)) // n, MAX_BINS - 1)
        count = np.bincount(bins).astype(np.float64)
        mean = lambda v: np.bincount(bins, weights=v) / count
        if noise is None:
            noise = _noise(loss)
        return cls(updates, loss, bins, mean(loss), count, mean(updates.astype(np.float64)), noise)

    def bin_mean(self, per_record: np.ndarray) -> np.ndarray:
        return np.bincount(self.bins, weights=per_record, minlength=len(self.count)) / self.count


def _noise(loss: np.ndarray) -> float:
    """Robust standard deviation of one record around a smooth curve, from successive differences."""
    if len(loss) < 3:
        return max(float(np.std(loss)), 1e-6)
    mad = float(np.median(np.abs(np.diff(loss) - np.median(np.diff(loss)))))
    return max(1.4826 * mad / math.sqrt(2.0), 1e-4 * float(np.median(np.abs(loss))), 1e-8)


def fit_annealing_law(
    steps: Sequence[int],
    losses: Sequence[float],
    lr_fractions: Sequence[float],
    decay: float | None = None,
    *,
    total_steps: int | None = None,
    skip: int | None = None,
) -> AnnealingFit:
    """Fit L0, A, alpha, C to logged (step, loss) records of a run whose updates use `lr_fractions`.

    `lr_fractions` is the whole schedule (one multiplier per update, any scale, e.g. `schedule_fractions`);
    the run is `total_steps` long (default len(lr_fractions)). `decay` (lambda) None: chosen by likelihood
    from DECAY_GRID once 30% of the annealing area has been seen, else 1 - 1/clip(steps / 50, 10, 1000).
    Records within the warmup are left out (`skip`: updates before the first fitted record; default the end
    of the warmup, at most half the observed records). Robust (soft-L1) least squares on the records
    averaged into at most MAX_BINS bins, with the weak priors on C and alpha described in the module doc.
    """
    curve = _Curve.make(steps, losses, lr_fractions, total_steps)
    data = curve.window(skip)
    (decay, theta), _ = _choose(curve, data, decay)[0]
    return curve.annealing_fit(theta, data, decay)


def _choose(curve: _Curve, data: _Data, decay: float | None) -> list[tuple[tuple[float, np.ndarray], float]]:
    """[((decay, theta), weight)]: one fixed decay, or the profile over DECAY_GRID with likelihood weights,
    best first."""
    if decay is not None or not curve.has_annealing or curve.annealing_seen(int(data.updates[-1])) < SEEN_TO_FIT_C:
        decay = curve.default_decay() if decay is None else float(decay)
        return [((decay, curve.fit(data, decay)[0]), 1.0)]
    profile = curve.profile_decay(data)
    best = min(cost for _, _, cost in profile)
    weighted = sorted((((d, th), math.exp(best - cost)) for d, th, cost in profile), key=lambda item: -item[1])
    total = sum(w for _, w in weighted)
    return [(item, w / total) for item, w in weighted]


def fit_power_law(steps: Sequence[int], losses: Sequence[float], skip: int = 0) -> PowerLawFit:
    """Fit L = a + b * s^-c (s: updates done) to the records after `skip` updates."""
    updates, loss = _records(steps, losses)
    keep = updates >= max(skip, 1)
    if keep.sum() < MIN_POINTS:
        raise ConfigError(f"only {int(keep.sum())} loss records to fit; a forecast needs at least {MIN_POINTS}")
    data = _Data.make(updates[keep], loss[keep])
    return PowerLawFit(*_fit_power(data))


def _records(steps: Sequence[int], losses: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    steps_a = np.asarray(steps, dtype=np.int64)
    loss_a = np.asarray(losses, dtype=np.float64)
    if steps_a.shape != loss_a.shape or steps_a.ndim != 1:
        raise ValueError("steps and losses must be 1-D sequences of the same length")
    keep = np.isfinite(loss_a) & (steps_a >= 1)
    steps_a, loss_a = steps_a[keep], loss_a[keep]
    order = np.argsort(steps_a, kind="stable")
    return steps_a[order] - 1, loss_a[order]  # updates done when the loss was measured


class _Curve:
    """One run's observed records and its schedule; fits the law on a window of the records."""

    def __init__(self, updates: np.ndarray, loss: np.ndarray, eta: np.ndarray):
        self.updates, self.loss, self.eta = updates, loss, eta
        self.total_steps = len(eta)
        self.end = self.total_steps - 1  # updates done before the last logged loss
        self.warmup_end = int(np.argmax(eta)) + 1
        s1, plain = annealing_areas(eta, 1.0)
        self.s1 = s1
        self.s1_end = float(s1[self.end])
        self.benefit_area = float(plain[self.end])  # the annealing area without decay
        self.has_annealing = self.benefit_area > 1e-9 * max(1.0, self.s1_end)
        self._s2: dict[float, np.ndarray] = {}

    @classmethod
    def make(cls, steps, losses, lr_fractions, total_steps) -> _Curve:
        eta = np.asarray(lr_fractions, dtype=np.float64)
        total_steps = int(total_steps or len(eta))
        if total_steps < 2 or len(eta) < total_steps:
            raise ValueError(f"lr_fractions holds {len(eta)} rates; the run has {total_steps} steps")
        eta = eta[:total_steps]
        if not np.all(np.isfinite(eta)) or eta.max() <= 0 or eta.min() < 0:
            raise ValueError("lr_fractions must be finite, non-negative and not all zero")
        updates, loss = _records(steps, losses)
        if len(updates) and updates[-1] >= total_steps:
            raise ValueError(f"a loss is logged at step {updates[-1] + 1}, past the run's {total_steps} steps")
        return cls(updates, loss, eta / eta.max())

    def s2(self, decay: float) -> np.ndarray:
        if decay not in self._s2:
            self._s2[decay] = annealing_areas(self.eta, decay)[1]
        return self._s2[decay]

    @property
    def observed(self) -> int:
        return int(self.updates[-1]) + 1 if len(self.updates) else 0  # the last logged step

    def annealing_seen(self, updates: int) -> float:
        """Share of the final annealing area (without decay) behind the run after `updates` updates."""
        if not self.has_annealing:
            return 1.0
        return float(min(1.0, max(0.0, self.s2(1.0)[updates] / self.benefit_area)))

    def default_decay(self) -> float:
        """1 - 1/tau with tau = total steps / 50, between 10 and 1000 steps: 0.999 (the paper's) for runs of
        50,000 steps or more, 0.9 for runs of 500 steps or fewer, where the loss answers a cooldown within
        tens of steps."""
        tau = min(1000.0, max(10.0, self.total_steps / 50.0))
        return 1.0 - 1.0 / tau

    def window(self, skip: int | None = None) -> _Data:
        """Records after the warmup (at most half of them dropped), at least one update in."""
        if skip is None:
            skip = self.warmup_end
            if len(self.updates):
                skip = min(skip, int(np.median(self.updates)))
        keep = self.updates >= max(1, skip)
        if keep.sum() < MIN_POINTS:
            raise ConfigError(
                f"only {int(keep.sum())} loss records after the warmup; a forecast needs at least {MIN_POINTS}"
            )
        return _Data.make(self.updates[keep], self.loss[keep])

    # -- the fit -------------------------------------------------------------------------------------------
    def prior_c(self, A: float, alpha: float, decay: float) -> float:
        """C such that C * S2(end) = PRIOR_RATIO * |dL/dS1|(end) * total steps * (1 - eta(end))."""
        slope = alpha * A * self.s1_end ** (-alpha - 1.0)
        drop = 1.0 - float(self.eta[-1])
        return PRIOR_RATIO * slope * self.total_steps * drop / max(float(self.s2(decay)[self.end]), 1e-300)

    def initial(self, data: _Data, decay: float) -> np.ndarray:
        """Best (L0, A, C) by bounded linear least squares on a grid of alpha."""
        from scipy.optimize import lsq_linear

        s1, s2 = data.bin_mean(self.s1[data.updates]), data.bin_mean(self.s2(decay)[data.updates])
        w = np.sqrt(data.count)
        top = float(data.y.max())
        best = None
        for alpha in np.geomspace(0.05, 2.0, 30):
            cols = [np.ones_like(s1), s1 ** (-alpha)] + ([-s2] if self.has_annealing else [])
            X = np.stack(cols, axis=1) * w[:, None]
            lo, hi = [0.0] * len(cols), [top] + [np.inf] * (len(cols) - 1)
            r = lsq_linear(X, data.y * w, bounds=(lo, hi))
            if best is None or r.cost < best[0]:
                best = (r.cost, alpha, r.x)
        _, alpha, x = best
        A = max(float(x[1]), 1e-8)
        C = self.prior_c(A, alpha, decay) if self.has_annealing else 1.0
        return np.array([float(x[0]), math.log(A), math.log(alpha), math.log(C)])

    def fit(
        self, data: _Data, decay: float, start: np.ndarray | None = None, shift: tuple[float, float] = (0.0, 0.0)
    ) -> tuple[np.ndarray, float]:
        """(theta = (L0, log A, log alpha, log C), cost). `shift` moves the centres of the priors on log C
        and log alpha (in their standard deviations)."""
        from scipy.optimize import least_squares

        s1 = data.bin_mean(self.s1[data.updates])
        s2 = data.bin_mean(self.s2(decay)[data.updates])
        scale = np.sqrt(data.count) / data.noise
        annealing = self.has_annealing
        alpha_centre = math.log(PRIOR_ALPHA) + shift[1] * PRIOR_ALPHA_WIDTH

        free_c = annealing and self.annealing_seen(int(data.updates[-1])) >= SEEN_TO_FIT_C

        def residuals(theta):
            L0, logA, logalpha, logC = theta
            A, alpha = math.exp(logA), math.exp(logalpha)
            centre = math.log(self.prior_c(A, alpha, decay)) + shift[0] * PRIOR_WIDTH if annealing else 0.0
            C = math.exp(logC if free_c else centre) if annealing else 0.0
            r = (_law((L0, A, alpha, C), s1, s2) - data.y) * scale
            # the prior on C; without data on C, log C follows its centre (or stays put where C is unused)
            c_prior = (logC - centre) / (PRIOR_WIDTH if free_c else 1.0)
            return np.append(r, [c_prior, (logalpha - alpha_centre) / PRIOR_ALPHA_WIDTH])

        x0 = self.initial(data, decay) if start is None else start.copy()
        top = float(data.y.max()) + 1e-9
        lo = np.array([0.0, -30.0, math.log(0.02), -80.0])
        hi = np.array([top, 30.0, math.log(3.0), 30.0])
        x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
        r = least_squares(
            residuals, x0, bounds=(lo, hi), loss=_soft_l1_but_priors, f_scale=_ROBUST_SCALE, x_scale="jac"
        )
        return r.x, float(r.cost)

    def params(self, theta: np.ndarray) -> tuple[float, float, float, float]:
        L0, logA, logalpha, logC = (float(v) for v in theta)
        return L0, math.exp(logA), math.exp(logalpha), (math.exp(logC) if self.has_annealing else 0.0)

    def annealing_fit(self, theta: np.ndarray, data: _Data, decay: float) -> AnnealingFit:
        params = self.params(theta)
        s2 = self.s2(decay)
        resid = _law(params, self.s1[data.updates], s2[data.updates]) - data.loss
        rmse = float(np.sqrt(np.mean(resid**2)))
        return AnnealingFit(*params, decay, data.noise, rmse, len(data.loss), self.s1, s2)

    def predict_end(self, theta: np.ndarray, decay: float) -> float:
        return float(_law(self.params(theta), self.s1_end, self.s2(decay)[self.end]))

    def profile_decay(self, data: _Data) -> list[tuple[float, np.ndarray, float]]:
        """(decay, theta, cost) over DECAY_GRID, for choosing the decay from an observed annealing."""
        return [(d, *self.fit(data, d)) for d in DECAY_GRID if 1.0 / (1.0 - d) <= max(10.0, self.total_steps)]


def _soft_l1_but_priors(z: np.ndarray) -> np.ndarray:
    """least_squares' soft-L1 loss on the records, plain squares on the last two residuals (the priors), so
    that an outlying record counts less but the priors never weaken."""
    rho = np.empty((3, z.size))
    root = np.sqrt(1.0 + z)
    rho[0] = 2.0 * (root - 1.0)
    rho[1] = 1.0 / root
    rho[2] = -0.5 / root**3
    rho[0, -2:], rho[1, -2:], rho[2, -2:] = z[-2:], 1.0, 0.0
    return rho


def _fit_power(data: _Data, start: np.ndarray | None = None) -> np.ndarray:
    from scipy.optimize import least_squares, lsq_linear

    n = np.maximum(data.x, 1.0)
    scale = np.sqrt(data.count) / data.noise
    top = float(data.y.max()) + 1e-9
    if start is None:
        best = None
        for c in np.geomspace(0.02, 3.0, 40):
            X = np.stack([np.ones_like(n), n ** (-c)], axis=1) * scale[:, None]
            r = lsq_linear(X, data.y * scale, bounds=([0.0, 0.0], [top, np.inf]))
            if best is None or r.cost < best[0]:
                best = (r.cost, np.array([r.x[0], r.x[1], c]))
        start = best[1]
    lo, hi = np.array([0.0, 0.0, 0.02]), np.array([top, np.inf, 3.0])
    start = np.clip(start, lo, np.where(np.isfinite(hi), hi - 1e-12, hi))

    def residuals(p):
        return (p[0] + p[1] * n ** (-p[2]) - data.y) * scale

    return least_squares(residuals, start, bounds=(lo, hi), loss="soft_l1", f_scale=_ROBUST_SCALE, x_scale="jac").x


# ---------------------------------------------------------------------------------------------------------
# forecasts


def forecast_final_loss(
    steps: Sequence[int],
    losses: Sequence[float],
    lr_fractions: Sequence[float],
    total_steps: int | None = None,
    *,
    decay: float | None = None,
    confidence: float = 0.8,
    samples: int = 48,
    model_error: float = MODEL_ERROR,
    seed: int = 0,
) -> Forecast:
    """Forecast the training loss at the last step from the records logged so far; no run directory needed.

    steps, losses: the logged records (1-based steps, as in metrics.jsonl); non-finite losses are ignored.
    lr_fractions: the learning rate of every update of the whole run (any scale; divided by its peak).
    total_steps: the run's length (default len(lr_fractions)). decay: lambda, None to choose (see
    `fit_annealing_law`). `samples` bootstrap refits give the interval at `confidence`; each is also
    scaled by exp(N(0, model_error * ln(total steps / observed steps))), the law's own error, which grows
    with the length of the extrapolation (`model_error` from backtests of small runs, see docs/planning.md).
    Raises ConfigError when too few records lie past the warmup.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence = {confidence} must lie in (0, 1)")
    curve = _Curve.make(steps, losses, lr_fractions, total_steps)
    data = curve.window()
    choices = _choose(curve, data, decay)
    best_decay, theta = choices[0][0]
    fit = curve.annealing_fit(theta, data, best_decay)
    point = curve.predict_end(theta, best_decay)
    power = _fit_power(data)
    power_fit = PowerLawFit(*map(float, power))
    power_point = float(power_fit.at(curve.end))

    rng = np.random.default_rng(seed)
    observed, first = int(data.updates[-1]), int(data.updates[0])
    fitted = fit.at(data.updates)
    resid = data.loss - fitted
    weights = np.array([w for _, w in choices])
    spread = model_error * math.log(curve.total_steps / max(1, curve.observed))
    draws, power_draws = [], []
    for _ in range(samples):
        # the decay drawn by its likelihood, a fit window starting up to 30% later, residuals resampled in
        # blocks, the priors' centres drawn from the priors
        d, th0 = choices[rng.choice(len(choices), p=weights)][0]
        start_at = first + int(rng.uniform(0.0, 0.3) * (observed - first))
        keep = data.updates >= start_at
        if keep.sum() < MIN_POINTS:
            keep = np.ones_like(keep)
        boot = fitted[keep] + _block_resample(resid[keep], rng)
        sample = _Data.make(data.updates[keep], boot, data.noise)
        th, _ = curve.fit(sample, d, start=th0, shift=(rng.normal(), rng.normal()))
        law_error = math.exp(rng.normal() * spread)
        draws.append(curve.predict_end(th, d) * law_error)
        power_draws.append(float(PowerLawFit(*_fit_power(sample, start=power)).at(curve.end)) * law_error)
    tail = (1.0 - confidence) / 2.0
    low, high = np.quantile(draws, [tail, 1.0 - tail]) if draws else (point, point)
    plow, phigh = np.quantile(power_draws, [tail, 1.0 - tail]) if power_draws else (power_point, power_point)
    return Forecast(
        final_loss=point,
        low=float(min(low, point)),
        high=float(max(high, point)),
        confidence=confidence,
        observed_fraction=min(1.0, curve.observed / curve.total_steps),
        observed_step=curve.observed,
        total_steps=curve.total_steps,
        current_loss=float(fit.at(observed)),
        annealing_seen=curve.annealing_seen(observed),
        power_law=power_point,
        power_low=float(min(plow, power_point)),
        power_high=float(max(phigh, power_point)),
        fit=fit,
        power_fit=power_fit,
    )


def _block_resample(resid: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Moving-block bootstrap: consecutive residuals keep their correlation."""
    n = len(resid)
    block = max(1, round(n ** (1 / 3)))
    starts = rng.integers(0, n - block + 1, size=-(-n // block))
    return np.concatenate([resid[s : s + block] for s in starts])[:n]


# ---------------------------------------------------------------------------------------------------------
# runs on disk


@dataclass(frozen=True)
class RunCurve:
    run_dir: Path
    steps: np.ndarray
    losses: np.ndarray
    lr_fractions: np.ndarray
    total_steps: int
    schedule: str
    diverged_at: int | None = None
    """The first logged step whose loss was not finite (NaN, inf, or null as the run writes it), if any."""

    @property
    def finished(self) -> bool:
        return len(self.steps) > 0 and int(self.steps[-1]) >= self.total_steps


def read_run(run_dir: str | Path) -> RunCurve:
    """A run directory's logged training losses and its whole schedule (from its resolved config.toml)."""
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
    return RunCurve(
        run_dir,
        np.array(steps, dtype=np.int64),
        np.array(losses, dtype=np.float64),
        schedule_fractions(cfg.schedule, total),
        total,
        cfg.schedule.kind,
        diverged_at,
    )


def forecast_run(run_dir: str | Path, upto_step: int | None = None, **kwargs) -> Forecast:
    """Forecast the final loss of the run in `run_dir` from its records up to `upto_step` (default: all)."""
    run = read_run(run_dir)
    upto = upto_step if upto_step is not None else run.total_steps
    if run.diverged_at is not None and run.diverged_at <= upto:
        raise ConfigError(
            f"{run.run_dir}: the loss is not finite from step {run.diverged_at} on; a forecast from the finite "
            f"steps before it would hide the divergence (--upto {run.diverged_at - 1} forecasts from before it)"
        )
    keep = run.steps <= upto
    if not keep.any():
        raise ConfigError(f"{run.run_dir} has no loss records yet" + (f" up to step {upto_step}" if upto_step else ""))
    try:
        return forecast_final_loss(run.steps[keep], run.losses[keep], run.lr_fractions, run.total_steps, **kwargs)
    except ConfigError as err:
        raise ConfigError(f"{run.run_dir}: {err}") from None


def measured_final_loss(steps: Sequence[int], losses: Sequence[float], share: float = 0.1) -> float:
    """The loss at the last record with the batch noise averaged out: a straight line fitted to the last
    `share` of the records (at least 8), evaluated at the last step."""
    s = np.asarray(steps, dtype=np.float64)
    y = np.asarray(losses, dtype=np.float64)
    keep = np.isfinite(y)
    s, y = s[keep], y[keep]
    if not len(y):
        raise ConfigError("no finite loss records")
    k = min(len(y), max(8, round(share * len(y))))
    s, y = s[-k:], y[-k:]
    if k < 3 or np.ptp(s) == 0:
        return float(np.mean(y))
    slope, intercept = np.polyfit(s, y, 1)
    return float(slope * s[-1] + intercept)


@dataclass(frozen=True)
class BacktestRow:
    run: str
    schedule: str
    fraction: float  # share of the steps the forecast saw
    upto_step: int
    total_steps: int
    actual: float  # measured final loss
    forecast: Forecast | None  # None when too few records were seen
    note: str = ""

    @property
    def error(self) -> float | None:
        """Relative error of the annealing-law forecast: (forecast - actual) / actual."""
        return None if self.forecast is None else (self.forecast.final_loss - self.actual) / self.actual

    @property
    def power_error(self) -> float | None:
        return None if self.forecast is None else (self.forecast.power_law - self.actual) / self.actual

    @property
    def covered(self) -> bool | None:
        f = self.forecast
        return None if f is None else f.low <= self.actual <= f.high


def backtest(
    run_dirs: Sequence[str | Path], fractions: Sequence[float] = (0.1, 0.2, 0.5), **kwargs
) -> list[BacktestRow]:
    """Replay finished runs: forecast each from the first `fractions` of its steps, against its measured
    final loss (`measured_final_loss`)."""
    rows = []
    for run_dir in run_dirs:
        run = read_run(run_dir)
        if run.diverged_at is not None:
            raise ConfigError(
                f"{run.run_dir}: the loss is not finite from step {run.diverged_at} on; nothing to replay"
            )
        if not run.finished:
            last = int(run.steps[-1]) if len(run.steps) else 0
            raise ConfigError(
                f"{run.run_dir} is not finished (step {last} of {run.total_steps}); backtests replay finished runs"
            )
        actual = measured_final_loss(run.steps, run.losses)
        for fraction in fractions:
            if not 0.0 < fraction <= 1.0:
                raise ConfigError(f"backtest fraction {fraction} must lie in (0, 1]")
            upto = max(1, round(fraction * run.total_steps))
            keep = run.steps <= upto
            forecast, note = None, ""
            try:
                forecast = forecast_final_loss(
                    run.steps[keep], run.losses[keep], run.lr_fractions, run.total_steps, **kwargs
                )
            except ConfigError as err:
                note = str(err)
            rows.append(
                BacktestRow(str(run.run_dir), run.schedule, fraction, upto, run.total_steps, actual, forecast, note)
            )
    return rows
