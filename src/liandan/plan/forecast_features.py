"""What a run is, for the forecast: its features (model size, tokens per step, peak learning rate, data,
optimizer), how far it lies from the runs the forecast learns from, and what that distance does to a
forecast.

A forecast borrows the shapes of finished runs' curves (`forecast_library`). Its interval is calibrated on
the library's own runs forecasting each other, so it holds for runs like them; for a run unlike every one
of them (another optimizer, other data, a size or learning rate far outside theirs) nothing says the shapes
carry over. The distance to the nearest run says how far out the forecast is, and the forecast answers it:
its interval widens by WIDEN_PER_UNIT of its half-width per unit of distance, and past FALLBACK_DISTANCE
the library's shapes give way to the run's own fit (`forecast.forecast_final_loss`).

Units: a factor FEATURE_SCALE (4x) in block parameters, tokens per step or learning rate is one unit; other
data (tokenizer or files) or another optimizer is two (squared distance DATA_DISTANCE, OPTIMIZER_DISTANCE);
the distances add in squares.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from liandan.config import Config

FEATURE_SCALE = math.log(4.0)  # runs 4x apart in size, tokens per step or learning rate are one unit apart
DATA_DISTANCE = 4.0  # ...and runs on other data two units
OPTIMIZER_DISTANCE = 4.0  # ...and runs with another optimizer two (their curves differ in shape)
UNKNOWN_SIZE = 1.0  # squared distance of a size that cannot be read (a model family whose keys do not say)
WIDEN_PER_UNIT = 0.1  # the interval's half-width grows by a tenth per unit of distance from the nearest run
FALLBACK_DISTANCE = 2.5  # past this the forecast is the run's own fit: no library run is like it
LIBRARY_WARMUP = 0.05  # the library's runs warm up over a twentieth of their steps (`library_equivalent`)
CORPORA = {  # the shipped library's corpora by the names its fixtures use: their files
    "en": ("en-shakespeare.txt", "en-wikitext2.jsonl"),
    "shakespeare": ("en-shakespeare.txt",),
    "zh": ("zh-classics.jsonl",),
}


def data_key(tokenizer: str, files: Iterable[str]) -> str:
    """The data a run trained on, as features compare it: the tokenizer and the files' names."""
    return f"{tokenizer}:" + ",".join(sorted(Path(f).name for f in files))


def fixture_data_key(key: str) -> str:
    """A library fixture's data ("byte:en", the corpus by name) as a run's (`data_key`); others unchanged."""
    tokenizer, _, corpus = key.partition(":")
    return data_key(tokenizer, CORPORA[corpus]) if corpus in CORPORA else key


@dataclass(frozen=True)
class RunFeatures:
    """What makes two runs alike, for weighing what one teaches the other: the size of the model, the tokens
    of a step, the peak learning rate, the data (tokenizer and files) and the optimizer."""

    params: float  # parameters of the blocks, 12 * layers * dim^2 (0: unknown)
    tokens_per_step: float
    lr: float
    data: str
    optimizer: str = "adamw"

    def distance(self, other: RunFeatures) -> float:
        """Squared distance: one unit per FEATURE_SCALE e-folds of each size, DATA_DISTANCE for other data,
        OPTIMIZER_DISTANCE for another optimizer."""
        return sum(self.parts(other).values())

    def parts(self, other: RunFeatures) -> dict[str, float]:
        """The squared distance feature by feature."""
        out = {}
        for k in ("params", "tokens_per_step", "lr"):
            mine, theirs = getattr(self, k), getattr(other, k)
            known = mine > 0 and theirs > 0
            out[k] = (math.log(mine / theirs) / FEATURE_SCALE) ** 2 if known else UNKNOWN_SIZE
        out["data"] = 0.0 if self.data == other.data else DATA_DISTANCE
        out["optimizer"] = 0.0 if self.optimizer == other.optimizer else OPTIMIZER_DISTANCE
        return out


def features_of(cfg: Config) -> RunFeatures:
    """A run's features from its config."""
    options = cfg.model.options
    params = 12.0 * getattr(options, "n_layers", 0) * getattr(options, "dim", 0) ** 2
    tokenizer = cfg.data.tokenizer
    if tokenizer == "bpe":  # a BPE tokenizer trained on the corpus: its size sets the loss's units
        tokenizer = f"bpe{cfg.data.bpe_vocab_size}"
    data = data_key(tokenizer, cfg.data.stores or cfg.data.paths)
    return RunFeatures(params, cfg.train.global_batch * cfg.train.seq_len, cfg.optim.lr, data, cfg.optim.name)


@dataclass(frozen=True)
class Reach:
    """How far a run lies from the runs a forecast learns from."""

    distance: float  # to the nearest run, in units (inf: no run to learn from; 0: features unknown)
    nearest: str = ""  # its name
    unlike: tuple[str, ...] = ()  # what sets the run apart from it, in words, largest first

    @property
    def far(self) -> bool:
        return self.distance > FALLBACK_DISTANCE

    def widening(self) -> float:
        """The factor on the interval's half-width."""
        return 1.0 + WIDEN_PER_UNIT * min(self.distance, 2.0 * FALLBACK_DISTANCE)

    def describe(self) -> str:
        if not math.isfinite(self.distance):
            return "no finished runs to learn from"
        if not self.nearest:
            return "the run's features unknown: not compared with the runs learned from"
        what = f" ({', '.join(self.unlike)})" if self.unlike else ""
        return f"{self.distance:.1f} units from the nearest run learned from, {self.nearest}{what}"


def reach(features: RunFeatures | None, runs: Sequence[tuple[str, RunFeatures | None]]) -> Reach:
    """The distance of a run with `features` from the nearest of `runs` (name, features)."""
    known = [(name, f) for name, f in runs if f is not None]
    if not known:
        return Reach(math.inf)
    if features is None:
        return Reach(0.0)
    name, nearest = min(known, key=lambda nf: features.distance(nf[1]))
    parts = features.parts(nearest)
    words = []
    for key, value in sorted(parts.items(), key=lambda kv: -kv[1]):
        if value < 0.25:  # less than half a unit: alike enough to leave unsaid
            continue
        if key in ("data", "optimizer"):
            words.append(f"{key} {getattr(features, key)}, not {getattr(nearest, key)}")
        else:
            words.append(f"{key.replace('_', ' ')} {getattr(features, key):.3g}, not {getattr(nearest, key):.3g}")
    return Reach(math.sqrt(features.distance(nearest)), name, tuple(words))


def library_equivalent(observed: int, warmup_end: int, total_steps: int) -> float:
    """The share of its steps a library run would have seen to have as much curve after its warmup as this
    run, in shares of the steps after the warmup: what the library's calibration is read at. Equal to the
    observed share for a run that warms up as the library's do; less for a longer warmup."""
    after = max(0, observed - warmup_end) / max(1, total_steps - warmup_end)
    return min(observed / total_steps, LIBRARY_WARMUP + (1.0 - LIBRARY_WARMUP) * after)
