"""Scaling laws: fit L(N, D) = E + A/N^α + B/D^β to a set of runs, and plan compute-optimal runs with it.

The parametric law is Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", the
Chinchilla paper), approach 3. It is fitted the way they fitted it: a Huber loss (δ = 1e-3) on the residuals
of the log loss, with the law in log space,

    minimise  Σ_i Huber_δ( LSE(a − α log N_i, b − β log D_i, e) − log L_i )   with A = e^a, B = e^b, E = e^e,

by L-BFGS from a grid of starting points, keeping the best. Uncertainty comes from the bootstrap: resample
the runs with replacement, refit, and take percentile intervals of whatever is derived from the laws.

With training compute C ≈ 6·N·D the loss-minimising split of a budget has a closed form:

    N_opt(C) = G·(C/6)^a,   D_opt(C) = G⁻¹·(C/6)^b,   a = β/(α+β),  b = α/(α+β),  G = (αA/(βB))^(1/(α+β)).

The simpler law across runs, L(C) = a·C^b + c (b < 0, c the loss no compute removes), is fitted with the
same robust loss on log residuals.
"""

from __future__ import annotations

import contextlib
import csv
import ctypes
import functools
import itertools
import json
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from liandan.config import ConfigError
from liandan.run import RunDir

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
# The laws


@dataclass(frozen=True)
class ScalingLaw:
    """L(N, D) = E + A/N^alpha + B/D^beta: loss of a model of N parameters trained on D tokens."""

    E: float
    A: float
    B: float
    alpha: float
    beta: float

    def loss(self, n, d):
        """Predicted loss; n and d may be numbers or numpy arrays."""
        n, d = np.asarray(n, dtype=float), np.asarray(d, dtype=float)
        out = self.E + self.A / n**self.alpha + self.B / d**self.beta
        return float(out) if out.ndim == 0 else out

    # -- compute-optimal allocation under C = 6 N D --------------------------------------------------------

    @property
    def a(self) -> float:
        """N_opt ∝ C^a."""
        return self.beta / (self.alpha + self.beta)

    @property
    def b(self) -> float:
        """D_opt ∝ C^b."""
        return self.alpha / (self.alpha + self.beta)

    @property
    def G(self) -> float:
        return (self.alpha * self.A / (self.beta * self.B)) ** (1.0 / (self.alpha + self.beta))

    def optimal(self, flops):
        """(N_opt, D_opt) minimising L(N, D) subject to 6·N·D = flops (closed form)."""
        c6 = np.asarray(flops, dtype=float) / 6.0
        n, d = self.G * c6**self.a, c6**self.b / self.G
        return (float(n), float(d)) if n.ndim == 0 else (n, d)

    def tokens_for_params(self, n):
        """D such that a model of n parameters is compute-optimal when trained on D tokens: the budget C with
        N_opt(C) = n, divided by 6n. Equals G^(-1/a)·n^(b/a)."""
        n = np.asarray(n, dtype=float)
        d = (n / self.G) ** (1.0 / self.a) / n
        return float(d) if d.ndim == 0 else d

    def params_for_tokens(self, d):
        """N such that training it on d tokens is compute-optimal: the budget C with D_opt(C) = d, over 6d."""
        d = np.asarray(d, dtype=float)
        n = (d * self.G) ** (1.0 / self.b) / d
        return float(n) if n.ndim == 0 else n

    # -- storage -----------------------------------------------------------------------------------------

    def as_tuple(self) -> tuple[float, float, float, float, float]:
        return (self.E, self.A, self.B, self.alpha, self.beta)

    def to_dict(self) -> dict[str, float]:
        return {"E": self.E, "A": self.A, "B": self.B, "alpha": self.alpha, "beta": self.beta}

    @classmethod
    def from_dict(cls, data: dict) -> ScalingLaw:
        try:
            law = cls(*(float(data[k]) for k in ("E", "A", "B", "alpha", "beta")))
        except (KeyError, TypeError, ValueError) as err:
            raise ConfigError(f"a scaling law needs numbers E, A, B, alpha and beta ({err})") from None
        if not (law.A > 0 and law.B > 0 and law.alpha > 0 and law.beta > 0 and law.E >= 0):
            raise ConfigError(f"a scaling law needs A, B, alpha, beta > 0 and E >= 0, got {law.to_dict()}")
        return law

    def describe(self) -> str:
        return f"L(N, D) = {_g(self.E)} + {_g(self.A)}/N^{self.alpha:.4g} + {_g(self.B)}/D^{self.beta:.4g}"


CHINCHILLA = ScalingLaw(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)
"""Hoffmann et al. 2022, approach 3 (their equation 10), as published. Besiroglu et al. 2024 showed that these
constants do not fit the paper's own runs: they put ~44 tokens per parameter at 1B parameters and ~9x
Chinchilla's tokens per parameter at 1T, against the ~20 of the paper's approaches 1 and 2 (its Table 3).
Kept selectable (`--law hoffmann`) for comparison, not as a default."""

EPOCH_REFIT = ScalingLaw(E=1.8172, A=482.01, B=2085.43, alpha=0.3478, beta=0.3658)
"""Besiroglu, Erdil, Barnett and You 2024 ("Chinchilla Scaling: A replication attempt", Epoch AI): approach 3
refitted to the runs read off Hoffmann et al.'s Figure 4, with the same Huber objective. It agrees with the
paper's approaches 1 and 2 (about 20 tokens per parameter; 67B parameters at 5.76e23 FLOPs). N counts all
parameters, D training tokens, L is nats per token on MassiveText; the constants transfer to another
tokenizer, data mix or parameter count only roughly."""

NAMED_LAWS: dict[str, tuple[ScalingLaw, str]] = {
    "epoch": (EPOCH_REFIT, "Chinchilla refitted by Besiroglu et al. 2024 (Epoch AI); N counts all parameters"),
    "hoffmann": (CHINCHILLA, "Hoffmann et al. 2022, approach 3 as published; overestimates tokens per parameter"),
}
DEFAULT_LAW = "epoch"


@dataclass(frozen=True)
class ComputeLaw:
    """L(C) = a·C^b + c across runs: loss against training compute C in FLOPs (b < 0)."""

    a: float
    b: float
    c: float

    def loss(self, flops):
        out = self.a * np.asarray(flops, dtype=float) ** self.b + self.c
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict[str, float]:
        return {"a": self.a, "b": self.b, "c": self.c}

    def describe(self) -> str:
        return f"L(C) = {_g(self.a)}·C^{self.b:.4g} + {_g(self.c)}"


# --------------------------------------------------------------------------------------------------------
# Observations: the runs a law is fitted to


@dataclass
class Observations:
    """One row per run: N parameters, D tokens, loss, and training compute C in FLOPs."""

    n: np.ndarray
    d: np.ndarray
    loss: np.ndarray
    compute: np.ndarray
    names: list[str] = field(default_factory=list)
    source: str = ""  # what N, D, loss and C are, in words

    def __post_init__(self) -> None:
        self.n, self.d, self.loss, self.compute = (
            np.asarray(x, dtype=float) for x in (self.n, self.d, self.loss, self.compute)
        )
        if not self.names:
            self.names = [f"run {i + 1}" for i in range(len(self.n))]

    def __len__(self) -> int:
        return len(self.n)

    def take(self, index: np.ndarray) -> Observations:
        return Observations(
            self.n[index],
            self.d[index],
            self.loss[index],
            self.compute[index],
            [self.names[i] for i in index],
            self.source,
        )


_COLUMNS = {
    "n": ("n", "params", "parameters", "non_embedding_parameters"),
    "d": ("d", "tokens"),
    "c": ("c", "flops", "compute"),
    "loss": ("loss", "l"),
}


def read_csv(path: Path) -> Observations:
    """Runs from a CSV with a header: N (or params), D (or tokens) and/or C (or flops), and loss.

    With D and no C, C = 6·N·D; with C and no D, D = C/(6·N). Lines starting with # are comments."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            lines = [line for line in handle if line.strip() and not line.lstrip().startswith("#")]
        rows = list(csv.reader(lines))
    except (UnicodeDecodeError, csv.Error) as err:
        reason = "not UTF-8 text" if isinstance(err, UnicodeDecodeError) else str(err)
        raise ConfigError(f"{path}: not a CSV of runs ({reason})") from None
    if not rows:
        raise ConfigError(f"{path}: empty; expected a header with columns N, D (or C) and loss")
    header = [h.strip().lower() for h in rows[0]]
    where: dict[str, int] = {}
    for key, names in _COLUMNS.items():
        found = [i for i, h in enumerate(header) if h in names]
        if len(found) > 1:
            raise ConfigError(f"{path}: more than one column for {key!r}: {[rows[0][i] for i in found]}")
        if found:
            where[key] = found[0]
    missing = [k for k in ("n", "loss") if k not in where]
    if missing or ("d" not in where and "c" not in where):
        raise ConfigError(
            f"{path}: header {','.join(h.strip() for h in rows[0])!r} needs columns N, loss and D or C "
            "(also accepted: params, tokens, flops)"
        )
    values: dict[str, list[float]] = {k: [] for k in where}
    for lineno, row in enumerate(rows[1:], start=2):
        if len(row) != len(header):
            raise ConfigError(f"{path}: row {lineno} has {len(row)} fields, the header {len(header)}")
        for key, i in where.items():
            text = row[i].strip()
            try:
                value = float(text)
            except ValueError:
                raise ConfigError(
                    f"{path}: row {lineno}, column {rows[0][i].strip()}: {text!r} is not a number"
                ) from None
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(f"{path}: row {lineno}, column {rows[0][i].strip()}: {text} must be positive")
            values[key].append(value)
    n = np.array(values["n"])
    d = np.array(values["d"]) if "d" in values else np.array(values["c"]) / (6 * n)
    c = np.array(values["c"]) if "c" in values else 6 * n * d
    names = [f"{path.name}:{i}" for i in range(2, len(n) + 2)]
    return Observations(n, d, np.array(values["loss"]), c, names, source=f"from {path.name}")


LOSS_KEYS = {"smoothed": "final_loss_smoothed", "final": "final_loss", "val": "val_loss"}


def find_runs(path: Path) -> list[Path]:
    """A run directory (it has summary.json), or the run directories directly under a directory."""
    path = Path(path)
    if RunDir(path).summary.is_file():
        return [path]
    if path.is_dir():
        runs = sorted(p for p in path.iterdir() if RunDir(p).summary.is_file())
        if runs:
            return runs
        raise ConfigError(f"{path}: no summary.json in it or in the directories under it")
    raise ConfigError(f"no such file or directory: {path}")


def read_runs(run_dirs: Sequence[Path], *, params: str = "non_embedding", loss: str = "auto") -> Observations:
    """Runs from liandan run directories' summary.json.

    params: "non_embedding" or "total" parameter count as N. loss: "smoothed" (final_loss_smoothed, the mean
    of the last tenth of the training losses), "final", "val" (val_loss), or "auto" (val_loss when every run
    has one, else smoothed). C is flops_per_token × tokens (PaLM's accounting, attention included)."""
    summaries = []
    for run in run_dirs:
        file = RunDir(Path(run)).summary
        try:
            summaries.append(RunDir(Path(run)).load_summary())
        except FileNotFoundError:
            raise ConfigError(f"{run}: no summary.json (an unfinished run?)") from None
        except ValueError as err:
            raise ConfigError(f"{file}: {err}") from None
    if loss == "auto":
        loss = "val" if summaries and all(s.get("val_loss") is not None for s in summaries) else "smoothed"
    if loss not in LOSS_KEYS:
        raise ConfigError(f"loss = {loss!r}; allowed: auto, {', '.join(LOSS_KEYS)}")
    if params not in ("non_embedding", "total"):
        raise ConfigError(f"params = {params!r}; allowed: non_embedding, total")
    n_key = "non_embedding_parameters" if params == "non_embedding" else "parameters"
    rows = []
    for run, s in zip(run_dirs, summaries):
        row = []
        for key in (n_key, "tokens", LOSS_KEYS[loss]):
            value = s.get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                hint = " (try --loss smoothed)" if key == "val_loss" else ""
                raise ConfigError(f"{run}: summary.json has no positive {key} (got {value!r}){hint}")
            row.append(float(value))
        fpt = s.get("flops_per_token")
        row.append(float(fpt) * row[1] if isinstance(fpt, (int, float)) and fpt > 0 else 6 * row[0] * row[1])
        rows.append(row)
    n, d, l_, c = (np.array(col) for col in zip(*rows)) if rows else ([], [], [], [])
    names = [Path(r).name for r in run_dirs]
    return Observations(
        n, d, l_, c, names, source=f"N = {params.replace('_', '-')} parameters, D = tokens, loss = {LOSS_KEYS[loss]}"
    )


def _beside_the_runs(path: Path) -> bool:
    """An SQLite database or one of its journal files, as a project directory holds beside its runs."""
    if path.name.endswith(("-wal", "-shm", "-journal")):
        return True
    with path.open("rb") as handle:
        return handle.read(16) == b"SQLite format 3\x00"


def load_observations(
    paths: Iterable[Path | str], *, params: str = "non_embedding", loss: str = "auto"
) -> Observations:
    """Runs from CSV files and run directories (or directories of run directories), together."""
    csvs: list[Observations] = []
    runs: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path == RunDir(path.parent).summary and path.is_file():
            runs.append(path.parent)
        elif path.is_file() and _beside_the_runs(path):
            continue  # `liandan fit runs/*` also names the project's databases (the run store, MLflow's)
        elif path.is_file():
            csvs.append(read_csv(path))
        else:
            runs.extend(find_runs(path))
    parts = csvs + ([read_runs(runs, params=params, loss=loss)] if runs else [])
    if not parts:
        raise ConfigError("no runs given")
    if len(parts) == 1:
        return parts[0]
    return Observations(
        np.concatenate([p.n for p in parts]),
        np.concatenate([p.d for p in parts]),
        np.concatenate([p.loss for p in parts]),
        np.concatenate([p.compute for p in parts]),
        [name for p in parts for name in p.names],
        source="; ".join(p.source for p in parts),
    )


# --------------------------------------------------------------------------------------------------------
# Fitting


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


def proposed_run(
    law: ScalingLaw, *, n: float | None = None, d: float | None = None, flops: float | None = None
) -> tuple[float, float, float]:
    """(N, D, C) of a run described by any one or two of its size, its tokens and its compute (C = 6·N·D).
    What is not given follows from the law's compute-optimal relation: a budget alone is split
    compute-optimally, a size alone gets the tokens that make it compute-optimal, and tokens alone the size."""
    given = {k: v for k, v in (("n", n), ("d", d), ("flops", flops)) if v is not None}
    for key, value in given.items():
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"{key} = {value} must be a positive number")
    if len(given) == 3:
        raise ConfigError("give at most two of parameters, tokens and FLOPs; the third is 6·N·D")
    if not given:
        raise ConfigError("give parameters, tokens or FLOPs of the run")
    if n is not None and d is not None:
        return n, d, 6.0 * n * d
    if flops is not None:
        if n is not None:
            return n, flops / (6.0 * n), flops
        if d is not None:
            return flops / (6.0 * d), d, flops
        n_opt, d_opt = law.optimal(flops)
        return n_opt, d_opt, flops
    if n is not None:
        d = law.tokens_for_params(n)
        return n, d, 6.0 * n * d
    n = law.params_for_tokens(d)
    return n, d, 6.0 * n * d


# --------------------------------------------------------------------------------------------------------
# Storage of a fit, for `liandan optimal --law`


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


def named_or_saved_law(spec: str | None) -> tuple[ScalingLaw, list[ScalingLaw], str]:
    """A published law by name (`epoch`, `hoffmann`; None means the default) or one saved by `liandan fit
    --save`: the law, its bootstrap replicates, and what it is."""
    name = spec or DEFAULT_LAW
    if name in NAMED_LAWS:
        law, description = NAMED_LAWS[name]
        return law, [], f"{name}: {description}"
    if not Path(name).exists():
        raise ConfigError(f"--law {name}: neither a published law ({', '.join(NAMED_LAWS)}) nor a file")
    law, samples, source = load_law(Path(name))
    return law, samples, f"fitted ({name}: {source})"


def load_law(path: Path) -> tuple[ScalingLaw, list[ScalingLaw], str]:
    """A law saved by `liandan fit --save` (or any JSON object with E, A, B, alpha, beta, at the top or under
    "law"): the law, its bootstrap replicates, and a description of what N, D and the loss were."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no such file: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a law written by `liandan fit --save` (not UTF-8 text)") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path}: not valid JSON ({err.msg}, line {err.lineno})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    law = ScalingLaw.from_dict(data.get("law", data))
    samples = []
    for row in data.get("bootstrap", []) or []:
        try:
            samples.append(ScalingLaw(*map(float, row)))
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: bootstrap entries must be [E, A, B, alpha, beta]") from None
    return law, samples, str(data.get("source", path.name))


def _g(x: float) -> str:
    return f"{x:.4g}"
