"""Contamination: which evaluation items appear in the training stores, by word n-gram overlap.

The same test as the pipeline's decontamination step (`liandan.data.steps.decontam.EvalIndex`: word 13-grams of
the normalised text, each CJK character a word; an item shorter than 13 words matches as a whole): an item
is contaminated when its question or its reference answer shares an n-gram with any training document. The
stores hold tokens, so documents are decoded back to text first. Reported beside the scores: a task whose
items the model has read measures memory, not skill. A task none of whose items is long enough to match (a
few words each) is not checked, and says so.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.data.documents.corpus import DataError
from liandan.data.steps.decontam import EvalIndex
from liandan.evaluate.tasks import Task

DOCUMENTS_PER_BATCH = 256


@dataclass
class Overlap:
    task: str
    source: str
    items: int
    contaminated: int
    ngram: int
    skipped: str = ""  # why the task was not checked ("" when it was)

    @property
    def fraction(self) -> float:
        return self.contaminated / self.items if self.items else 0.0

    def event(self) -> dict[str, Any]:
        """The "eval_contamination" event's fields."""
        fields = {"task": self.task, "source": self.source, "items": self.items, "contaminated": self.contaminated,
                  "fraction": self.fraction, "ngram": self.ngram}  # fmt: skip
        return {**fields, "skipped": self.skipped} if self.skipped else fields

    def line(self) -> str:
        if self.skipped:
            return f"contamination {self.task}: not checked: {self.skipped}"
        return (f"contamination {self.task} in {self.source}: {self.contaminated}/{self.items} items"
                f" ({100 * self.fraction:.1f}%) share a {self.ngram}-gram")  # fmt: skip


def task_index(task: Task, limit: int, ngram: int, min_item_words: int) -> tuple[EvalIndex | None, int]:
    """The decontamination index of the task's first `limit` items (0: all) and how many items that is; no
    index when no item has the words to match."""
    items = task.items[:limit] if limit else task.items
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{task.name}.jsonl"
        with path.open("w", encoding="utf-8") as out:
            for item in items:  # line n+1 is item n
                out.write(json.dumps({"question": item.question, "answer": item.answer}, ensure_ascii=False) + "\n")
        try:
            return EvalIndex.build([str(path)], ngram, None, min(min_item_words, ngram)), len(items)
        except DataError:  # every item too short to match: the file is ours, so nothing else can be wrong with it
            return None, len(items)


def store_texts(store: Any, tokenizer: Any):
    """Every document of a token store decoded back to text, in batches."""
    batch: list[str] = []
    for shard in store.shards:
        starts = shard.doc_starts
        for doc in range(shard.num_documents):
            batch.append(tokenizer.decode(shard.tokens[starts[doc] : starts[doc + 1]].tolist()))
            if len(batch) == DOCUMENTS_PER_BATCH:
                yield batch
                batch = []
    if batch:
        yield batch


def overlaps(
    tasks: list[Task], stores: list[Any], tokenizer: Any, *, limit: int = 0, ngram: int = 13, min_item_words: int = 8
) -> list[Overlap]:
    """For each task and store, how many of the task's items share an n-gram with a document of the store; a
    task with no item of `min_item_words` words (or `ngram`, when fewer) is one Overlap that says it was
    not checked."""
    words = min(min_item_words, ngram)
    indexes, found = [], []
    for task in tasks:
        index, n_items = task_index(task, limit, ngram, min_item_words)
        if index is None:
            reason = f"no item has {words} or more words, too few for an n-gram match"
            found.append(Overlap(task.name, "", n_items, 0, ngram, skipped=reason))
        else:
            indexes.append((task, index, n_items))
    for store in stores if indexes else []:
        hit: list[set[str]] = [set() for _ in indexes]
        for texts in store_texts(store, tokenizer):
            for slot, (_, index, _) in enumerate(indexes):
                for items in index.items_in(texts):
                    hit[slot].update(index.labels[i] for i in items)
        for slot, (task, _, n_items) in enumerate(indexes):
            found.append(Overlap(task.name, store.name, n_items, len(hit[slot]), ngram))
    return found
