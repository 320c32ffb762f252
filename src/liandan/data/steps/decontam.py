"""Decontamination: drop training documents that contain text from an evaluation set.

    [[steps]]
    name = "decontaminate"
    eval_files = ["eval/gsm8k-test.jsonl"]   # .jsonl: every string field of every record (or `fields`)
    ngram = 13                               # .txt: every non-empty line is one item

Each eval item becomes the set of hashes of its word 13-grams, words being those of
words(normalize_for_matching(item)) as in dedup (so each CJK character is a word). An item of fewer than 13
words is one n-gram of all its words, which matches any run of exactly those words in a training document.
A document sharing any n-gram with an item is dropped with the reason "decontaminate:<eval file stem>".
Items with fewer than `min_item_words` words are left out: a short answer such as "the red one" occurs in
ordinary prose, and dropping every document that contains it would lose data for nothing.

Which items were hit: `stats.changed["<file stem>:<line>"]` counts the documents that contained item(s) of
that line, so the counts add up across parallel tasks like every other step statistic.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from liandan.data.dedup.minhash import ngram_hashes_from_words, word_hashes
from liandan.data.documents.corpus import DataError, Document
from liandan.data.steps.base import Filter, register


class EvalIndex:
    """The n-gram hashes of eval items, one sorted table per n-gram length, each hash with its item."""

    def __init__(self, ngram: int, min_item_words: int) -> None:
        self.ngram = ngram
        self.min_item_words = min_item_words
        self.files: list[str] = []  # stems, by file number
        self.labels: list[str] = []  # "<stem>:<line>", by item number
        self.file_of_item: list[int] = []
        self.tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # length -> (sorted hashes, item numbers)
        self.items_too_short = 0

    @classmethod
    def build(cls, paths: list[str], ngram: int, fields: list[str] | None, min_item_words: int) -> EvalIndex:
        index = cls(ngram, min_item_words)
        parts: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
        for path in map(Path, paths):
            texts, lines = _read_items(path, fields)
            words, offsets = word_hashes(texts)
            counts = np.diff(offsets)
            usable = counts >= min_item_words
            index.items_too_short += int((~usable).sum())
            if not usable.any():
                raise DataError(
                    f"{path}: no eval item has {min_item_words} or more words; nothing to decontaminate against"
                )
            file_number = len(index.files)
            index.files.append(path.stem)
            first_item = len(index.labels)
            for length in np.unique(np.minimum(counts[usable], ngram)).tolist():
                chosen = np.flatnonzero(usable & (np.minimum(counts, ngram) == length))
                word_ranges = [np.arange(offsets[i], offsets[i + 1]) for i in chosen]
                picked = words[np.concatenate(word_ranges)]
                sub_offsets = np.concatenate([[0], np.cumsum(counts[chosen])])
                hashes, per_item = ngram_hashes_from_words(picked, sub_offsets, length)
                items = np.repeat(first_item + chosen, np.diff(per_item))
                parts.setdefault(length, []).append((hashes, items))
            index.labels += [f"{path.stem}:{line}" for line in lines]
            index.file_of_item += [file_number] * len(lines)
        for length, pieces in parts.items():
            hashes = np.concatenate([h for h, _ in pieces])
            items = np.concatenate([i for _, i in pieces])
            order = np.argsort(hashes, kind="stable")
            index.tables[length] = (hashes[order], items[order])
        return index

    def items_in(self, texts: list[str]) -> list[list[int]]:
        """For each text, the numbers of the eval items that share an n-gram with it, ascending."""
        words, offsets = word_hashes(texts)
        found_text, found_item = [], []
        for length, (table, items) in self.tables.items():
            hashes, ngram_offsets = ngram_hashes_from_words(words, offsets, length)
            at = np.minimum(np.searchsorted(table, hashes), len(table) - 1)
            matched = np.flatnonzero(table[at] == hashes)
            if len(matched) == 0:
                continue
            # an n-gram shared by several items fills neighbouring table slots
            lo = np.searchsorted(table, hashes[matched], "left")
            hi = np.searchsorted(table, hashes[matched], "right")
            text = np.searchsorted(ngram_offsets, matched, "right") - 1
            # a text shorter than `length` words has one n-gram of fewer words, matching no item of this table
            for t, a, b in zip(text.tolist(), lo.tolist(), hi.tolist()):
                found_text += [t] * (b - a)
                found_item += items[a:b].tolist()
        hits: list[list[int]] = [[] for _ in texts]
        for t, item in sorted(set(zip(found_text, found_item))):
            hits[t].append(item)
        return hits


def _read_items(path: Path, fields: list[str] | None) -> tuple[list[str], list[int]]:
    """The eval texts of one file and the line each comes from."""
    if not path.is_file():
        raise DataError(f"eval file not found: {path}")
    if path.suffix not in (".jsonl", ".txt"):
        raise DataError(f"unsupported eval file type '{path.suffix}' for {path}; use .jsonl or .txt")
    try:
        # not splitlines(): JSON strings may hold U+2028 and other characters it would split at
        lines = path.read_text(encoding="utf-8").split("\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{path} is not valid UTF-8 (byte {err.start})") from None
    texts, numbers = [], []
    if path.suffix == ".txt":
        for number, line in enumerate(lines, 1):
            if line.strip():
                texts.append(line)
                numbers.append(number)
        return texts, numbers
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: malformed JSON ({err.msg})") from None
        if isinstance(record, str):
            values = [record]
        elif isinstance(record, dict):
            keys = fields if fields is not None else list(record)
            values = [record[k] for k in keys if isinstance(record.get(k), str)]
        else:
            raise DataError(f"{path}:{number}: expected a JSON object or string, found {type(record).__name__}")
        for value in values:
            texts.append(value)
            numbers.append(number)
    if not texts:
        what = f"string fields {fields}" if fields is not None else "string fields"
        raise DataError(f"{path}: no record has {what}; nothing to decontaminate against")
    return texts, numbers


@register
class Decontaminate(Filter):
    """Drops documents sharing a word n-gram with an eval item (see the module doc)."""

    name = "decontaminate"

    def __init__(
        self, eval_files: list[str], ngram: int = 13, fields: list[str] | None = None, min_item_words: int = 8
    ) -> None:
        super().__init__()
        if isinstance(eval_files, str) or not eval_files or not all(isinstance(p, str) for p in eval_files):
            raise ValueError(f"eval_files must be a non-empty list of paths, got {eval_files!r}")
        if fields is not None and (isinstance(fields, str) or not all(isinstance(f, str) for f in fields)):
            raise ValueError(f"fields must be a list of field names, got {fields!r}")
        if ngram < 1 or min_item_words < 1:
            raise ValueError(f"ngram and min_item_words must be at least 1, got {ngram} and {min_item_words}")
        self.index = EvalIndex.build(eval_files, ngram, fields, min(min_item_words, ngram))

    def __call__(self, docs: Iterable[Document]) -> Iterator[Document]:
        # the same as Step.__call__, but hashing a batch of documents at once: numpy pays per call, not per word
        stream = iter(docs)
        while batch := list(itertools.islice(stream, 256)):
            for doc, items in zip(batch, self.index.items_in([d.text for d in batch])):
                self.stats.documents_in += 1
                reason = self._reason(items)
                if reason is None:
                    self.stats.documents_out += 1
                    yield doc
                else:
                    self.drop(doc, reason)

    def check(self, doc: Document) -> str | None:
        return self._reason(self.index.items_in([doc.text])[0])

    def _reason(self, items: list[int]) -> str | None:
        if not items:
            return None
        for label in dict.fromkeys(self.index.labels[i] for i in items):
            self.stats.changed[label] += 1
        return f"{self.name}:{self.index.files[self.index.file_of_item[items[0]]]}"
