"""`liandan mix --validate` (docs/mixtures.md): the recommended mixture checked at a larger size.

The recommended, the natural and the uniform mixture are each trained at the larger size (the proxies'
config with `--larger` overrides; by default twice the width: nearly four times the parameters outside the
embeddings) for several seeds. A seed is the run's `run.seed`: the model's initialisation and the data order. Every run is scored on the
same held-out windows (`data.split_seed` is the config's `run.seed` throughout), so the spread between seeds
is the training's alone, and the three mixtures of one seed differ only in their weights.

Two predictions are set against the measured target. The law as fitted, at the proxies' size, says how far the
proxies were from the larger model. The law moved to the larger size is what the recommendation is checked
by: each source's law shifted by its mean residual on the natural and uniform runs (the two anchors, both
measured at the larger size) predicts the recommended mixture, which took no part in the shift. The
recommended mixture "beats" another when its worst seed is better than the other's best seed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from liandan.config import Config, ConfigError
from liandan.plan.mixture import ROUND, MixtureLaw, Proxy
from liandan.plan.mixture_runs import SET_BY_MIX

KINDS = ("recommended", "natural", "uniform")
ANCHORS = ("natural", "uniform")
ZERO = 1e-4  # a recommended weight below this is the source left out
RESERVED = (*SET_BY_MIX, "run.seed", "data.split_seed")  # set by the validation for each run


def validation_name(target_label: str) -> str:
    """The validation of one target: its runs' directory and its report's name (`validate-<target>`), so that
    targets validated from one swarm keep their own runs."""
    return "validate-" + target_label.replace(",", "-")


def larger_overrides(items: Sequence[str], cfg: Config) -> list[str]:
    """`--larger KEY=VALUE` items as `--KEY=VALUE` overrides on top of the proxies' own; none given: the
    proxies' width doubled."""
    if not items:
        from liandan.model.spec import model_args

        return [f"--model.dim={2 * model_args(cfg.model, 0).dim}"]  # the family's own width, nested or flat
    out = []
    for item in items:
        key, eq, value = item.removeprefix("--").partition("=")
        if not (key and eq and value):
            raise ConfigError(f"--larger {item!r}: give KEY=VALUE, e.g. --larger model.dim=256")
        if key in RESERVED:
            raise ConfigError(f"--larger {item!r}: liandan mix sets {key} for each validation run")
        out.append(f"--{key}={value}")
    return out


def without_tiny(weights: Sequence[float]) -> tuple[float, ...]:
    """A recommendation as trained: weights below ZERO set to 0 (the source left out), the rest renormalised."""
    w = np.where(np.asarray(weights, dtype=float) < ZERO, 0.0, np.asarray(weights, dtype=float))
    w = np.round(w / w.sum(), ROUND)
    return tuple(float(x) for x in w)


def validation_runs(mixtures: dict[str, Sequence[float]], seeds: int, first_seed: int) -> list[Proxy]:
    """Every mixture at every seed, seed by seed, so that the first results compare all three."""
    if seeds < 2:
        raise ConfigError(f"--seeds = {seeds}: a spread needs at least 2 seeds")
    return [Proxy(f"{kind}-s{first_seed + i}", kind, tuple(mixtures[kind]), seed=first_seed + i)
            for i in range(seeds) for kind in KINDS]  # fmt: skip


def total_parameters(cfg: Config, vocab: int) -> int:
    from liandan.model.spec import count_params, model_args

    return int(count_params(model_args(cfg.model, vocab)).total)


def summarise(
    runs: Sequence[Proxy], results: Sequence[dict[str, float]], laws: dict[str, dict], target: Sequence[float],
    names: Sequence[str],
) -> dict[str, Any]:  # fmt: skip
    """Measured against predicted, per mixture: each seed's target, the mean and range, each source's mean,
    the law's prediction at the proxies' size and moved to the larger one; whether the recommended mixture
    beats the others beyond the seed spread; the prediction's relative error."""
    a = np.asarray(target, dtype=float)
    fitted = [MixtureLaw.from_dict(laws[n]) for n in names]
    by_kind: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [(p, r) for p, r in zip(runs, results) if p.kind == kind]
        per_source = np.array([[r[n] for n in names] for _, r in mine])  # seeds x sources
        w = np.asarray(mine[0][0].weights)
        by_kind[kind] = {
            "weights": list(mine[0][0].weights),
            "seeds": [p.seed for p, _ in mine],
            "measured": [float(x) for x in per_source @ a],
            "source_means": per_source.mean(axis=0),
            "law": np.array([law.predict(w) for law in fitted]),
        }
    shift = np.mean([by_kind[k]["source_means"] - by_kind[k]["law"] for k in ANCHORS], axis=0)
    out: dict[str, Any] = {"mixtures": {}, "anchors": list(ANCHORS), "shift": dict(zip(names, shift.tolist()))}
    for kind, d in by_kind.items():
        measured = np.asarray(d["measured"])
        at_proxy, moved = float(d["law"] @ a), float((d["law"] + shift) @ a)
        mean = float(measured.mean())
        out["mixtures"][kind] = {
            "weights": d["weights"], "seeds": d["seeds"], "measured": d["measured"], "mean": mean,
            "low": float(measured.min()), "high": float(measured.max()), "std": float(measured.std(ddof=1)),
            "sources": dict(zip(names, d["source_means"].tolist())),
            "predicted_at_proxy_size": at_proxy, "predicted": moved, "error_relative": (moved - mean) / mean,
        }  # fmt: skip
    rec = out["mixtures"]["recommended"]
    out["beats"] = {
        other: {"margin": out["mixtures"][other]["mean"] - rec["mean"],
                "beyond_spread": rec["high"] < out["mixtures"][other]["low"]}
        for other in ANCHORS
    }  # fmt: skip
    out["prediction_error_relative"] = rec["error_relative"]
    return out
