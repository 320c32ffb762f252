"""Look at a corpus before training on it: per-source statistics, and flags for what is far from normal.

A loss curve can look fine while the data is broken: at OPT-175B a cleaning step left a flood of stray
backslashes that only a look at the text revealed. `inspect_sources` measures each source (length
distributions, character-class shares, repeated lines and n-grams, duplicates, pipeline drop reasons) and
flags what is far above clean text, far above the other sources of the same report, or far from a previous
report. It writes report.html (self-contained), report.md and report.json (a later run's `baseline`).

Statistics come from a deterministic sample of at most `max_docs_per_source` documents per source: seeded
reservoir sampling, so a sorted corpus is not judged by its head.
"""

from __future__ import annotations

import itertools
import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from liandan.config import ConfigError
from liandan.data.documents.corpus import DataError, Document, ReadStats
from liandan.data.documents.text import CJK_CLASS, normalize_for_matching, words
from liandan.data.inspect.charclass import CHAR_CLASSES, count_char_classes, members, visible
from liandan.data.inspect.language_share import language_flags, language_shares
from liandan.data.steps.base import StepStats

REPORT_FORMAT = "liandan-inspect"
REPORT_VERSION = 1
PERCENTILES = (1, 5, 25, 50, 75, 95, 99)
# 3-grams show phrasing habits and templates; 13-grams (the unit of GPT-3's contamination checks) show
# passages copied between documents.
NGRAM_SIZES = (3, 13)
TOP_K = 20


@dataclass(frozen=True)
class Thresholds:
    """When a statistic becomes a flag. The defaults keep clean books, encyclopedia text and classical
    Chinese free of flags while catching a few percent of corrupted documents."""

    # A class share is "far above" clean text at `reference_ratio` x its usual share (classes that are rare in
    # clean text) or `reference_margin` above it (common classes, where 10x would exceed 100%), whichever
    # comes first, and never below `share_floor` nor on fewer than `min_occurrences` characters.
    reference_ratio: float = 10.0
    reference_margin: float = 0.25
    share_floor: float = 1e-5
    min_occurrences: int = 10
    min_cased_letters: int = 1000  # an uppercase share over fewer letters says nothing
    # Above clean text's usual share and `peer_ratio` x the median of the other sources in the report.
    peer_ratio: float = 10.0
    # One line making up more than this share of all non-empty lines.
    line_share: float = 0.05
    # A line of at least `boilerplate_min_words` words in more than this share of documents. Shorter lines
    # (headings, speaker names) repeat legitimately and are only caught by `line_share`.
    boilerplate_doc_share: float = 0.10
    boilerplate_min_words: int = 3
    boilerplate_min_docs: int = 5
    short_doc_words: int = 5
    short_doc_share: float = 0.30
    empty_doc_share: float = 0.01
    duplicate_share: float = 0.30
    # Against a baseline report: a class share changing by more than this factor, a median length by more
    # than `length_shift_ratio`, the duplicate share by more than `duplicate_shift` (absolute).
    shift_ratio: float = 3.0
    length_shift_ratio: float = 1.5
    duplicate_shift: float = 0.10
    # Against a source's expected languages (see liandan/data/inspect/language_share.py).
    unexpected_language_share: float = 0.05
    expected_language_share: float = 0.90
    expected_language_min_share: float = 0.01
    # Per-class replacements of the built-in usual shares (e.g. {"markup": 0.05} for a source of HTML).
    reference: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "reference" and not value >= 0:
                raise ConfigError(f"inspection threshold {name} must be >= 0, got {value}")
        known = {c.name for c in CHAR_CLASSES if c.usual is not None}
        for name in self.reference:
            if name not in known:
                raise ConfigError(
                    f"no character class '{name}' to set a reference for; known: {', '.join(sorted(known))}"
                )

    def usual(self, class_name: str) -> float | None:
        base = next(c.usual for c in CHAR_CLASSES if c.name == class_name)
        return self.reference.get(class_name, base)

    def class_limit(self, class_name: str) -> float:
        usual = self.usual(class_name)
        return max(min(usual * self.reference_ratio, usual + self.reference_margin), self.share_floor)


@dataclass
class Anomaly:
    source: str
    kind: str  # char_class, char_class_vs_sources, repeated_line, boilerplate_line, repeated_ngram, ...
    message: str
    value: float
    expected: tuple[float, float | None]  # the range the value was expected in (None: unbounded)
    statistic: str = ""
    example: str = ""

    def line(self) -> str:
        """The flag as the console and a pipeline's summary say it: the source, then what was found."""
        return f"{self.source}: {self.message}"


@dataclass
class InspectionReport:
    flags: list[Anomaly]
    paths: dict[str, Path]  # html, markdown, json
    data: dict[str, Any]  # everything in report.json

    def flags_for(self, source: str) -> list[Anomaly]:
        return [f for f in self.flags if f.source == source]


def inspect_sources(
    sources: dict[str, Iterable[Document]],
    out_dir: Path,
    *,
    step_stats: list[dict] | None = None,
    dedup_stats: dict | None = None,
    tokenizer=None,
    baseline: Path | None = None,
    max_docs_per_source: int = 20000,
    thresholds: Thresholds | None = None,
    seed: int = 0,
    read_stats: dict[str, ReadStats] | None = None,
    expected_languages: dict[str, list[str]] | None = None,
) -> InspectionReport:
    """Measure each source, flag anomalies and write report.html/.md/.json into `out_dir`. `read_stats`: the
    readers' counts per source, filled while the sources are read; their skipped records go into the report.
    `expected_languages`: per source, the languages it should hold (flagged when others take a share)."""
    from liandan.data.inspect.report import write_reports  # rendering pulls in matplotlib; keep it off this import

    thresholds = thresholds or Thresholds()
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"report directory {out_dir} exists and is not a directory")
    if not sources:
        raise DataError("no sources to inspect")
    if max_docs_per_source < 1:
        raise ConfigError(f"max_docs_per_source must be >= 1, got {max_docs_per_source}")
    steps = [_checked_step(raw) for raw in step_stats or []]
    old = load_baseline(Path(baseline)) if baseline is not None else None
    expected_languages = expected_languages or {}
    stats = {
        name: source_statistics(
            name, docs, thresholds, tokenizer, max_docs_per_source, seed, expected_languages.get(name, [])
        )
        for name, docs in sources.items()
    }
    for name, counts in (read_stats or {}).items():
        if name in stats:
            stats[name]["records_skipped"] = dict(sorted(counts.skipped.items()))
    flags = find_anomalies(stats, thresholds, old)
    data = {
        "format": REPORT_FORMAT,
        "version": REPORT_VERSION,
        "settings": {
            "max_docs_per_source": max_docs_per_source,
            "seed": seed,
            "thresholds": asdict(thresholds),
            "class_limits": {c.name: thresholds.class_limit(c.name) for c in CHAR_CLASSES if c.usual is not None},
        },
        "baseline": str(baseline) if baseline is not None else None,
        "flags": [asdict(f) for f in flags],
        "sources": stats,
        "steps": steps,
        "dedup": dedup_stats,
    }
    paths = write_reports(data, out_dir)
    return InspectionReport(flags, paths, data)


def load_baseline(path: Path) -> dict[str, Any]:
    """A report.json written by an earlier inspection."""
    if not path.is_file():
        raise DataError(f"baseline report not found: {path}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise DataError(f"baseline {path} is not a JSON report: {err}") from None
    if not isinstance(data, dict) or data.get("format") != REPORT_FORMAT or not isinstance(data.get("sources"), dict):
        raise DataError(f"baseline {path} is not a report.json written by `liandan data inspect`")
    return data


def _checked_step(raw: dict) -> dict:
    try:
        return StepStats.from_dict(raw).to_dict()
    except (KeyError, TypeError, ValueError) as err:
        raise DataError(
            f"step statistics need name, documents_in/out, dropped and changed; got {raw!r} ({err})"
        ) from None


# ---------------------------------------------------------------------------------------------- statistics


def sample_documents(docs: Iterable[Document], limit: int, rng: random.Random) -> tuple[list[Document], int]:
    """At most `limit` documents (reservoir sampling, original order kept) and how many there were."""
    kept: list[tuple[int, Document]] = []
    seen = 0
    for seen, doc in enumerate(docs, 1):
        if not isinstance(getattr(doc, "text", None), str):
            raise DataError(f"expected documents with a text, got {type(doc).__name__} at position {seen}")
        if len(kept) < limit:
            kept.append((seen, doc))
        else:
            slot = rng.randrange(seen)
            if slot < limit:
                kept[slot] = (seen, doc)
    kept.sort(key=lambda pair: pair[0])
    return [doc for _, doc in kept], seen


def source_statistics(
    name, docs, thresholds: Thresholds, tokenizer, limit: int, seed: int, expected_languages: list[str] = ()
) -> dict[str, Any]:
    sample, total = sample_documents(docs, limit, random.Random(f"{seed}:{name}"))
    texts = [d.text for d in sample]
    word_counts, word_ids, id_to_word = _words_and_ids(texts)
    stats: dict[str, Any] = {
        "documents": total,
        "sampled": len(sample),
        "characters": sum(map(len, texts)),
        "lengths": {"characters": distribution([len(t) for t in texts]), "words": distribution(word_counts)},
        "languages": language_shares(sample, identify=bool(expected_languages)),
        "languages_expected": [language.lower() for language in expected_languages],
        "char_classes": count_char_classes(texts, [d.doc_id for d in sample]),
        "lines": _line_statistics(texts, thresholds),
        "ngrams": {str(n): top_ngrams(word_ids, word_counts, id_to_word, n) for n in NGRAM_SIZES},
        "documents_short": int(sum(c < thresholds.short_doc_words for c in word_counts)),
        "documents_empty": sum(not t.strip() for t in texts),
        "duplicates": _duplicates(texts),
    }
    if tokenizer is not None:
        token_counts = [len(ids) for i in range(0, len(texts), 512) for ids in _encode(tokenizer, texts[i : i + 512])]
        stats["lengths"]["tokens"] = distribution(token_counts)
    return stats


_SURROGATE = re.compile("[\ud800-\udfff]")


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    try:
        return tokenizer.encode_batch(texts)
    except (UnicodeEncodeError, TypeError):  # a lone surrogate (HF tokenizers raise TypeError): encode it as
        # the replacement character it becomes in any UTF-8 file; a retry that fails again raises
        return tokenizer.encode_batch([_SURROGATE.sub("\ufffd", t) for t in texts])


def distribution(values: list[int], bins: int = 30) -> dict[str, Any]:
    """Percentiles and a log-spaced histogram (lengths span orders of magnitude)."""
    if not values:
        return {"count": 0}
    arr = np.asarray(values, dtype=np.float64)
    low = max(arr.min(), 1.0)
    edges = np.geomspace(low, max(arr.max(), low * 2) * 1.001, bins + 1)
    counts, _ = np.histogram(np.clip(arr, 1.0, None), bins=edges)
    out = {"count": len(values), "mean": _round(arr.mean()), "min": int(arr.min()), "max": int(arr.max())}
    out.update({f"p{p}": _round(v) for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES))})
    out["histogram"] = {"edges": [_round(e) for e in edges], "counts": counts.tolist()}
    return out


def _round(x: float) -> float:
    return float(f"{float(x):.6g}")


def _words_and_ids(texts: list[str]) -> tuple[list[int], np.ndarray, list[str]]:
    """Word count per document, and every document's words as ids of their lower-cased forms."""
    vocab: defaultdict[str, int] = defaultdict()
    vocab.default_factory = vocab.__len__  # an unseen word gets the next id, without a Python-level loop
    counts, ids = [], []
    for text in texts:
        doc_words = words(text)
        counts.append(len(doc_words))
        ids.extend(map(vocab.__getitem__, doc_words))
    lower: dict[str, int] = {}
    to_lower = np.array([lower.setdefault(w.lower(), len(lower)) for w in vocab], dtype=np.uint64)
    word_ids = to_lower[np.asarray(ids, dtype=np.int64)] if ids else np.zeros(0, dtype=np.uint64)
    return counts, word_ids, list(lower)


def top_ngrams(word_ids: np.ndarray, word_counts: list[int], id_to_word: list[str], n: int) -> list[dict]:
    """The most repeated word n-grams within documents (64-bit hashes counted with numpy), with how many
    documents hold each."""
    span = len(word_ids) - n + 1
    if span <= 0:
        return []
    doc_of = np.repeat(np.arange(len(word_counts)), word_counts)
    starts = np.flatnonzero(doc_of[:span] == doc_of[n - 1 :])  # n-grams that stay inside one document
    if not starts.size:
        return []
    mixed = _mix64(word_ids + np.uint64(1))
    hashes = np.zeros(len(starts), dtype=np.uint64)
    for offset in range(n):
        hashes = hashes * np.uint64(0x100000001B3) + mixed[starts + offset]
    ordered = np.sort(hashes)
    is_new = np.concatenate(([True], ordered[1:] != ordered[:-1]))
    unique = ordered[is_new]
    counts = np.diff(np.append(np.flatnonzero(is_new), len(ordered)))
    # Candidates: every n-gram at least as frequent as the TOP_K-th, then ranked by count and first position.
    cutoff = max(np.partition(counts, -TOP_K)[-TOP_K] if len(counts) > TOP_K else counts.min(), 2)
    candidates = unique[counts >= cutoff]
    if candidates.size > 50 * TOP_K:  # a sea of ties (every n-gram twice): keep the first by hash value
        candidates = candidates[np.argsort(-counts[counts >= cutoff], kind="stable")[: 50 * TOP_K]]
    chosen = np.flatnonzero(np.isin(hashes, candidates))
    ranked = []
    for h in candidates:
        at = chosen[hashes[chosen] == h]
        ranked.append((-at.size, int(at[0]), int(np.unique(doc_of[starts[at]]).size)))
    top = []
    for negative_count, first, n_docs in sorted(ranked)[:TOP_K]:
        start = starts[first]
        top.append(
            {
                "ngram": join_words([id_to_word[w] for w in word_ids[start : start + n]]),
                "count": -negative_count,
                "documents": n_docs,
            }
        )
    return top


def _mix64(x: np.ndarray) -> np.ndarray:
    """A bijective scramble of 64-bit ids (splitmix64's finalizer), so that small ids hash well."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


_CJK_WORD = re.compile(f"^[{CJK_CLASS}]$")


def join_words(ws: list[str]) -> str:
    """Words back to readable text: CJK characters without spaces between them, other words with one."""
    out = ws[0] if ws else ""
    for prev, word in itertools.pairwise(ws):
        out += word if _CJK_WORD.match(prev) and _CJK_WORD.match(word) else " " + word
    return out


def _line_statistics(texts: list[str], thresholds: Thresholds) -> dict[str, Any]:
    line_counts: Counter = Counter()
    line_docs: Counter = Counter()
    for text in texts:
        lines = [s for s in (line.strip() for line in text.splitlines()) if s]
        line_counts.update(lines)
        line_docs.update(set(lines))
    need = max(thresholds.boilerplate_min_docs, 2)
    frequent = sorted(((line, n) for line, n in line_docs.items() if n >= need), key=lambda pair: -pair[1])
    boilerplate = [
        {"line": line[:500], "documents": n, "count": line_counts[line]}
        for line, n in frequent
        if len(words(line)) >= thresholds.boilerplate_min_words
    ]
    top = [
        {"line": line[:500], "count": n, "documents": line_docs[line]}
        for line, n in line_counts.most_common(TOP_K)
        if n > 1
    ]
    return {"total": sum(line_counts.values()), "top": top, "boilerplate": boilerplate[:TOP_K]}


def _duplicates(texts: list[str]) -> dict[str, Any]:
    """Exact duplicates after the same normalization the dedup step uses."""
    hashes = [xxhash.xxh3_64_intdigest(normalize_for_matching(t).encode("utf-8", "surrogatepass")) for t in texts]
    extra = len(hashes) - len(set(hashes))
    return {"exact_duplicates": extra, "share": _round(extra / len(texts)) if texts else 0.0}


# ------------------------------------------------------------------------------------------------- flags


def find_anomalies(stats: dict[str, dict], thresholds: Thresholds, baseline: dict | None = None) -> list[Anomaly]:
    flags: list[Anomaly] = []
    for name, source in stats.items():
        if source["sampled"] == 0:
            flags.append(Anomaly(name, "no_documents", f"{name}: no documents", 0.0, (1.0, None), "documents"))
            continue
        others = [s for other, s in stats.items() if other != name and s["sampled"]]
        flags += _class_flags(name, source, others, thresholds)
        line_flags = _line_flags(name, source, thresholds)
        flags += line_flags + _ngram_flags(name, source, [f.example for f in line_flags], thresholds)
        flags += _document_flags(name, source, thresholds)
        expected = source.get("languages_expected") or []
        flags += [Anomaly(name, **f) for f in language_flags(source["languages"], expected, thresholds)]
        if baseline is not None and name in baseline["sources"]:
            flags += _shift_flags(name, source, baseline["sources"][name], thresholds)
    return flags


def fmt_share(x: float) -> str:
    return f"{x * 100:.3g}%"


def _class_flags(name: str, source: dict, others: list[dict], t: Thresholds) -> list[Anomaly]:
    flags = []
    for cls in CHAR_CLASSES:
        if cls.usual is None:
            continue
        c = source["char_classes"][cls.name]
        if c["count"] < t.min_occurrences or (cls.name == "uppercase" and c["of"] < t.min_cased_letters):
            continue
        share, usual, limit = c["share"], t.usual(cls.name), t.class_limit(cls.name)
        detail = _class_detail(c)
        if share > limit:
            kind, expected = "char_class", (0.0, limit)
            why = f"expected ≤ {fmt_share(limit)}; clean text stays below {fmt_share(usual)}"
        else:
            peers = [
                o["char_classes"][cls.name]["share"]
                for o in others
                if cls.name != "uppercase" or o["char_classes"][cls.name]["of"] >= t.min_cased_letters
            ]
            peer_limit = t.peer_ratio * max(float(np.median(peers)), t.share_floor) if peers else float("inf")
            if not (share > usual and share > peer_limit):
                continue
            kind, expected = "char_class_vs_sources", (0.0, peer_limit)
            why = f"{t.peer_ratio:g}x the median of the other sources is {fmt_share(peer_limit)}"
        message = (
            f"{cls.name} ({cls.description}): {fmt_share(share)} of {c['denominator']} ({why}); "
            f"in {fmt_share(c['doc_share'])} of documents"
        )
        flags.append(Anomaly(name, kind, message + detail, share, expected, f"{cls.name} share", _example(c)))
    return flags


def _class_detail(c: dict) -> str:
    top = members(c["top"])
    return f"; most frequent: {top}" if top else ""


def _example(c: dict) -> str:
    ex = c.get("example")
    return f"{ex['doc_id']}: {visible(ex['snippet'])}" if ex else ""


def _line_flags(name: str, source: dict, t: Thresholds) -> list[Anomaly]:
    flags = []
    lines, docs = source["lines"], source["sampled"]
    for e in lines["top"]:
        share = e["count"] / max(lines["total"], 1)
        if share > t.line_share and e["count"] >= t.min_occurrences:
            what = f"one line is {fmt_share(share)} of all lines ({e['count']} times, in {e['documents']} documents)"
            flags.append(Anomaly(name, "repeated_line", what, share, (0.0, t.line_share), "line share", e["line"]))
    flagged = {f.example for f in flags}
    for e in lines["boilerplate"]:
        share = e["documents"] / docs
        if share > t.boilerplate_doc_share and e["documents"] >= t.boilerplate_min_docs and e["line"] not in flagged:
            what = f"boilerplate line in {fmt_share(share)} of documents ({e['documents']} of {docs})"
            limit = (0.0, t.boilerplate_doc_share)
            flags.append(Anomaly(name, "boilerplate_line", what, share, limit, "documents with line", e["line"]))
    return flags


def _squash(text: str) -> str:
    return "".join(words(text.lower()))


def _ngram_flags(name: str, source: dict, flagged_lines: list[str], t: Thresholds) -> list[Anomaly]:
    """The longest n-gram found in too many documents, unless a flagged line already explains it."""
    n, docs = max(NGRAM_SIZES), source["sampled"]
    covered = [_squash(line) for line in flagged_lines]
    over = [
        e
        for e in source["ngrams"][str(n)]
        if e["documents"] / docs > t.boilerplate_doc_share and e["documents"] >= t.boilerplate_min_docs
        and not any(_squash(e["ngram"]) in line for line in covered)
    ]  # fmt: skip
    if not over:
        return []
    top = max(over, key=lambda e: e["documents"])
    share = top["documents"] / docs
    what = f"a {n}-gram repeats in {fmt_share(share)} of documents ({len(over)} such among the most repeated)"
    limit = (0.0, t.boilerplate_doc_share)
    return [Anomaly(name, "repeated_ngram", what, share, limit, f"documents with {n}-gram", top["ngram"])]


def _document_flags(name: str, source: dict, t: Thresholds) -> list[Anomaly]:
    docs = source["sampled"]
    rules = [
        ("empty_documents", source["documents_empty"] / docs, t.empty_doc_share, "of documents are empty"),
        ("short_documents", source["documents_short"] / docs, t.short_doc_share,
         f"of documents have fewer than {t.short_doc_words} words"),
        ("duplicates", source["duplicates"]["share"], t.duplicate_share,
         "of sampled documents are exact duplicates of another"),
    ]  # fmt: skip
    return [
        Anomaly(name, kind, f"{fmt_share(value)} {what}", value, (0.0, limit), kind.replace("_", " "))
        for kind, value, limit, what in rules
        if value > limit
    ]


def _shift_flags(name: str, new: dict, old: dict, t: Thresholds) -> list[Anomaly]:
    flags, floor = [], t.share_floor
    for cls in CHAR_CLASSES:
        a, b = old.get("char_classes", {}).get(cls.name), new["char_classes"][cls.name]
        if a is None or (cls.name == "uppercase" and min(a["of"], b["of"]) < t.min_cased_letters):
            continue
        # The floor keeps a class going from 0 to a trace from counting as an infinite change.
        ratio = (max(a["share"], b["share"]) + floor) / (min(a["share"], b["share"]) + floor)
        if ratio > t.shift_ratio:
            expected = (
                max((a["share"] + floor) / t.shift_ratio - floor, 0.0),
                (a["share"] + floor) * t.shift_ratio - floor,
            )
            what = f"{cls.name} share moved from {fmt_share(a['share'])} to {fmt_share(b['share'])} since the baseline"
            what += _class_detail(b)
            flags.append(Anomaly(name, "baseline_shift", what, b["share"], expected, f"{cls.name} share", _example(b)))
    for unit, now in new["lengths"].items():
        before = old.get("lengths", {}).get(unit, {})
        if "p50" not in before or "p50" not in now:
            continue
        ratio = (max(before["p50"], now["p50"]) + 1) / (min(before["p50"], now["p50"]) + 1)
        if ratio > t.length_shift_ratio:
            expected = (before["p50"] / t.length_shift_ratio, before["p50"] * t.length_shift_ratio)
            what = f"median length in {unit} moved from {before['p50']:g} to {now['p50']:g} since the baseline"
            flags.append(Anomaly(name, "baseline_shift", what, now["p50"], expected, f"median {unit}"))
    before, now = old.get("duplicates", {}).get("share"), new["duplicates"]["share"]
    if before is not None and abs(now - before) > t.duplicate_shift:
        expected = (max(before - t.duplicate_shift, 0.0), before + t.duplicate_shift)
        what = f"duplicate share moved from {fmt_share(before)} to {fmt_share(now)} since the baseline"
        flags.append(Anomaly(name, "baseline_shift", what, now, expected, "duplicate share"))
    return flags
