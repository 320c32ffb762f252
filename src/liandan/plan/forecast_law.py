"""The loss curve of a run under a known learning-rate schedule, and its fit with priors from other runs.

The law is the learning-rate-annealing scaling law of Tissue et al. 2024 ("Scaling Law with Learning Rate
Annealing", arXiv:2408.11029), its annealing term written as a response to the drops of the rate:

    L(n) = L0 + A * S1(n)^(-alpha) - D * R(n)

    S1(n) = sum_{i<=n} eta_i                                   forward area
    R(n)  = (1 - lam) * S2(n),  S2(n) = sum_{i<=n} m_i,  m_i = lam * m_{i-1} + (eta_{i-1} - eta_i)

with eta the learning rate as a fraction of the peak and n the optimizer updates done. R is the drop of the
rate so far, each drop felt in full after about tau = 1 / (1 - lam) updates, so D is the loss an anneal from
the peak to zero gains once answered: the paper's C is D * (1 - lam). Written so, D and tau / steps are
comparable across runs of different lengths, which is what lets other runs teach them (`LawPriors`).

Indexing: a loss logged at step s (metrics.jsonl, 1-based) was measured before the s-th optimizer update,
after s - 1 updates; `lr_fractions[j]` is the multiplier of update j + 1 (`lr_multiplier(j, ...)`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from liandan.common.schedule import lr_multiplier
from liandan.config import ConfigError, ScheduleSection

MIN_POINTS = 8  # loss records in the fit window below which no forecast is made
MIN_PAST_WARMUP = 0.01  # the share of the steps after the warmup a forecast needs behind the run
MAX_BINS = 256  # longer curves are averaged into this many bins of consecutive records
ROBUST_SCALE = 3.0  # soft-L1 loss: residuals beyond 3 noise sigmas count linearly
SPIKE_SIGMAS = 6.0  # a record this many noise sigmas above its neighbours' median is a spike, left out
TAU_GRID = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32)  # tau / steps, when a seen cooldown picks it


def schedule_fractions(schedule: ScheduleSection, total_steps: int) -> np.ndarray:
    """The learning rate of every optimizer update of a run, as a fraction of the peak (length total_steps)."""
    return np.array([lr_multiplier(j, total_steps, schedule) for j in range(total_steps)], dtype=np.float64)


def annealing_areas(lr_fractions: Sequence[float], decay: float = 0.999) -> tuple[np.ndarray, np.ndarray]:
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


def clean_records(steps: Sequence[int], losses: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    """(updates done, loss) of the finite records, by step. A step logged twice (a run resumed from a
    checkpoint repeats the steps since it) keeps its last record: the resumed run's, which the rest of the
    curve continues from."""
    steps_a = np.asarray(steps, dtype=np.int64)
    loss_a = np.asarray(losses, dtype=np.float64)
    if steps_a.shape != loss_a.shape or steps_a.ndim != 1:
        raise ValueError("steps and losses must be 1-D sequences of the same length")
    keep = np.isfinite(loss_a) & (steps_a >= 1)
    steps_a, loss_a = steps_a[keep], loss_a[keep]
    last = len(steps_a) - 1 - np.unique(steps_a[::-1], return_index=True)[1]  # last occurrence of each step
    return steps_a[last] - 1, loss_a[last]


def record_noise(loss: np.ndarray) -> float:
    """Robust standard deviation of one record around a smooth curve, from successive differences."""
    if len(loss) < 3:
        return max(float(np.std(loss)), 1e-6)
    diff = np.diff(loss)
    mad = float(np.median(np.abs(diff - np.median(diff))))
    return max(1.4826 * mad / math.sqrt(2.0), 1e-4 * float(np.median(np.abs(loss))), 1e-8)


def spikes(loss: np.ndarray, noise: float) -> np.ndarray:
    """Records far above the median of the records before them (a loss spike), and its recovery."""
    n = len(loss)
    if n < 9:
        return np.zeros(n, dtype=bool)
    half = max(8, n // 40)
    padded = np.pad(loss, (half, 0), mode="edge")
    before_each = np.median(np.lib.stride_tricks.sliding_window_view(padded[:-1], half), axis=1)
    out = loss - before_each > SPIKE_SIGMAS * noise
    # a large spike (a learning-rate burst, a bad batch run) leaves a recovery that can last hundreds of
    # steps, steep like the start of training: left out too, until the loss is back to where it was before
    i = 0
    while i < n:
        if not out[i]:
            i += 1
            continue
        before = float(np.median(loss[max(0, i - 2 * half) : i])) if i else float(loss[0])
        j = i
        while j < n and np.median(loss[j : j + 5]) > before + 2.0 * noise:
            j += 1
        out[i:j] = True
        i = max(j, i + 1)
    return out


@dataclass
class Window:
    """The records a law is fitted to, averaged into at most MAX_BINS bins of consecutive records."""

    updates: np.ndarray  # per record
    loss: np.ndarray
    bins: np.ndarray  # bin index per record
    y: np.ndarray  # per bin: mean loss, record count
    count: np.ndarray
    noise: float

    @classmethod
    def make(cls, updates: np.ndarray, loss: np.ndarray, noise: float | None = None, masked: bool = False) -> Window:
        """`masked`: the spikes are already left out (by the caller, over the whole curve)."""
        noise = record_noise(loss) if noise is None else noise
        if not masked:
            keep = ~spikes(loss, noise)
            updates, loss = updates[keep], loss[keep]
        n = len(loss)
        bins = np.minimum((np.arange(n) * min(MAX_BINS, n)) // max(n, 1), MAX_BINS - 1)
        count = np.bincount(bins).astype(np.float64)
        return cls(updates, loss, bins, np.bincount(bins, weights=loss) / count, count, noise)

    def bin_mean(self, per_record: np.ndarray) -> np.ndarray:
        return np.bincount(self.bins, weights=per_record, minlength=len(self.count)) / self.count


@dataclass(frozen=True)
class LawPriors:
    """What other runs teach about a curve's shape: log-normal priors on alpha, on D relative to the run's
    loss scale (D / the loss just after the warmup) and on tau / steps. `evidence` caps the records' weight:
    curves are not exactly the law, and a prefix fitted as if they were extrapolates its own bumps."""

    log_alpha: float = math.log(0.5)
    alpha_width: float = math.log(2.5)
    log_gain: float = math.log(0.1)
    gain_width: float = math.log(2.5)
    log_tau: float = math.log(0.02)
    tau_width: float = math.log(3.0)
    evidence: float = 64.0
    skip: float = 0.0  # share of the observed steps left out at the start (besides the warmup): early noise
    runs: int = 0  # the runs they were learned from (0: the defaults)

    def tau_ratio(self) -> float:
        return math.exp(self.log_tau)


@dataclass(frozen=True)
class LawFit:
    """L(n) = L0 + A * S1^-alpha - D * R(n), fitted; S1 and R of the schedule it was fitted with."""

    L0: float
    A: float
    alpha: float
    D: float
    decay: float  # lam = 1 - 1 / tau
    noise: float  # standard deviation of one loss record around the curve (robust estimate)
    rmse: float  # root mean square residual of the fitted records
    points: int  # loss records in the fit window
    s1: np.ndarray = field(repr=False)
    r: np.ndarray = field(repr=False)

    @property
    def C(self) -> float:
        """The paper's annealing coefficient, against S2 = R / (1 - lam)."""
        return self.D * (1.0 - self.decay)

    def at(self, updates: int | np.ndarray) -> np.ndarray | float:
        """The fitted loss after `updates` optimizer updates (the loss logged at step updates + 1)."""
        n = np.asarray(updates)
        out = law((self.L0, self.A, self.alpha, self.D), self.s1[n], self.r[n])
        return float(out) if out.ndim == 0 else out


def law(theta, s1, r):
    L0, A, alpha, D = theta
    with np.errstate(divide="ignore", over="ignore"):
        return L0 + A * np.power(np.maximum(s1, 1e-12), -alpha) - D * r


class Curve:
    """One run's observed records and its whole schedule; fits the law to them under `LawPriors`."""

    def __init__(self, steps, losses, lr_fractions, total_steps: int | None = None):
        eta = np.asarray(lr_fractions, dtype=np.float64)
        total_steps = int(total_steps or len(eta))
        if total_steps < 2 or len(eta) < total_steps:
            raise ValueError(f"lr_fractions holds {len(eta)} rates; the run has {total_steps} steps")
        eta = eta[:total_steps]
        if not np.all(np.isfinite(eta)) or eta.max() <= 0 or eta.min() < 0:
            raise ValueError("lr_fractions must be finite, non-negative and not all zero")
        self.updates, self.loss = clean_records(steps, losses)
        self.spiky = spikes(self.loss, record_noise(self.loss)) if len(self.loss) else np.zeros(0, dtype=bool)
        if len(self.updates) and self.updates[-1] >= total_steps:
            raise ValueError(f"a loss is logged at step {self.updates[-1] + 1}, past the run's {total_steps} steps")
        self.eta = eta / eta.max()
        self.total_steps = total_steps
        self.end = total_steps - 1  # updates done before the last logged loss
        self.warmup_end = int(np.argmax(self.eta)) + 1
        self.s1, self.plain = annealing_areas(self.eta, 1.0)
        self.benefit_area = float(self.plain[self.end])
        self.has_annealing = self.benefit_area > 1e-9 * max(1.0, float(self.s1[self.end]))
        self._r: dict[float, np.ndarray] = {}

    @property
    def observed(self) -> int:
        return int(self.updates[-1]) + 1 if len(self.updates) else 0  # the last logged step

    def response(self, tau: float) -> np.ndarray:
        """R(n) for a response time of tau updates."""
        key = round(float(tau), 6)
        if key not in self._r:
            decay = 1.0 - 1.0 / max(key, 1.0)
            self._r[key] = annealing_areas(self.eta, decay)[1] * (1.0 - decay)
        return self._r[key]

    def annealing_seen(self, updates: int) -> float:
        """Share of the final annealing area (without decay) behind the run after `updates` updates."""
        if not self.has_annealing:
            return 1.0
        return float(min(1.0, max(0.0, self.plain[min(updates, self.end)] / self.benefit_area)))

    def window(self, upto: int | None = None, skip_share: float = 0.0) -> Window:
        """Records after the warmup and after `skip_share` of the observed steps (at most half of the records
        dropped) up to `upto` updates, at least one in."""
        keep = np.ones(len(self.updates), dtype=bool) if upto is None else self.updates <= upto
        updates, loss = self.updates[keep], self.loss[keep]
        skip = max(self.warmup_end, round(skip_share * (int(updates[-1]) + 1 if len(updates) else 0)))
        if len(updates):
            skip = min(skip, int(np.median(updates)))
        inside = updates >= max(1, skip)
        if inside.sum() < MIN_POINTS:
            raise self.too_short(skip_share, records_only=True)
        noise = record_noise(loss[inside])
        inside &= ~self.spiky[keep]
        if inside.sum() < MIN_POINTS:
            raise ConfigError(f"only {int(inside.sum())} loss records outside spikes; a forecast needs {MIN_POINTS}")
        return Window.make(updates[inside], loss[inside], noise, masked=True)

    def check_length(self, skip_share: float = 0.0) -> None:
        """A one-line ConfigError unless the curve is long enough to forecast from: MIN_POINTS records in the
        window (`window`'s rule) and MIN_PAST_WARMUP of the steps after the warmup behind the run, as a few
        records of a long run say little of its end."""
        if not self._long_enough(self.updates, skip_share):
            raise self.too_short(skip_share)

    def _long_enough(self, updates: np.ndarray, skip_share: float, records_only: bool = False) -> bool:
        if not len(updates):
            return False
        last = int(updates[-1]) + 1
        skip = min(max(self.warmup_end, round(skip_share * last)), int(np.median(updates)))
        if (updates >= max(1, skip)).sum() < MIN_POINTS:
            return False
        return records_only or last >= self.warmup_end + math.ceil(MIN_PAST_WARMUP * self.after_warmup)

    @property
    def after_warmup(self) -> int:
        return max(1, self.total_steps - self.warmup_end)

    def too_short(self, skip_share: float, records_only: bool = False) -> ConfigError:
        """The refusal of a curve too short, saying how many more steps, logged as often as so far, would do."""
        updates = self.updates
        spacing = max(1, int(np.median(np.diff(updates)))) if len(updates) > 1 else 1
        last = int(updates[-1]) if len(updates) else -1
        more = 0
        while last + 1 + more * spacing < self.total_steps:
            more += 1
            grown = np.append(updates, last + spacing * np.arange(1, more + 1))
            if self._long_enough(grown, skip_share, records_only):
                break
        until = last + 1 + more * spacing
        past = int((updates >= self.warmup_end).sum())
        share = max(0, last + 1 - self.warmup_end) / self.after_warmup
        when = (
            f"{more * spacing} more steps (to step {until} of {self.total_steps})"
            if until < self.total_steps
            else "more steps than the run has"
        )
        return ConfigError(
            f"too short to forecast: {past} loss records and {100 * share:.1f}% of the steps after the warmup (step"
            f" {self.warmup_end}); a forecast needs at least {MIN_POINTS} records and {100 * MIN_PAST_WARMUP:.0f}%:"
            f" {when}"
        )

    def reference_loss(self) -> float:
        """The loss just after the warmup (median of the records there): the scale the annealing gain D is
        measured against, the same however much of the run a forecast sees."""
        span = max(8, self.total_steps // 50)
        near = (self.updates >= self.warmup_end) & (self.updates < self.warmup_end + span)
        pool = self.loss[near] if near.any() else self.loss[self.updates >= self.warmup_end]
        return float(np.median(pool if len(pool) else self.loss))

    def taus(self, priors: LawPriors, data: Window) -> list[float]:
        """Response times to try: the prior's alone until 30% of the annealing is behind the run."""
        centre = priors.tau_ratio() * self.total_steps
        if not self.has_annealing or self.annealing_seen(int(data.updates[-1])) < 0.3:
            return [max(2.0, centre)]
        return sorted({max(2.0, t * self.total_steps) for t in TAU_GRID} | {max(2.0, centre)})

    def fit(self, data: Window, priors: LawPriors, free: bool = False) -> tuple[LawFit, float]:
        """The law's MAP fit (and its cost) to `data` under `priors`; `free` fits a whole curve, the
        priors weak and the records' weight uncapped (what the library's runs teach)."""
        best = None
        for tau in self.taus(priors, data) if not free else self._all_taus():
            theta, cost = self._fit_tau(data, priors, tau, free)
            if self.has_annealing:  # the prior on tau / steps
                cost += 0.5 * ((math.log(tau / self.total_steps) - priors.log_tau) / priors.tau_width) ** 2
            if best is None or cost < best[2]:
                best = (theta, tau, cost)
        theta, tau, cost = best
        r = self.response(tau)
        params = self.params(theta)
        resid = law(params, self.s1[data.updates], r[data.updates]) - data.loss
        rmse = float(np.sqrt(np.mean(resid**2)))
        decay = 1.0 - 1.0 / tau
        return LawFit(*params, decay, data.noise, rmse, len(data.loss), self.s1, r), cost

    def _all_taus(self) -> list[float]:
        return [max(2.0, t * self.total_steps) for t in TAU_GRID] if self.has_annealing else [1.0]

    def params(self, theta) -> tuple[float, float, float, float]:
        L0, logA, logalpha, logD = (float(v) for v in theta)
        return L0, math.exp(logA), math.exp(logalpha), (math.exp(logD) if self.has_annealing else 0.0)

    def _fit_tau(self, data: Window, priors: LawPriors, tau: float, free: bool) -> tuple[np.ndarray, float]:
        from scipy.optimize import least_squares

        s1 = data.bin_mean(self.s1[data.updates])
        r = data.bin_mean(self.response(tau)[data.updates])
        weight = data.count if free else data.count * min(1.0, priors.evidence / data.count.sum())
        scale = np.sqrt(weight) / data.noise
        annealing = self.has_annealing
        scale_loss = self.reference_loss()
        width = 4.0 if free else 1.0  # the library's runs are whole curves: their data decide
        gain_centre = priors.log_gain + math.log(scale_loss)

        def residuals(theta):
            L0, logA, logalpha, logD = theta
            D = math.exp(logD) if annealing else 0.0
            out = (law((L0, math.exp(logA), math.exp(logalpha), D), s1, r) - data.y) * scale
            priors_r = [
                (logalpha - priors.log_alpha) / (priors.alpha_width * width),
                (logD - gain_centre) / (priors.gain_width * width) if annealing else logD - gain_centre,
            ]
            return np.append(out, priors_r)

        x0 = self._initial(s1, r, data, priors, gain_centre)
        top = float(data.y.max()) + 1e-9
        lo = np.array([0.0, -30.0, math.log(0.01), -30.0])
        hi = np.array([top, 30.0, math.log(4.0), 10.0])
        x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
        result = least_squares(
            residuals, x0, bounds=(lo, hi), loss=_soft_l1_but_priors, f_scale=ROBUST_SCALE, x_scale="jac"
        )
        return result.x, float(result.cost)

    def _initial(self, s1, r, data: Window, priors: LawPriors, gain_centre: float) -> np.ndarray:
        """(L0, log A) by linear least squares at the prior's alpha and D."""
        from scipy.optimize import lsq_linear

        alpha = math.exp(priors.log_alpha)
        D = math.exp(gain_centre) if self.has_annealing else 0.0
        X = np.stack([np.ones_like(s1), s1 ** (-alpha)], axis=1)
        fit = lsq_linear(X, data.y + D * r, bounds=([0.0, 1e-8], [float(data.y.max()), np.inf]))
        return np.array([float(fit.x[0]), math.log(max(float(fit.x[1]), 1e-8)), math.log(alpha), gain_centre])


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


def fit_power(data: Window) -> PowerLawFit:
    """L = a + b * n^-c fitted to the window's records (the baseline the law is measured against)."""
    from scipy.optimize import least_squares, lsq_linear

    n = np.maximum(data.bin_mean(data.updates.astype(np.float64)), 1.0)
    scale = np.sqrt(data.count) / data.noise
    top = float(data.y.max()) + 1e-9
    best = None
    for c in np.geomspace(0.02, 3.0, 40):
        X = np.stack([np.ones_like(n), n ** (-c)], axis=1) * scale[:, None]
        r = lsq_linear(X, data.y * scale, bounds=([0.0, 0.0], [top, np.inf]))
        if best is None or r.cost < best[0]:
            best = (r.cost, np.array([r.x[0], r.x[1], c]))
    lo, hi = np.array([0.0, 0.0, 0.02]), np.array([top, np.inf, 3.0])
    start = np.clip(best[1], lo, np.where(np.isfinite(hi), hi - 1e-12, hi))

    def residuals(p):
        return (p[0] + p[1] * n ** (-p[2]) - data.y) * scale

    x = least_squares(residuals, start, bounds=(lo, hi), loss="soft_l1", f_scale=ROBUST_SCALE, x_scale="jac").x
    return PowerLawFit(*map(float, x))
