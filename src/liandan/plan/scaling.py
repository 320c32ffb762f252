"""Scaling laws: L(N, D) = E + A/N^α + B/D^β across model sizes and tokens, the published constants, and
the compute-optimal runs they imply.

The parametric law is Hoffmann et al. 2022 ("Training Compute-Optimal Large Language Models", the
Chinchilla paper), approach 3; `liandan.plan.scaling_fit` fits it to runs. With training compute C ≈ 6·N·D
the loss-minimising split of a budget has a closed form:

    N_opt(C) = G·(C/6)^a,   D_opt(C) = G⁻¹·(C/6)^b,   a = β/(α+β),  b = α/(α+β),  G = (αA/(βB))^(1/(α+β)).

The simpler law across runs is L(C) = a·C^b + c (b < 0, c the loss no compute removes).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from liandan.config import ConfigError

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
# A run's size, tokens and compute, the missing ones compute-optimal


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
# Laws by name or from a file, for `liandan optimal --law`


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
