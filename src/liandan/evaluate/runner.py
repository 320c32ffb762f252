"""Run tasks under every one of their prompt formats; report each format's score and the spread across them.

Multiple choice scores each choice by the log-likelihood of its text after the prompt: accuracy takes the
choice of highest log-likelihood, length-normalised accuracy the highest per character of the choice (as
lm-evaluation-harness's acc_norm), so a long right answer is not beaten by a short wrong one for its length
alone. Generation decodes greedily until a stop string, extracts the answer with the task's regex and compares
it with the one extracted from the reference (exact match).

A task's result is never one number: per metric, the mean, min, max and spread (max - min) over its formats.

Any task runs on any model: what does not fit the model's window is cut, and said once per task (`notes`).
A context is cut from the left (as lm-eval does), a choice longer than the window is scored on its last
tokens, and generation is capped so that the prompt keeps half the window when the task asks for more new
tokens than the window holds (a prompt of a few tokens would ask no question).

Scoring goes through `liandan.evaluate.scoring`, which works on a plain model and on one sharded across ranks
(every rank passes the same requests). `split` instead spreads the items over processes that each hold the
whole model and gathers the outcomes; the counts, and so the scores, do not depend on how items are split.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from liandan.config import ConfigError
from liandan.evaluate.formats import PromptFormat
from liandan.evaluate.tasks import Item, Task

METRICS = {"multiple_choice": ("acc", "acc_norm"), "generation": ("exact_match",)}


@dataclass
class TaskResult:
    task: str
    kind: str
    n: int
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # format -> metric -> value
    notes: list[str] = field(default_factory=list)  # what was cut to fit the model's window, one line each

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
    split: Split | None = None, formats: list[str] | None = None, max_new_tokens: int = 0, progress: Any = None,
) -> TaskResult:  # fmt: skip
    """Score `task` (its first `limit` items; 0: all) under each of its formats (or those named in `formats`);
    generation stops after the task's `max_new_tokens`, or after `max_new_tokens` when that is fewer, and
    within the window of `max_len` tokens. `progress` (`liandan.evaluate.progress.EvalProgress`) is told of
    each format begun and of each request scored."""
    chosen = chosen_formats(task, formats)
    indices = list(range(min(limit, len(task.items)) if limit else len(task.items)))
    n = len(indices)
    if split is not None:
        indices = indices[split.rank :: split.size]
    result = TaskResult(task.name, task.kind, n)
    asked = min(task.max_new_tokens, max_new_tokens or task.max_new_tokens)
    new_tokens = generation_room(asked, max_len)
    cut: Counter[str] = Counter()  # what had to be cut to fit the window, summed over the formats
    for fmt in chosen:
        if progress is not None:
            progress.begin(f"{task.name} [{fmt.name}]")
        advance = progress.advance if progress is not None else None
        if task.kind == "multiple_choice":
            outcomes = _multiple_choice(model, tokenizer, task, fmt, indices, max_len, batch_size, cut, advance)
        else:
            outcomes = _generation(model, tokenizer, task, fmt, indices, max_len, batch_size, new_tokens, cut,
                                   advance)  # fmt: skip
        if split is not None:
            outcomes = [o for part in split.gather(outcomes) for o in part]
        columns = list(zip(*outcomes)) if outcomes else [() for _ in METRICS[task.kind]]
        result.scores[fmt.name] = {
            m: (sum(col) / len(col) if col else math.nan) for m, col in zip(METRICS[task.kind], columns)
        }
    if split is not None:
        cut = sum((Counter(part[0]) for part in split.gather([dict(cut)])), Counter())
    result.notes = _cut_notes(task, cut, max_len, asked, new_tokens)
    return result


def chosen_formats(task: Task, formats: list[str] | None) -> list[PromptFormat]:
    """The task's formats named in `formats` (all of them when none is named, or none of those is the task's)."""
    return [f for f in task.formats if not formats or f.name in formats] or task.formats


def task_requests(task: Task, limit: int, formats: list[str] | None, split: Split | None = None) -> int:
    """How many requests `run_task` scores in this process: per format, one per choice of a multiple-choice
    item, one per generation."""
    indices = list(range(min(limit, len(task.items)) if limit else len(task.items)))
    if split is not None:
        indices = indices[split.rank :: split.size]
    per_format = sum(len(task.items[i].choices or []) if task.kind == "multiple_choice" else 1 for i in indices)
    return per_format * len(chosen_formats(task, formats))


def generation_room(asked: int, max_len: int) -> int:
    """New tokens a generation may take in a window of `max_len`: as many as asked while the prompt keeps a
    token, else half the window, so that the prompt still holds the question."""
    if max_len < 2:
        raise ConfigError(f"a model of max_seq_len = {max_len} has no room to generate: a generation task needs 2+")
    return asked if asked < max_len else max_len // 2


def _cut_notes(task: Task, cut: Counter[str], max_len: int, asked: int, new_tokens: int) -> list[str]:
    parts = []
    if task.kind == "generation" and new_tokens < asked:
        parts.append(f"max_new_tokens {asked} capped at {new_tokens}, half the window")
    if cut["prompts"]:
        parts.append(f"{cut['prompts']} of {cut['generations']} prompts (items x formats) cut from the left to their"
                     f" last {max_len - new_tokens} tokens")  # fmt: skip
    if cut["contexts"]:
        parts.append(f"{cut['contexts']} of {cut['choices']} choices (items x choices x formats) scored after a"
                     " context cut from the left")  # fmt: skip
    if cut["continuations"]:
        parts.append(f"{cut['continuations']} choices longer than the window scored on their last {max_len} tokens")
    if not parts:
        return []
    return [f"{task.name}: to fit the model's window of {max_len} tokens: " + "; ".join(parts)]


def _shots(task: Task, index: int) -> list[tuple[str, str, list[str] | None]]:
    return [(s.question, s.answer, s.choices) for s in task.shots(index)]


def _multiple_choice(
    model: Any, tokenizer: Any, task: Task, fmt: PromptFormat, indices: list[int], max_len: int, batch_size: int,
    cut: Counter[str], advance: Callable[[int], None] | None,
) -> list[tuple[bool, ...]]:  # fmt: skip
    from liandan.evaluate.scoring import loglikelihoods

    requests, spans = [], []
    for i in indices:
        item: Item = task.items[i]
        context = fmt.prompt(_shots(task, i), item.question, item.choices)
        first = len(requests)
        for choice in item.choices or []:
            requests.append(_fitted(*split_context(tokenizer, context, fmt.target(choice)), tokenizer, max_len, cut))
        spans.append((first, len(requests)))
    scored = loglikelihoods(model, requests, batch_size=batch_size, max_len=max_len, progress=advance)
    outcomes = []
    for i, (a, b) in zip(indices, spans):
        item = task.items[i]
        lls = [ll for ll, _ in scored[a:b]]
        outcomes.append(multiple_choice_outcome(lls, [len(c) for c in item.choices or []], item.label))
    return outcomes


def _fitted(
    context: list[int], continuation: list[int], tokenizer: Any, max_len: int, cut: Counter[str]
) -> tuple[list[int], list[int]]:
    """A request the scoring takes whatever the window: an empty context is the end-of-document token (as
    lm-eval starts one), a continuation longer than the window keeps its last `max_len` tokens (the rest
    joins the context); `cut` counts what lost tokens (the scoring cuts the context from the left)."""
    context = context or [tokenizer.eos_id]
    if len(continuation) > max_len:
        cut["continuations"] += 1
        context, continuation = [*context, *continuation[:-max_len]], continuation[-max_len:]
    elif len(context) + len(continuation) > max_len + 1:
        cut["contexts"] += 1
    cut["choices"] += 1
    return context, continuation


def _generation(
    model: Any, tokenizer: Any, task: Task, fmt: PromptFormat, indices: list[int], max_len: int, batch_size: int,
    max_new_tokens: int, cut: Counter[str], advance: Callable[[int], None] | None,
) -> list[tuple[bool, ...]]:  # fmt: skip
    from liandan.evaluate.scoring import generate

    room = max_len - max_new_tokens  # the prompt keeps its end: the question being asked
    encoded = tokenizer.encode_batch([fmt.prompt(_shots(task, i), task.items[i].question, None) for i in indices])
    cut["prompts"] += sum(len(ids) > room for ids in encoded)
    cut["generations"] += len(encoded)
    prompts = [ids[-room:] or [tokenizer.eos_id] for ids in encoded]
    stops = [*task.stop, *fmt.stop_strings()]
    stop_ids = [ids for ids in tokenizer.encode_batch(stops) if ids]
    outputs = generate(model, prompts, max_new_tokens=max_new_tokens, stop_sequences=stop_ids,
                       eos_id=tokenizer.eos_id, batch_size=batch_size, progress=advance)  # fmt: skip
    outcomes = []
    for i, ids in zip(indices, outputs):
        text = cut_at_stops(tokenizer.decode(ids), stops)
        predicted = task.extract(text, f"the output for item {i + 1} in format {fmt.name}")
        reference = task.extract(task.items[i].answer, f"the reference answer of item {i + 1}")
        outcomes.append((predicted is not None and predicted == reference,))
    return outcomes


def cut_at_stops(text: str, stops: list[str]) -> str:
    """The text before the first stop string (a stop's tokens may not fall on the generated token boundary)."""
    ends = [text.find(s) for s in stops if s and s in text]
    return text[: min(ends)] if ends else text
