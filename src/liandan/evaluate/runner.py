"""Run tasks under every one of their prompt formats; report each format's score and the spread across them.

Multiple choice scores each choice by the log-likelihood of its text after the prompt: accuracy takes the
choice of highest log-likelihood, length-normalised accuracy the highest per character of the choice (as
lm-evaluation-harness's acc_norm), so a long right answer is not beaten by a short wrong one for its length
alone. Generation decodes greedily until a stop string, extracts the answer with the task's regex and compares
it with the one extracted from the reference (exact match).

A task's result is never one number: per metric, the mean, min, max and spread (max - min) over its formats.

Scoring goes through `liandan.evaluate.scoring`, which works on a plain model and on one sharded across ranks
(every rank passes the same requests). `split` instead spreads the items over processes that each hold the
whole model and gathers the outcomes; the counts, and so the scores, do not depend on how items are split.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from liandan.evaluate.formats import PromptFormat
from liandan.evaluate.tasks import Item, Task

METRICS = {"multiple_choice": ("acc", "acc_norm"), "generation": ("exact_match",)}


@dataclass
class TaskResult:
    task: str
    kind: str
    n: int
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # format -> metric -> value

    def summary(self, metric: str) -> dict[str, float]:
        values = [by_metric[metric] for by_metric in self.scores.values()]
        lo, hi = min(values), max(values)
        return {"mean": sum(values) / len(values), "min": lo, "max": hi, "spread": hi - lo}

    @property
    def metrics(self) -> tuple[str, ...]:
        return METRICS[self.kind]

    def spread_line(self) -> str:
        """`task: metric mean 0.412 [min 0.380, max 0.450, spread 0.070] over N formats, n items` per metric."""
        parts = []
        for metric in self.metrics:
            s = self.summary(metric)
            parts.append(f"{metric} mean {s['mean']:.3f} [min {s['min']:.3f}, max {s['max']:.3f}, spread"
                         f" {s['spread']:.3f}]")  # fmt: skip
        return f"{self.task}: {'; '.join(parts)} over {len(self.scores)} formats, {self.n} items"

    def events(self, step: int) -> list[dict[str, Any]]:
        """ "eval_task" event fields: one per format and metric, then one summary per metric (format "*", value
        the mean, with min, max and spread)."""
        out = [
            {"step": step, "task": self.task, "format": fmt, "metric": m, "value": v, "n": self.n}
            for fmt, by_metric in self.scores.items()
            for m, v in by_metric.items()
        ]
        for m in self.metrics:
            s = self.summary(m)
            out.append({"step": step, "task": self.task, "format": "*", "metric": m, "value": s["mean"],
                        "n": self.n, **s})  # fmt: skip
        return out

    def metric_values(self) -> dict[str, float]:
        """Flat metrics for metrics.jsonl: eval/<task>/<metric>_{mean,min,max,spread}."""
        return {f"eval/{self.task}/{m}_{stat}": value for m in self.metrics for stat, value in self.summary(m).items()}


def multiple_choice_outcome(lls: list[float], lengths: list[int], label: int) -> tuple[bool, bool]:
    """(right by log-likelihood, right by log-likelihood per character) for one item; ties go to the first."""
    best = max(range(len(lls)), key=lambda i: lls[i])
    best_norm = max(range(len(lls)), key=lambda i: lls[i] / max(1, lengths[i]))
    return best == label, best_norm == label


def split_context(tokenizer: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """Token ids of (context, continuation), from the encoding of the whole text so that the continuation's
    tokens are the ones the model would see; whitespace that ends the context moves to the continuation."""
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole, ctx = tokenizer.encode_batch([stripped + continuation, stripped])
    if whole[: len(ctx)] == ctx and len(whole) > len(ctx):
        return ctx, whole[len(ctx) :]
    return ctx, tokenizer.encode_batch([continuation])[0]  # a token spans the boundary: encode apart


@dataclass
class Split:
    """Items spread over `size` processes, this one taking every `size`-th from `rank`; `gather` collects a
    list from every process (all_gather_object)."""

    rank: int
    size: int
    gather: Callable[[list], list[list]]


def run_task(
    model: Any, tokenizer: Any, task: Task, *, limit: int = 0, max_len: int, batch_size: int = 16,
    split: Split | None = None, formats: list[str] | None = None, max_new_tokens: int = 0,
) -> TaskResult:  # fmt: skip
    """Score `task` (its first `limit` items; 0: all) under each of its formats (or those named in `formats`);
    generation stops after the task's `max_new_tokens`, or after `max_new_tokens` when that is fewer."""
    chosen = [f for f in task.formats if not formats or f.name in formats] or task.formats
    indices = list(range(min(limit, len(task.items)) if limit else len(task.items)))
    n = len(indices)
    if split is not None:
        indices = indices[split.rank :: split.size]
    result = TaskResult(task.name, task.kind, n)
    for fmt in chosen:
        if task.kind == "multiple_choice":
            outcomes = _multiple_choice(model, tokenizer, task, fmt, indices, max_len, batch_size)
        else:
            new_tokens = min(task.max_new_tokens, max_new_tokens or task.max_new_tokens)
            outcomes = _generation(model, tokenizer, task, fmt, indices, max_len, batch_size, new_tokens)
        if split is not None:
            outcomes = [o for part in split.gather(outcomes) for o in part]
        columns = list(zip(*outcomes)) if outcomes else [() for _ in METRICS[task.kind]]
        result.scores[fmt.name] = {
            m: (sum(col) / len(col) if col else math.nan) for m, col in zip(METRICS[task.kind], columns)
        }
    return result


def _shots(task: Task, index: int) -> list[tuple[str, str, list[str] | None]]:
    return [(s.question, s.answer, s.choices) for s in task.shots(index)]


def _multiple_choice(
    model: Any, tokenizer: Any, task: Task, fmt: PromptFormat, indices: list[int], max_len: int, batch_size: int
) -> list[tuple[bool, ...]]:
    from liandan.evaluate.scoring import loglikelihoods

    requests, spans = [], []
    for i in indices:
        item: Item = task.items[i]
        context = fmt.prompt(_shots(task, i), item.question, item.choices)
        first = len(requests)
        for choice in item.choices or []:
            requests.append(split_context(tokenizer, context, fmt.target(choice)))
        spans.append((first, len(requests)))
    scored = loglikelihoods(model, requests, batch_size=batch_size, max_len=max_len)
    outcomes = []
    for i, (a, b) in zip(indices, spans):
        item = task.items[i]
        lls = [ll for ll, _ in scored[a:b]]
        outcomes.append(multiple_choice_outcome(lls, [len(c) for c in item.choices or []], item.label))
    return outcomes


def _generation(
    model: Any,
    tokenizer: Any,
    task: Task,
    fmt: PromptFormat,
    indices: list[int],
    max_len: int,
    batch_size: int,
    max_new_tokens: int,
) -> list[tuple[bool, ...]]:
    from liandan.evaluate.scoring import generate

    room = max(1, max_len - max_new_tokens)  # the prompt keeps its end: the question being asked
    prompts = [tokenizer.encode_batch([fmt.prompt(_shots(task, i), task.items[i].question, None)])[0][-room:]
               for i in indices]  # fmt: skip
    stops = [*task.stop, *fmt.stop_strings()]
    stop_ids = [ids for ids in tokenizer.encode_batch(stops) if ids]
    outputs = generate(model, prompts, max_new_tokens=max_new_tokens, stop_sequences=stop_ids,
                       eos_id=tokenizer.eos_id, batch_size=batch_size)  # fmt: skip
    outcomes = []
    for i, ids in zip(indices, outputs):
        text = cut_at_stops(tokenizer.decode(ids), stops)
        predicted, reference = task.extract(text), task.extract(task.items[i].answer)
        outcomes.append((predicted is not None and predicted == reference,))
    return outcomes


def cut_at_stops(text: str, stops: list[str]) -> str:
    """The text before the first stop string (a stop's tokens may not fall on the generated token boundary)."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text
