"""Fitting scaling laws to runs, with bootstrap intervals.

L(N, D) = E + A/N^α + B/D^β is fitted the way Hoffmann et al. 2022 fitted it (approach 3): a Huber loss
(δ = 1e-3) on the residuals of the log loss, with the law in log space,

    minimise  Σ_i Huber_δ( LSE(a − α log N_i, b − β log D_i, e) − log L_i )   with A = e^a, B = e^b, E = e^e,

by L-BFGS from a grid of starting points, keeping the best. Uncertainty comes from the bootstrap: resample
the runs with replacement, refit, and take percentile intervals of whatever is derived from the laws.

The simpler law across runs, L(C) = a·C^b + c, is fitted with the same robust loss on log residuals.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from liandan.config import ConfigError
from liandan.plan.scaling import ComputeLaw, ScalingLaw
from liandan.plan.scaling_runs import Observations

HUBER_DELTA = 1e-3

# Hoffmann et al.'s grid of initialisations (their appendix on approach 3), in their coordinates (a, b, e, α, β).
HOFFMANN_GRID = {
    "a": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "b": (0.0, 5.0, 10.0, 15.0, 20.0, 25.0),
    "e": (-1.0, -0.5, 0.0, 0.5, 1.0),
    "alpha": (0.0, 0.5, 1.0, 1.5, 2.0),
    "beta": (0.0, 0.5, 1.0, 1.5, 2.0),
}
EXPONENT_BOUNDS = (0.0, 5.0)  # α and β; an estimate on a bound means the runs do not pin the exponent down
LOG_E_BOUNDS = (-20.0, 10.0)


# --------------------------------------------------------------------------------------------------------
# The fits


def huber(r: np.ndarray, delta: float = HUBER_DELTA) -> np.ndarray:
    """Huber loss: r²/2 for |r| <= δ, δ·(|r| − δ/2) beyond."""
    absr = np.abs(r)
    return np.where(absr <= delta, 0.5 * r * r, delta * (absr - 0.5 * delta))


def _lse(t: np.ndarray, axis: int = 0) -> np.ndarray:
    """log Σ exp(t) along axis, stably (scipy.special.logsumexp, without its per-call overhead)."""
    m = np.max(t, axis=axis)
    return m + np.log(np.sum(np.exp(t - np.expand_dims(m, axis)), axis=axis))


def _check_count(obs: Observations, needed: int, what: str) -> None:
    if len(obs) < needed:
        raise ConfigError(
            f"{len(obs)} run(s) cannot fit {what}, which has {needed} parameters; give at least {needed} runs"
        )


class _LawObjective:
    """The Hoffmann et al. objective for (a, b, e, α, β), with log N and log D centred on their means for the
    optimiser (a' = a − α·mean log N, b' = b − β·mean log D: the same function, better conditioned)."""

    def __init__(self, obs: Observations, delta: float):
        self.mn, self.md = float(np.mean(np.log(obs.n))), float(np.mean(np.log(obs.d)))
        self.xn, self.xd = np.log(obs.n) - self.mn, np.log(obs.d) - self.md
        self.y, self.delta = np.log(obs.loss), delta

    def to_centred(self, p: np.ndarray) -> np.ndarray:
        a, b, e, al, be = np.moveaxis(np.asarray(p, dtype=float), -1, 0)
        return np.stack([a - al * self.mn, b - be * self.md, e, al, be], axis=-1)

    def from_centred(self, q: np.ndarray) -> np.ndarray:
        a_, b_, e, al, be = q
        return np.array([a_ + al * self.mn, b_ + be * self.md, e, al, be])

    def many(self, q: np.ndarray) -> np.ndarray:
        """Objective at each row of q (k × 5), vectorised: for ranking a grid of starts."""
        t = np.stack(
            [
                q[:, :1] - q[:, 3:4] * self.xn,
                q[:, 1:2] - q[:, 4:5] * self.xd,
                np.broadcast_to(q[:, 2:3], (len(q), len(self.y))),
            ]
        )
        return huber(_lse(t, axis=0) - self.y, self.delta).sum(axis=1)

    def __call__(self, q: np.ndarray) -> tuple[float, np.ndarray]:
        a_, b_, e, al, be = q
        t = np.stack([a_ - al * self.xn, b_ - be * self.xd, np.full_like(self.y, e)])
        lse = _lse(t, axis=0)
        w = np.exp(t - lse)  # softmax weights: d LSE / d t
        r = lse - self.y
        g = np.clip(r, -self.delta, self.delta)  # Huber'(r)
        grad = np.array(
            [np.dot(g, w[0]), np.dot(g, w[1]), np.dot(g, w[2]), -np.dot(g, w[0] * self.xn), -np.dot(g, w[1] * self.xd)]
        )
        return float(huber(r, self.delta).sum()), grad


_LAW_BOUNDS = [(None, None), (None, None), LOG_E_BOUNDS, EXPONENT_BOUNDS, EXPONENT_BOUNDS]
_OPTIONS = {"maxiter": 2000, "ftol": 1e-15, "gtol": 1e-12}


def _grid(spec: dict[str, tuple[float, ...]]) -> np.ndarray:
    return np.array(list(itertools.product(*spec.values())), dtype=float)


@functools.cache
def _scipy_blas_threads() -> tuple[Callable, Callable] | None:
    """get/set of the thread count of the OpenBLAS that ships inside scipy's wheel, when there is one."""
    import scipy

    root = Path(scipy.__file__).parent
    for lib in sorted([*root.parent.glob("scipy.libs/*openblas*"), *root.glob(".dylibs/*openblas*")]):
        try:
            handle = ctypes.CDLL(str(lib))
        except OSError:
            continue
        for prefix in ("scipy_openblas_", "openblas_"):
            get = getattr(handle, f"{prefix}get_num_threads", None)
            set_ = getattr(handle, f"{prefix}set_num_threads", None)
            if get is not None and set_ is not None:
                return get, set_
    return None


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """L-BFGS-B calls BLAS on 5 x 5 matrices; OpenBLAS worker threads only cost there (20-fold on a busy
    machine). Limit scipy's OpenBLAS to one thread for the duration, as threadpoolctl would."""
    blas = _scipy_blas_threads()
    if blas is None:
        yield
        return
    get, set_ = blas
    before = get()
    set_(1)
    try:
        yield
    finally:
        set_(before)


def _minimise(fun, starts: np.ndarray, bounds) -> tuple[np.ndarray, float]:
    best_x, best_f = None, math.inf
    with _single_threaded_blas():
        for x0 in starts:
            res = minimize(fun, x0, jac=True, method="L-BFGS-B", bounds=bounds, options=_OPTIONS)
            if np.all(np.isfinite(res.x)) and res.fun < best_f:
                best_x, best_f = res.x, float(res.fun)
    if best_x is None:
        raise ConfigError("the fit failed from every starting point (are the losses sensible?)")
    return best_x, best_f


def _best_starts(values: np.ndarray, candidates: np.ndarray, k: int) -> np.ndarray:
    order = np.argsort(np.where(np.isfinite(values), values, np.inf), kind="stable")
    return candidates[order[:k]]


def fit_law(
    obs: Observations, *, delta: float = HUBER_DELTA, starts: int = 8, init: Sequence[ScalingLaw] = ()
) -> tuple[ScalingLaw, float]:
    """Fit L(N, D) = E + A/N^α + B/D^β as Hoffmann et al. did; returns the law and the objective's minimum.

    The objective is evaluated at every point of their grid of initialisations (6·6·5·5·5 = 4500) and L-BFGS-B
    runs from the `starts` best of them (and from each law in `init`); the lowest minimum wins."""
    _check_count(obs, 5, "L(N, D) = E + A/N^α + B/D^β")
    for values, name in ((obs.n, "N (parameters)"), (obs.d, "D (tokens)")):
        if len(np.unique(values)) < 2:
            raise ConfigError(f"every run has the same {name}; the law needs runs that differ in both N and D")
    f = _LawObjective(obs, delta)
    grid = f.to_centred(_grid(HOFFMANN_GRID))
    grid[:, 3:] = np.clip(grid[:, 3:], *EXPONENT_BOUNDS)
    x0 = _best_starts(f.many(grid), grid, starts)
    if init:
        x0 = np.concatenate([f.to_centred(np.array([_law_params(law) for law in init])), x0])
    q, value = _minimise(f, x0, _LAW_BOUNDS)
    a, b, e, al, be = f.from_centred(q)
    return ScalingLaw(E=math.exp(e), A=math.exp(a), B=math.exp(b), alpha=float(al), beta=float(be)), value


def _law_params(law: ScalingLaw) -> list[float]:
    return [math.log(law.A), math.log(law.B), math.log(max(law.E, 1e-300)), law.alpha, law.beta]


class _ComputeObjective:
    """Huber on log residuals of L(C) = exp(LSE(a' + b·(log C − mean log C), log c))."""

    def __init__(self, obs: Observations, delta: float):
        self.mc = float(np.mean(np.log(obs.compute)))
        self.x, self.y, self.delta = np.log(obs.compute) - self.mc, np.log(obs.loss), delta

    def many(self, q: np.ndarray) -> np.ndarray:
        t = np.stack([q[:, :1] + q[:, 1:2] * self.x, np.broadcast_to(q[:, 2:3], (len(q), len(self.y)))])
        return huber(_lse(t, axis=0) - self.y, self.delta).sum(axis=1)

    def __call__(self, q: np.ndarray) -> tuple[float, np.ndarray]:
        la, b, lc = q
        t = np.stack([la + b * self.x, np.full_like(self.y, lc)])
        lse = _lse(t, axis=0)
        w = np.exp(t - lse)
        r = lse - self.y
        g = np.clip(r, -self.delta, self.delta)
        grad = np.array([np.dot(g, w[0]), np.dot(g, w[0] * self.x), np.dot(g, w[1])])
        return float(huber(r, self.delta).sum()), grad


_COMPUTE_GRID = {
    "log_a": (-4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0),
    "b": (-1.0, -0.5, -0.3, -0.2, -0.1, -0.05, -0.02),
    "log_c": (-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0),
}
_COMPUTE_BOUNDS = [(None, None), (-5.0, 0.0), (-20.0, 10.0)]


def fit_compute_law(
    obs: Observations, *, delta: float = HUBER_DELTA, starts: int = 8, init: Sequence[ComputeLaw] = ()
) -> tuple[ComputeLaw, float]:
    """Fit L(C) = a·C^b + c (C = obs.compute) with the Huber loss on log residuals, L-BFGS-B from a grid."""
    _check_count(obs, 3, "L(C) = a·C^b + c")
    if len(np.unique(obs.compute)) < 2:
        raise ConfigError("every run has the same compute; L(C) needs runs of different compute")
    f = _ComputeObjective(obs, delta)
    grid = _grid(_COMPUTE_GRID)
    x0 = _best_starts(f.many(grid), grid, starts)
    if init:
        x0 = np.concatenate(
            [np.array([[math.log(c.a) + c.b * f.mc, c.b, math.log(max(c.c, 1e-300))] for c in init]), x0]
        )
    (la, b, lc), value = _minimise(f, x0, _COMPUTE_BOUNDS)
    return ComputeLaw(a=math.exp(la - b * f.mc), b=float(b), c=math.exp(lc)), value


# --------------------------------------------------------------------------------------------------------
# Bootstrap intervals


@dataclass
class Fit:
    """A fitted law, its bootstrap replicates, and the simpler L(C) law with its replicates."""

    law: ScalingLaw
    objective: float
    compute_law: ComputeLaw | None
    obs: Observations
    samples: list[ScalingLaw] = field(default_factory=list)
    compute_samples: list[ComputeLaw] = field(default_factory=list)

    def interval(self, fn: Callable[[ScalingLaw], float], confidence: float = 0.95) -> tuple[float, float] | None:
        """Percentile interval of fn(law) over the bootstrap replicates (None without replicates)."""
        return percentile_interval([fn(s) for s in self.samples], confidence)

    def compute_interval(
        self, fn: Callable[[ComputeLaw], float], confidence: float = 0.95
    ) -> tuple[float, float] | None:
        return percentile_interval([fn(s) for s in self.compute_samples], confidence)

    def residuals(self) -> np.ndarray:
        """log L_observed − log L_predicted per run."""
        return np.log(self.obs.loss) - np.log(self.law.loss(self.obs.n, self.obs.d))

    def at_bound(self) -> list[str]:
        """Exponents the optimiser left on a bound: the runs do not constrain them."""
        out = []
        for name, value in (("alpha", self.law.alpha), ("beta", self.law.beta)):
            if min(abs(value - bound) for bound in EXPONENT_BOUNDS) < 1e-6:
                out.append(name)
        return out


def percentile_interval(values: list[float], confidence: float) -> tuple[float, float] | None:
    arr = np.asarray(values, dtype=float)
    arr = arr[np.isfinite(arr)]
    if arr.size == 0:
        return None
    tail = 50.0 * (1.0 - confidence)
    lo, hi = np.percentile(arr, [tail, 100.0 - tail])
    return float(lo), float(hi)


def fit(
    obs: Observations,
    *,
    bootstrap: int = 200,
    seed: int = 0,
    delta: float = HUBER_DELTA,
    starts: int = 8,
    bootstrap_starts: int = 1,
) -> Fit:
    """Fit both laws to `obs`, then refit each on `bootstrap` resamples of the runs (drawn with replacement,
    seeded). A replicate starts from the full fit and from the `bootstrap_starts` best grid points of its own
    resample. L(C) is skipped (None) when the runs span a single compute."""
    law, value = fit_law(obs, delta=delta, starts=starts)
    try:
        compute_law = fit_compute_law(obs, delta=delta, starts=starts)[0]
    except ConfigError:
        compute_law = None
    result = Fit(law, value, compute_law, obs)
    rng = np.random.default_rng(seed)
    for _ in range(bootstrap):
        sample = obs.take(rng.integers(0, len(obs), size=len(obs)))
        try:
            result.samples.append(fit_law(sample, delta=delta, starts=bootstrap_starts, init=[law])[0])
        except ConfigError:  # a resample that repeats one N or one D cannot be fitted; it says nothing
            pass
        if compute_law is not None:
            try:
                result.compute_samples.append(
                    fit_compute_law(sample, delta=delta, starts=bootstrap_starts, init=[compute_law])[0]
                )
            except ConfigError:
                pass
    return result


# --------------------------------------------------------------------------------------------------------
# Storage of a fit, for `liandan optimal --law` (`liandan.plan.scaling.load_law` reads it)


def fit_to_dict(result: Fit, confidence: float = 0.95) -> dict:
    out = {
        "law": result.law.to_dict(),
        "form": "L(N, D) = E + A/N^alpha + B/D^beta",
        "source": result.obs.source,
        "runs": len(result.obs),
        "objective": result.objective,
        "bootstrap": [list(s.as_tuple()) for s in result.samples],
        "confidence": confidence,
    }
    if result.compute_law is not None:
        out["compute_law"] = result.compute_law.to_dict()
        out["compute_bootstrap"] = [[s.a, s.b, s.c] for s in result.compute_samples]
    return out
