"""The guard's robust rules: a value is judged against the running median of its recent accepted history and
the median absolute deviation (MAD, scaled by 1.4826 to estimate a standard deviation) of its step-to-step
changes, so a single outlier never moves the yardstick, a falling trend is not taken for noise, the threshold follows the loss down as training progresses, and a floor relative
to the median keeps a very smooth curve from raising alarms over tiny bumps. Pure Python, so every rank,
given the same numbers, reaches the same verdict; the state is a few hundred floats and goes into
checkpoints."""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Any

MAD_TO_SIGMA = 1.4826  # a normal distribution's standard deviation in MADs
LEVEL = 16  # newest values whose median is the running level


class History:
    """The newest `size` accepted values of one quantity."""

    def __init__(self, size: int):
        self.values: deque[float] = deque(maxlen=size)

    def add(self, value: float) -> None:
        if math.isfinite(value):
            self.values.append(float(value))

    def __len__(self) -> int:
        return len(self.values)

    def center_and_spread(self, newest: int = 0) -> tuple[float, float]:
        """(running level, noise as a standard deviation). The level is the median of the newest `LEVEL`
        values; the noise is the MAD of step-to-step differences over the whole history (or its `newest`
        values), divided by sqrt(2): differences cancel the trend, so a loss that is still falling fast does not
        pass for noise."""
        values = list(self.values)
        level = median(values[-LEVEL:])
        values = values[-newest:] if newest else values
        if len(values) < 3:
            return level, 0.0
        diffs = [b - a for a, b in itertools.pairwise(values)]
        center = median(diffs)
        return level, MAD_TO_SIGMA * median(abs(d - center) for d in diffs) / math.sqrt(2)

    def state_dict(self) -> list[float]:
        return list(self.values)

    def load_state_dict(self, values: list[float]) -> None:
        self.values = deque((float(v) for v in values), maxlen=self.values.maxlen)


@dataclass
class Verdict:
    value: float
    median: float
    threshold: float  # the excess over the median that counts
    excess: float  # how far past the median the value is, in the rule's units

    @property
    def over(self) -> bool:
        return self.excess > self.threshold

    @property
    def severity(self) -> float:
        """The excess in thresholds: 1 is just over."""
        return self.excess / self.threshold if self.threshold > 0 else math.inf

    def describe(self, what: str) -> str:
        return f"{what} {self.value:.4g} against a running median of {self.median:.4g}"


class Rule:
    """Upward (or downward) deviation of a positive quantity from its running median by at least `mads` MADs
    and at least a relative floor: `min_ratio` of the median (linear rules) or a factor of `min_ratio`
    (logarithmic rules, for quantities that grow by factors: gradient norms, logits)."""

    def __init__(self, size: int, warmup: int, mads: float, min_ratio: float, log: bool = False,
                 downward: bool = False):  # fmt: skip
        self.history = History(size)
        self.warmup, self.mads, self.min_ratio = warmup, mads, min_ratio
        self.log, self.downward = log, downward

    def _scale(self, value: float) -> float:
        return math.log(max(value, 1e-30)) if self.log else value

    def judge(self, value: float) -> Verdict | None:
        """The verdict on `value`, or None while the history is too short to judge."""
        if len(self.history) < self.warmup or not math.isfinite(value):
            return None
        center, spread = self.history.center_and_spread()
        x = self._scale(value)
        excess = center - x if self.downward else x - center
        if self.log:
            floor = math.log(self.min_ratio) if self.min_ratio > 1 else 0.0
            shown = math.exp(center)
        else:
            floor = self.min_ratio * abs(center)
            shown = center
        return Verdict(value, shown, max(self.mads * spread, floor), excess)

    def accept(self, value: float) -> None:
        self.history.add(self._scale(value) if math.isfinite(value) else value)

    def state_dict(self) -> list[float]:
        return self.history.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.history.load_state_dict(state)


RISE_NOISE = 16  # losses the early-divergence rule takes the noise over


class Rise:
    """Early divergence: while the loss history is shorter than `until` (the spike rule's noise is not yet
    known), a loss more than `rise` (a fraction) above the lowest level the run has reached, and more than
    `mads` noise units (the history's, as the spike rule measures it) above it. The level is the median of three
    consecutive accepted losses (of all of them while there are fewer), so that one lucky batch does not set the
    bar; the first loss counts, so a loss that climbs above where it started is caught too. The noise term
    matters where the loss is noisy against its level: a preference loss of a few pairs a step (DPO's starts at
    ln 2 and moves by a tenth from batch to batch), whose lowest three-step level is some noise units below its
    true one; a pretraining loss falling from ln(vocabulary) is bounded by the fraction. The noise is the newest
    `RISE_NOISE` losses': a start that does not move (DPO's first steps are ln 2 exactly, while the policy is
    still the reference) would pass for a noiseless loss."""

    def __init__(self, history: History, until: int, rise: float, mads: float = 0.0):
        self.history, self.until, self.rise, self.mads = history, until, rise, mads

    def judge(self, value: float) -> Verdict | None:
        values = list(self.history.values)
        if not self.rise or not values or len(values) >= self.until or not math.isfinite(value):
            return None
        lowest = min(median(values[i : i + 3]) for i in range(max(1, len(values) - 2)))
        _, noise = self.history.center_and_spread(newest=RISE_NOISE)
        return Verdict(value, lowest, max(self.rise * abs(lowest), self.mads * noise), value - lowest)


class Streak:
    """Consecutive steps over a rule's threshold, with the step the streak began at."""

    def __init__(self) -> None:
        self.length, self.began = 0, 0

    def update(self, step: int, over: bool) -> int:
        if not over:
            self.length = 0
        else:
            if self.length == 0:
                self.began = step
            self.length += 1
        return self.length

    def state_dict(self) -> dict[str, int]:
        return {"length": self.length, "began": self.began}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.length, self.began = int(state["length"]), int(state["began"])


class SourceWatch:
    """Too good to be true, one source (token store) of a mixture at a time: its sampled loss below an absolute
    `floor`, or falling by a factor of `factor` (and `mads` MADs) below its own running median while its ratio
    to the rest of the mixture's loss falls as far below that ratio's running median, on `persist` steps in a
    row that drew from it. The ratio cancels the trend every source shares, and asking for the source's own
    fall as well keeps a collapse elsewhere from making the healthy sources look too good. A source is named
    at most once per `size` steps. Sources are kept by name and made on first sight, so a checkpoint's state
    loads before any step."""

    def __init__(self, size: int, warmup: int, mads: float, floor: float, factor: float, persist: int):
        self.size, self.warmup, self.mads, self.floor, self.factor = size, warmup, mads, floor, factor
        self.persist = persist
        self.watched: dict[str, _Source] = {}
        self.latest: dict[str, float] = {}  # each source's newest sampled loss, for reports

    def _of(self, name: str) -> _Source:
        if name not in self.watched:
            rules = [Rule(self.size, self.warmup, self.mads, self.factor, log=True, downward=True) for _ in "ab"]
            self.watched[name] = _Source(*rules, Streak())
        return self.watched[name]

    def judge(self, step: int, parts: dict[str, tuple[float, float]]) -> list[tuple[int, str]]:
        """(the step it began at, what was seen) for each source whose streak reaches `persist` at `step`;
        `parts` holds each source's (sum of sampled losses, count) of the step over all ranks."""
        found: list[tuple[int, str]] = []
        total = sum(s for s, _ in parts.values()), sum(c for _, c in parts.values())
        for name, (loss_sum, count) in parts.items():
            if count <= 0 or not math.isfinite(loss_sum):
                continue  # not in this step's batch: its streak neither grows nor breaks
            loss = loss_sum / count
            self.latest[name] = loss
            source = self._of(name)
            rest_count = total[1] - count
            rest = (total[0] - loss_sum) / rest_count if rest_count > 0 else 0.0
            ratio = loss / rest if rest > 0 else None
            own = source.own.judge(loss) if self.factor else None
            relative = source.ratio.judge(ratio) if ratio is not None and self.factor else None
            low = bool(self.floor) and loss < self.floor
            alone = bool(own and own.over and relative and relative.over)
            if source.streak.update(step, low or alone) == self.persist and step >= source.quiet_until:
                source.quiet_until = step + self.size
                if low:
                    what = f"source {name}: sampled loss {loss:.3g} is below the floor of {self.floor:g}"
                else:
                    what = (f"source {name}: sampled loss {loss:.3g} against its running median of {own.median:.3g},"
                            f" and {ratio:.3g} times the rest of the mixture's against a running"
                            f" {relative.median:.3g} times: collapsing alone")  # fmt: skip
                found.append((source.streak.began, what))
            if not source.streak.length:
                source.own.accept(loss)
                if ratio is not None:
                    source.ratio.accept(ratio)
        return found

    def state_dict(self) -> dict[str, Any]:
        return {name: {"own": s.own.state_dict(), "ratio": s.ratio.state_dict(), "streak": s.streak.state_dict(),
                       "quiet_until": s.quiet_until} for name, s in self.watched.items()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.watched, self.latest = {}, {}
        for name, saved in state.items():
            source = self._of(name)
            source.own.load_state_dict(saved["own"])
            source.ratio.load_state_dict(saved["ratio"])
            source.streak.load_state_dict(saved["streak"])
            source.quiet_until = int(saved["quiet_until"])


@dataclass
class _Source:
    own: Rule  # the source's loss
    ratio: Rule  # its loss over the rest of the mixture's
    streak: Streak
    quiet_until: int = 0  # named lately: not again before this step


class RouterWatch:
    """The routers of a mixture of experts, layer by layer, from each step's loads (the share of the step's
    (token, expert) pairs each expert got, summed over every rank) and balancing biases.

    Both are judged after `warmup` steps (a router's balancing takes a while to settle from its start):
    - Collapse: an expert's load below `dead` times the mean, or one expert chosen by more than `hot` of the
      layer's tokens (its share of the pairs times top_k; judged only where a balanced router gives every
      expert less than that), on `window` steps in a row. Named once per streak.
    - Drift: the median max/mean load of the newest `window` steps risen more than
      `drift` above the lowest such median since; named once, after which the new level is the bar.

    Layers are kept by name and made on first sight, so a checkpoint's state loads before any step. `recent`
    holds the newest steps' entropy, max/mean and biases for the reports; it describes the run, not its
    state, so it is not saved and a rollback does not undo it."""

    def __init__(self, window: int, warmup: int, dead: float, hot: float, drift: float, top_k: int = 1):
        self.window, self.warmup, self.dead, self.hot, self.drift = window, warmup, dead, hot, drift
        self.top_k = top_k
        self.layers: dict[str, _Router] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=4 * window)

    def _of(self, name: str) -> _Router:
        if name not in self.layers:
            self.layers[name] = _Router(Streak(), deque(maxlen=self.window))
        return self.layers[name]

    def judge(self, step: int, loads: dict[str, list[float]], biases: dict[str, list[float]]
              ) -> list[tuple[str, int, str]]:  # fmt: skip
        """(detector, the step it began at, what was seen) for each layer named at `step`; `loads` holds each
        layer's shares of the step's pairs by expert, `biases` its balancing biases after the step."""
        found: list[tuple[str, int, str]] = []
        seen: dict[str, dict[str, Any]] = {}
        for name, shares in loads.items():
            experts = len(shares)
            if experts < 2 or not all(math.isfinite(s) for s in shares) or sum(shares) <= 0:
                continue  # no pairs this step (or nothing to choose between)
            ratios = [s * experts for s in shares]
            entropy = -sum(s * math.log(s) for s in shares if s > 0) / math.log(experts)
            seen[name] = {"entropy": entropy, "max": max(ratios), "bias": list(biases.get(name, []))}
            router = self._of(name)
            if step <= self.warmup:
                continue  # the balancing is still settling: early imbalance is not judged
            low = min(range(experts), key=ratios.__getitem__)
            high = max(range(experts), key=ratios.__getitem__)
            dead = bool(self.dead) and ratios[low] < self.dead
            hot = bool(self.hot) and self.top_k / experts < self.hot and shares[high] * self.top_k > self.hot
            if router.streak.update(step, dead or hot) == self.window:
                what = (f"{name}: expert {high} chosen by {shares[high] * self.top_k:.0%} of the tokens"
                        if hot else f"{name}: expert {low} gets {ratios[low]:.3g} of the mean load")  # fmt: skip
                found.append(("collapse", router.streak.began, f"{what} for {self.window} steps: router collapse"))
            if self.drift:
                router.levels.append(max(ratios))
                if len(router.levels) == self.window:
                    level = median(router.levels)
                    if router.lowest is None or level < router.lowest:
                        router.lowest = level
                    elif level - router.lowest > self.drift:
                        what = (f"{name}: max/mean expert load {level:.3g} (median of {self.window} steps), up"
                                f" from {router.lowest:.3g}: imbalance drift")  # fmt: skip
                        found.append(("drift", step - self.window + 1, what))
                        router.lowest = level
        while self.recent and self.recent[-1]["step"] >= step:
            self.recent.pop()  # steps undone by a rollback, trained again
        self.recent.append({"step": step, "layers": seen})
        return found

    def state_dict(self) -> dict[str, Any]:
        return {name: {"streak": r.streak.state_dict(), "levels": list(r.levels), "lowest": r.lowest}
                for name, r in self.layers.items()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.layers = {}
        for name, saved in state.items():
            router = self._of(name)
            router.streak.load_state_dict(saved["streak"])
            router.levels.extend(float(v) for v in saved["levels"])
            router.lowest = None if saved["lowest"] is None else float(saved["lowest"])


@dataclass
class _Router:
    streak: Streak  # steps in a row collapsed
    levels: deque[float]  # the newest max/mean loads after the warm-up
    lowest: float | None = None  # the lowest median of `levels` so far
