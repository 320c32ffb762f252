"""The small base of every pipeline step: a stream of documents in, a stream out, with counts and the reason
for every document dropped.

A `Filter` answers "why drop this?" (a short reason, or None to keep); a `Transform` rewrites a document and
counts what it changed. Steps are plug-ins of kind "data_step" (`liandan.plugins`), found by name so a
pipeline TOML can list them:

    [[steps]]
    name = "gopher_quality"
    min_words = 50

Each option is checked against the annotation of the constructor's parameter before the step is built
(`liandan.data.steps.options`): a string where true/false or a list is expected is an error, not a truthy value
or a list of letters. Where an option may be None, `false` stands for it (TOML has no null).

Every dropped document is handed to `on_drop` (the pipeline writes them to a rejects file), so nothing
vanishes without a record.
"""

from __future__ import annotations

import inspect
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

from liandan import plugins
from liandan.config import ConfigError
from liandan.data.documents.corpus import Document
from liandan.data.steps.options import check_options


@dataclass
class StepStats:
    name: str
    documents_in: int = 0
    documents_out: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> documents
    changed: Counter = field(default_factory=Counter)  # what a transform changed -> documents

    def merge(self, other: StepStats) -> StepStats:
        self.documents_in += other.documents_in
        self.documents_out += other.documents_out
        self.dropped.update(other.dropped)
        self.changed.update(other.changed)
        return self

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "documents_in": self.documents_in,
            "documents_out": self.documents_out,
            "dropped": dict(sorted(self.dropped.items())),
            "changed": dict(sorted(self.changed.items())),
        }

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> StepStats:
        return cls(
            raw["name"], raw["documents_in"], raw["documents_out"], Counter(raw["dropped"]), Counter(raw["changed"])
        )

    def summary(self) -> str:
        drops = ", ".join(f"{n} {why}" for why, n in self.dropped.most_common()) or "none dropped"
        return f"{self.name}: {self.documents_in} in, {self.documents_out} out ({drops})"


def merge_step_stats(per_task: list[list[dict[str, Any]]]) -> list[StepStats]:
    """The statistics of each step summed over tasks (each task's list in step order, as `to_dict` writes it)."""
    merged: list[StepStats] = []
    for steps in per_task:
        for i, raw in enumerate(steps):
            stats = StepStats.from_dict(raw)
            if i == len(merged):
                merged.append(stats)
            else:
                merged[i].merge(stats)
    return merged


DropHandler = Callable[[Document, str, str], None]  # (document, step name, reason)


class Step:
    """Base of all steps. Subclasses set `name` and implement `apply`."""

    name: ClassVar[str] = "step"

    def __init__(self) -> None:
        self.stats = StepStats(self.name)
        self.on_drop: DropHandler | None = None

    def apply(self, doc: Document) -> Document | None:
        """The document to pass on, or None after calling `self.drop(doc, reason)`."""
        raise NotImplementedError

    def drop(self, doc: Document, reason: str) -> None:
        self.stats.dropped[reason] += 1
        if self.on_drop is not None:
            self.on_drop(doc, self.name, reason)

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        for doc in docs:
            self.stats.documents_in += 1
            out = self.apply(doc)
            if out is not None:
                self.stats.documents_out += 1
                yield out


class Filter(Step):
    """Keeps or drops each document; `check` says why it should go."""

    def check(self, doc: Document) -> str | None:
        raise NotImplementedError

    def apply(self, doc: Document) -> Document | None:
        reason = self.check(doc)
        if reason is None:
            return doc
        self.drop(doc, reason)
        return None


class Transform(Step):
    """Rewrites each document; records what it changed with `self.stats.changed[what] += 1`."""

    def transform(self, doc: Document) -> Document:
        raise NotImplementedError

    def apply(self, doc: Document) -> Document | None:
        out = self.transform(doc)
        if not out.text.strip():
            self.drop(out, "empty after " + self.name)
            return None
        return out


def register(cls: type[Step]) -> type[Step]:
    """Class decorator: make a step available to pipeline configs under `cls.name` (a step outside liandan; the
    built-in ones are listed in `liandan.plugins.BUILTIN` and imported when a pipeline names them)."""
    plugins.register_object("data_step", cls.name, cls)
    return cls


def step_class(name: str) -> type[Step]:
    """The step class registered as `name`, its module imported on first use."""
    try:
        return plugins.find("data_step", name, what="steps.name").load()
    except plugins.PluginError as err:
        raise ConfigError(str(err)) from None


def build_step(spec: dict[str, Any]) -> Step:
    """A step from its config table: `name` picks the class, the other keys are its keyword arguments, each
    checked against the constructor's annotations."""
    spec = dict(spec)
    name = str(spec.pop("name", ""))
    cls = step_class(name)
    params = inspect.signature(cls.__init__).parameters
    allowed = [p for p in params if p != "self"]
    for key in spec:
        if key not in allowed:
            raise ConfigError(f"step '{name}' has no option '{key}'; options: {', '.join(allowed) or 'none'}")
    options = check_options(name, cls, spec)
    try:
        return cls(**options)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"step '{name}': {err}") from None
