"""Data mixtures from proxy runs (docs/mixtures.md): the swarm's design, the mixture law, the recommendation.

A swarm of small proxy runs trains on mixtures drawn around the natural (token-proportional) one. Each
source's held-out bits per byte is fitted as a function of the mixture weights w (on the simplex) by the
data-mixing law of Ye et al. (2024), `L(w) = c + exp(t · w)`: c is the loss no mixture removes, each t_j how
strongly more of source j moves the rest. It is log-linear in the weights above its floor c, as olmix's
regression is, and it stays positive and convex in w, so its minimum on the capped simplex is the one a
local solver finds. (A constant factor in front is redundant: on the simplex k · exp(t · w) = exp((t + log k)
· w).) A target is a weighted sum of the sources' held-out losses; its law is the same sum of theirs.

Intervals come from the Bayesian bootstrap over proxies (Rubin 1981: every proxy kept, with a random weight
drawn from a flat Dirichlet, every law refitted with the same weights), fit quality from leave-one-out
predictions. Unlike resampling with replacement, no refit loses the proxies that pin down a source's weight
range and extrapolates wildly beyond the ones it kept. The recommendation minimises the target's law,
optionally plus λ · KL(w ‖ natural) (olmix's pull towards the natural mixture), under a cap per source: it may
be repeated at most R times at the planned token budget, so w_j ≤ R · tokens_j / budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares, minimize, minimize_scalar

from liandan.config import ConfigError

MIN_WEIGHT = 1e-3  # a proxy's smallest weight: the loader takes positive weights only
ROUND = 6  # decimals of a proxy's weights, so that the design file and the run's config agree exactly
SLOPE_STEP = 0.1  # the marginal value's table shows the change for this much more weight


def default_runs(sources: int) -> int:
    """Proxies for `sources` sources: four per source, at least eight. A law has sources + 1 parameters;
    four points per parameter leave room for the bootstrap and leave-one-out to mean something."""
    return max(8, 4 * sources)


@dataclass(frozen=True)
class Proxy:
    name: str
    kind: str  # natural, uniform, config (the run config's own weights), dirichlet; or recommended
    weights: tuple[float, ...]
    seed: int | None = None  # the run's own run.seed (a validation run's); None: the config's

    def to_dict(self) -> dict:
        seed = {} if self.seed is None else {"seed": self.seed}
        return {"name": self.name, "kind": self.kind, "weights": list(self.weights), **seed}


def _tidy(weights: np.ndarray) -> tuple[float, ...]:
    w = np.maximum(np.asarray(weights, dtype=float), MIN_WEIGHT)
    w = np.round(w / w.sum(), ROUND)
    return tuple(float(x) for x in w)


def design_swarm(
    natural: Sequence[float], runs: int, concentration: float, seed: int, config_weights: Sequence[float] = ()
) -> list[Proxy]:
    """The natural and the uniform mixture (and the run config's own weights, when it names some), then
    Dirichlet draws with mean `natural`: alpha_j = concentration · k · natural_j, so that with equal token
    counts a concentration of 1 draws uniformly over the simplex and a larger one stays nearer natural. The
    draws come from one seeded stream in order: a swarm of more runs begins with the same proxies."""
    k = len(natural)
    if runs < k + 3:
        raise ConfigError(f"--runs = {runs}: a law over {k} sources and its bootstrap need at least {k + 3} proxies")
    if not concentration > 0 or not math.isfinite(concentration):
        raise ConfigError(f"--concentration = {concentration} must be a positive number")
    p = np.asarray(natural, dtype=float) / float(np.sum(natural))
    fixed = [("natural", _tidy(p)), ("uniform", _tidy(np.ones(k)))]
    if len(config_weights):
        fixed.append(("config", _tidy(np.asarray(config_weights, dtype=float))))
    chosen: list[tuple[str, tuple[float, ...]]] = []
    for kind, w in fixed:
        if all(max(abs(a - b) for a, b in zip(w, other)) > 1e-3 for _, other in chosen):
            chosen.append((kind, w))
    rng = np.random.default_rng(seed)
    while len(chosen) < runs:
        chosen.append(("dirichlet", _tidy(rng.dirichlet(concentration * k * p))))
    return [Proxy(f"p{i:03d}-{kind}", kind, w) for i, (kind, w) in enumerate(chosen[:runs])]


def repeat_caps(tokens: Sequence[int], budget: float, max_repeat: float, names: Sequence[str]) -> np.ndarray:
    """Each source's largest weight: R passes over its tokens within the budget (at most 1). ConfigError when
    the caps cannot add up to a whole mixture."""
    if not max_repeat > 0:
        raise ConfigError(f"--max-repeat = {max_repeat} must be positive")
    if not budget > 0:
        raise ConfigError(f"the token budget {budget} must be positive")
    caps = np.minimum(1.0, max_repeat * np.asarray(tokens, dtype=float) / budget)
    if caps.sum() < 1 - 1e-9:
        total = int(sum(tokens))
        raise ConfigError(
            f"a budget of {budget:,.0f} tokens repeats the {len(names)} sources' {total:,} tokens"
            f" {budget / total:.1f} times, more than --max-repeat = {max_repeat:g}: add data, lower the budget"
            " (--tokens, train.steps) or allow more repeats"
        )
    return caps


def parse_target(text: str, names: Sequence[str]) -> tuple[str, np.ndarray]:
    """(label, coefficients over the sources) of `--target`: a source's name, `average` (the mean of every
    source's held-out loss) or one non-negative weight per source, comma-separated."""
    k = len(names)
    if text == "average":
        return "average", np.full(k, 1.0 / k)
    if text in names:
        return text, np.eye(k)[list(names).index(text)]
    parts = text.split(",")
    try:
        values = np.array([float(x) for x in parts])
    except ValueError:
        raise ConfigError(f"--target = {text!r}: name a source ({', '.join(names)}), average, or give"
                          f" {k} weights like {','.join(['1'] * k)}") from None  # fmt: skip
    if len(values) != k:
        raise ConfigError(f"--target = {text!r} gives {len(values)} weights for {k} sources ({', '.join(names)})")
    if not (np.all(np.isfinite(values)) and np.all(values >= 0) and values.sum() > 0):
        raise ConfigError(f"--target = {text!r}: weights must be non-negative numbers, not all zero")
    return ",".join(f"{x:g}" for x in values), values / values.sum()


# ---------------------------------------------------------------------------------------------------------
# the law


@dataclass(frozen=True)
class MixtureLaw:
    """L(w) = c + exp(t · w) over mixture weights w."""

    c: float
    t: np.ndarray

    def predict(self, w: np.ndarray) -> np.ndarray:
        return self.c + np.exp(np.asarray(w) @ self.t)

    def gradient(self, w: np.ndarray) -> np.ndarray:
        return np.exp(np.asarray(w) @ self.t) * self.t

    def to_dict(self) -> dict:
        return {"c": self.c, "t": [float(x) for x in self.t]}

    @classmethod
    def from_dict(cls, data: dict) -> MixtureLaw:
        """A law as mix.json holds it (`analysis.fit.laws.<source>`), to predict other mixtures' losses."""
        return cls(float(data["c"]), np.asarray(data["t"], dtype=float))


def fit_law(weights: np.ndarray, losses: np.ndarray, proxy_weights: np.ndarray | None = None) -> MixtureLaw:
    """Least squares in the loss (each proxy's squared error times its `proxy_weights`, 1 by default), c between
    0 and just under the smallest loss. The floor c is weakly determined, so the start is found on c alone: for
    each c, t is the linear fit of log(L - c) on w, and c the one whose law is closest to the losses (a bounded
    scalar search); least squares over (c, t) polishes."""
    W, y = np.asarray(weights, dtype=float), np.asarray(losses, dtype=float)
    s = np.ones(len(y)) if proxy_weights is None else np.sqrt(np.asarray(proxy_weights, dtype=float))
    top = float(y.min()) * (1 - 1e-6)

    def slopes_for(c: float) -> np.ndarray:
        return np.linalg.lstsq(W * s[:, None], np.log(y - c) * s, rcond=None)[0]

    def cost(c: float) -> float:
        r = (c + np.exp(W @ slopes_for(c)) - y) * s
        return float(r @ r)

    c0 = float(minimize_scalar(cost, bounds=(0.0, top * (1 - 1e-4)), method="bounded").x)
    x0 = np.concatenate([[c0], slopes_for(c0)])

    def residuals(x: np.ndarray) -> np.ndarray:
        return (x[0] + np.exp(W @ x[1:]) - y) * s

    def jacobian(x: np.ndarray) -> np.ndarray:
        return np.column_stack([np.ones(len(y)), np.exp(W @ x[1:])[:, None] * W]) * s[:, None]

    res = least_squares(
        residuals, x0, jac=jacobian, bounds=([0.0] + [-np.inf] * W.shape[1], [top] + [np.inf] * W.shape[1])
    )
    return MixtureLaw(float(res.x[0]), res.x[1:].copy())


@dataclass(frozen=True)
class Fit:
    """The laws of every source, fitted on all proxies, and refitted under `bootstrap` random weightings of
    the proxies."""

    names: list[str]
    weights: np.ndarray  # proxies x sources
    losses: np.ndarray  # proxies x sources: held-out bits per byte
    laws: list[MixtureLaw]
    samples: list[list[MixtureLaw]]  # bootstrap weightings x sources

    def predict(self, laws: Sequence[MixtureLaw], target: np.ndarray, w: np.ndarray) -> np.ndarray:
        return sum(a * law.predict(w) for a, law in zip(target, laws) if a)

    def leave_one_out(self, target: np.ndarray) -> np.ndarray:
        """Each proxy's target loss predicted by laws fitted on the others, less the measured one."""
        n = len(self.losses)
        errors = np.empty(n)
        for i in range(n):
            keep = np.arange(n) != i
            laws = [
                fit_law(self.weights[keep], self.losses[keep, j]) if a else law
                for j, (a, law) in enumerate(zip(target, self.laws))
            ]
            errors[i] = self.predict(laws, target, self.weights[i]) - self.losses[i] @ target
        return errors


def fit_mixture(weights, losses, names: Sequence[str], bootstrap: int = 200, seed: int = 0) -> Fit:
    W, Y = np.asarray(weights, dtype=float), np.asarray(losses, dtype=float)
    n, k = W.shape
    if n < k + 3:
        raise ConfigError(f"{n} finished proxies for {k} sources: a law and its bootstrap need at least {k + 3}")
    laws = [fit_law(W, Y[:, j]) for j in range(k)]
    rng = np.random.default_rng(seed)
    samples = []
    for _ in range(bootstrap):
        proxy_weights = rng.dirichlet(np.ones(n)) * n
        samples.append([fit_law(W, Y[:, j], proxy_weights) for j in range(k)])
    return Fit(list(names), W, Y, laws, samples)


# ---------------------------------------------------------------------------------------------------------
# the recommendation


def fill_to_caps(w: np.ndarray, caps: np.ndarray) -> np.ndarray:
    """`w` made a mixture within the caps: clipped to them, what was clipped shared among the others in
    proportion (evenly when they hold none), until nothing is over."""
    w = np.minimum(np.maximum(np.asarray(w, dtype=float), 0), caps)
    for _ in range(len(w) + 1):
        missing = 1.0 - w.sum()
        if missing <= 1e-12:
            break
        room = caps - w
        free = room > 1e-12
        share = np.where(free, w, 0.0)
        share = share if share.sum() > 0 else free.astype(float)
        w = np.minimum(w + missing * share / share.sum(), caps)
    return w / w.sum()


def kl_divergence(w: np.ndarray, p: np.ndarray) -> float:
    mask = w > 0
    return float(np.sum(w[mask] * np.log(w[mask] / p[mask])))


def recommend(
    laws: Sequence[MixtureLaw], target: np.ndarray, natural: np.ndarray, caps: np.ndarray, kl: float = 0.0,
    starts: Sequence[np.ndarray] = (),
) -> np.ndarray:  # fmt: skip
    """The weights that minimise the target's law (+ kl · KL(w ‖ natural)) on the simplex within the caps."""
    k = len(natural)
    eps = 1e-12

    def objective(w: np.ndarray) -> float:
        value = sum(a * law.predict(w) for a, law in zip(target, laws) if a)
        if kl:
            value += kl * float(np.sum(w * np.log((w + eps) / natural)))
        return float(value)

    def gradient(w: np.ndarray) -> np.ndarray:
        g = sum(a * law.gradient(w) for a, law in zip(target, laws) if a)
        if kl:
            g = g + kl * (np.log((w + eps) / natural) + w / (w + eps))
        return np.asarray(g, dtype=float)

    candidates = [*starts, natural, np.ones(k) / k, *np.eye(k)]
    best, best_value = None, math.inf
    for x0 in candidates:
        x0 = fill_to_caps(x0, caps)
        res = minimize(
            objective, x0, jac=gradient, method="SLSQP", bounds=list(zip(np.zeros(k), caps)),
            constraints=[{"type": "eq", "fun": lambda w: w.sum() - 1, "jac": lambda w: np.ones_like(w)}],
            options={"maxiter": 200, "ftol": 1e-12},
        )  # fmt: skip
        w = fill_to_caps(np.clip(res.x, 0, None), caps)
        value = objective(w)
        if value < best_value:
            best, best_value = w, value
    assert best is not None
    return best


# ---------------------------------------------------------------------------------------------------------
# the value of each source


def slopes(laws: Sequence[MixtureLaw], target: np.ndarray, at: np.ndarray) -> np.ndarray:
    """d target / d ε of moving ε of the mixture to each source from the others in proportion:
    w(ε) = (1 - ε) w + ε e_j, so the slope is ∇L · (e_j - w)."""
    g = sum(a * law.gradient(at) for a, law in zip(target, laws) if a)
    return np.asarray(g, dtype=float) - float(np.dot(g, at))


def removals(laws: Sequence[MixtureLaw], target: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The change in the target's law when each source's weight goes to 0 and the others are renormalised."""
    base = sum(a * law.predict(at) for a, law in zip(target, laws) if a)
    out = np.empty(len(at))
    for j in range(len(at)):
        w = at.copy()
        w[j] = 0.0
        out[j] = (sum(a * law.predict(w / w.sum()) for a, law in zip(target, laws) if a) - base) if w.sum() else np.nan
    return out


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = np.nanpercentile(samples, [50 * (1 - level), 50 * (1 + level)], axis=0)
    return lo, hi


def verdict(lo: float, hi: float) -> str:
    """More of a source lowers the target loss: it helps; raises it: it hurts; the interval holds 0: neutral."""
    return "helps" if hi < 0 else "hurts" if lo > 0 else "neutral"


def analyse(
    fit: Fit, target_label: str, target: np.ndarray, natural: np.ndarray, caps: np.ndarray, kl: float = 0.0,
    level: float = 0.95,
) -> dict:  # fmt: skip
    """Everything `liandan mix` reports for one target, as mix.json holds it: the recommendation with its
    predicted loss and intervals, the natural and uniform mixtures' predictions, the fit's leave-one-out
    error, and each source's value at the natural mixture."""
    k = len(natural)
    uniform = np.ones(k) / k
    best = recommend(fit.laws, target, natural, caps, kl)
    boot_best = np.array([recommend(laws, target, natural, caps, kl, starts=[best]) for laws in fit.samples])

    def predicted(w: np.ndarray) -> dict:
        values = np.array([fit.predict(laws, target, w) for laws in fit.samples])
        lo, hi = interval(values, level)
        return {"weights": [float(x) for x in w], "loss": float(fit.predict(fit.laws, target, w)),
                "low": float(lo), "high": float(hi)}  # fmt: skip

    loo = fit.leave_one_out(target)
    measured = fit.losses @ target
    slope_samples = np.array([slopes(laws, target, natural) for laws in fit.samples])
    removal_samples = np.array([removals(laws, target, natural) for laws in fit.samples])
    slope_lo, slope_hi = interval(slope_samples, level)
    rem_lo, rem_hi = interval(removal_samples, level)
    slope, removal = slopes(fit.laws, target, natural), removals(fit.laws, target, natural)
    weight_lo, weight_hi = interval(boot_best, level)
    sources = [
        {"name": name, "natural": float(natural[j]), "cap": float(caps[j]), "recommended": float(best[j]),
         "recommended_low": float(weight_lo[j]), "recommended_high": float(weight_hi[j]),
         "slope": float(slope[j]), "slope_low": float(slope_lo[j]), "slope_high": float(slope_hi[j]),
         "removed": float(removal[j]), "removed_low": float(rem_lo[j]), "removed_high": float(rem_hi[j]),
         "verdict": verdict(float(slope_lo[j]), float(slope_hi[j]))}
        for j, name in enumerate(fit.names)
    ]  # fmt: skip
    return {
        "target": target_label,
        "target_weights": [float(x) for x in target],
        "level": level,
        "kl": kl,
        "recommended": predicted(best),
        "natural": predicted(natural),
        "uniform": predicted(uniform),
        "fit": {
            "proxies": len(measured),
            "bootstrap": len(fit.samples),
            "loo_rms": float(np.sqrt(np.mean(loo**2))),
            "loo_rms_relative": float(np.sqrt(np.mean((loo / measured) ** 2))),
            "loo_max_relative": float(np.max(np.abs(loo / measured))),
            "laws": {name: law.to_dict() for name, law in zip(fit.names, fit.laws)},
        },
        "sources": sources,
    }
