"""Heuristic quality filters from published pretraining corpora, with the published thresholds as defaults.

- gopher_quality, gopher_repetition: MassiveText (Rae et al. 2021, "Scaling Language Models: Methods, Analysis
  & Insights from Training Gopher", appendix A.1.1 and table A1).
- c4_quality: C4 (Raffel et al. 2020, section 2.2): keeps only lines that look like sentences, then drops the
  page if too little is left. Unlike the others it rewrites the text it keeps.
- fineweb_quality: the extra line-level rules of FineWeb (Penedo et al. 2024).

Every rule is an option; setting it to None (or false) switches that rule off. Drop reasons are stable keys
("gopher_quality:mean_word_length") so counts add up across shards; the numbers stay out of them.

Words are `liandan.data.documents.text.words`, so each CJK character is a word. Rules that only make sense for
space-separated languages (mean word length, English stop words) are skipped for mostly-CJK text, CJK
sentence punctuation (。！？…」』) ends a line as "." does, and a CJK character counts three characters
wide when a rule measures line length, because it carries about what three Latin letters do.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import numpy as np

from liandan.data.documents.corpus import Document
from liandan.data.documents.text import CJK_CLASS, is_mostly_cjk, words
from liandan.data.steps.base import Filter, register
from liandan.data.steps.options import check_range

TERMINAL_PUNCTUATION = (".", "!", "?", '"', "”", "。", "！", "？", "…", "」", "』", "．", "｡")
BULLETS = ("•", "‣", "⁃", "◦", "▪", "●", "○", "■", "□", "►", "➢", "–", "-", "*", "·")
ELLIPSES = ("...", "…")
GOPHER_STOP_WORDS = ("the", "be", "to", "of", "and", "that", "have", "with")

# CJK characters, CJK punctuation and full-width forms: three characters wide for line-length rules.
_WIDE = re.compile(f"[{CJK_CLASS}\u3000-\u303f\uff00-\uffef]")
_WIDE_CHAR_WEIGHT = 3
_PARAGRAPH_BREAK = re.compile(r"\n[ \t]*\n")
_NO_LETTER = re.compile(r"[\d_]+")  # a word (letter/digit run) with no letter in it


def _on(threshold: Any) -> bool:
    """Whether a rule is switched on: None and False switch it off (0 is a real threshold)."""
    return threshold is not None and threshold is not False


def _check_limits(fractions: dict[str, Any], non_negative: dict[str, Any]) -> None:
    """Shares (of lines, words, characters) lie in [0, 1]; counts, lengths and per-word ratios are >= 0."""
    for option, value in fractions.items():
        check_range(option, value, 0, 1)
    for option, value in non_negative.items():
        check_range(option, value, 0)


def _check_order(low: str, low_value: Any, high: str, high_value: Any) -> None:
    if _on(low_value) and _on(high_value) and low_value > high_value:
        raise ValueError(f"{low} = {low_value} is above {high} = {high_value}: every document would be dropped")


def nonblank_lines(text: str) -> list[str]:
    return [line for line in text.split("\n") if line.strip()]


def line_width(line: str) -> int:
    """Length of a line with CJK characters counted three wide."""
    return len(line) if line.isascii() else len(line) + (_WIDE_CHAR_WEIGHT - 1) * len(_WIDE.findall(line))


def repeats(items: Iterable[str]) -> tuple[int, int]:
    """(how many items repeat an earlier one, how many characters those repeats hold)."""
    seen: set[str] = set()
    count = chars = 0
    for item in items:
        if item in seen:
            count += 1
            chars += len(item)
        else:
            seen.add(item)
    return count, chars


# --- Gopher ----------------------------------------------------------------------------------------------------


@register
class GopherQuality(Filter):
    """Gopher's quality rules (Rae et al. 2021): length, word shape, symbols, bullets, ellipses, stop words."""

    name = "gopher_quality"

    def __init__(
        self,
        min_words: int | None = 50,
        max_words: int | None = 100_000,
        min_mean_word_length: float | None = 3,
        max_mean_word_length: float | None = 10,
        max_symbol_word_ratio: float | None = 0.1,
        max_bullet_lines: float | None = 0.9,
        max_ellipsis_lines: float | None = 0.3,
        min_alphabetic_words: float | None = 0.8,
        min_stop_words: int | None = 2,
        stop_words: list[str] = list(GOPHER_STOP_WORDS),  # noqa: B006 - never mutated
    ):
        super().__init__()
        _check_limits(
            {"max_bullet_lines": max_bullet_lines, "max_ellipsis_lines": max_ellipsis_lines,
             "min_alphabetic_words": min_alphabetic_words},
            {"min_words": min_words, "max_words": max_words, "min_mean_word_length": min_mean_word_length,
             "max_mean_word_length": max_mean_word_length, "max_symbol_word_ratio": max_symbol_word_ratio,
             "min_stop_words": min_stop_words},
        )  # fmt: skip
        _check_order("min_words", min_words, "max_words", max_words)
        _check_order("min_mean_word_length", min_mean_word_length, "max_mean_word_length", max_mean_word_length)
        self.min_words, self.max_words = min_words, max_words
        self.min_mean_word_length, self.max_mean_word_length = min_mean_word_length, max_mean_word_length
        self.max_symbol_word_ratio = max_symbol_word_ratio
        self.max_bullet_lines, self.max_ellipsis_lines = max_bullet_lines, max_ellipsis_lines
        self.min_alphabetic_words = min_alphabetic_words
        self.min_stop_words = min_stop_words
        self.stop_words = frozenset(w.lower() for w in stop_words)

    def check(self, doc: Document) -> str | None:
        text = doc.text
        tokens = words(text)
        n = len(tokens)
        if _on(self.min_words) and n < self.min_words:
            return "gopher_quality:too_few_words"
        if _on(self.max_words) and n > self.max_words:
            return "gopher_quality:too_many_words"
        if n == 0:
            return "gopher_quality:no_words"
        cjk = is_mostly_cjk(text)
        if not cjk and (_on(self.min_mean_word_length) or _on(self.max_mean_word_length)):
            mean = sum(map(len, tokens)) / n
            too_short = _on(self.min_mean_word_length) and mean < self.min_mean_word_length
            if too_short or (_on(self.max_mean_word_length) and mean > self.max_mean_word_length):
                return "gopher_quality:mean_word_length"
        if _on(self.max_symbol_word_ratio):
            ellipses = sum(text.count(e) for e in ELLIPSES)
            if max(text.count("#"), ellipses) / n > self.max_symbol_word_ratio:
                return "gopher_quality:symbol_word_ratio"
        if _on(self.max_bullet_lines) or _on(self.max_ellipsis_lines):
            lines = [line.strip() for line in nonblank_lines(text)]
            bullets = sum(line.startswith(BULLETS) for line in lines) / len(lines)
            if _on(self.max_bullet_lines) and bullets > self.max_bullet_lines:
                return "gopher_quality:bullet_lines"
            ellipses = sum(line.endswith(ELLIPSES) for line in lines) / len(lines)
            if _on(self.max_ellipsis_lines) and ellipses > self.max_ellipsis_lines:
                return "gopher_quality:ellipsis_lines"
        if _on(self.min_alphabetic_words):
            without_letter = sum(1 for w in tokens if _NO_LETTER.fullmatch(w))
            if 1 - without_letter / n < self.min_alphabetic_words:
                return "gopher_quality:alphabetic_words"
        if not cjk and _on(self.min_stop_words):
            stop = self.stop_words
            if sum(w.lower() in stop for w in tokens) < self.min_stop_words:
                return "gopher_quality:stop_words"
        return None


def _ngram_tables(ids: np.ndarray, max_n: int) -> Iterator[tuple[int, np.ndarray, np.ndarray, np.ndarray]]:
    """(n, number of the n-gram at each position, first position of each number, count of each number) for
    n = 1..max_n. Exact, not hashed: an n-gram's number is the pair (its first n-1 words' number, last word)
    renumbered densely, so each step is one sort of integers."""
    current = ids
    base = int(ids.max()) + 1 if len(ids) else 1
    for n in range(1, min(max_n, len(ids)) + 1):
        keys = ids if n == 1 else current[:-1] * base + ids[n - 1 :]
        _, first, current, counts = np.unique(keys, return_index=True, return_inverse=True, return_counts=True)
        current = current.reshape(-1)
        yield n, current, first, counts


# Table A1 of the Gopher paper: n-gram size -> largest allowed share of characters.
TOP_NGRAM_CHARS = {2: 0.20, 3: 0.18, 4: 0.16}
DUPLICATE_NGRAM_CHARS = {5: 0.15, 6: 0.14, 7: 0.13, 8: 0.12, 9: 0.11, 10: 0.10}


@register
class GopherRepetition(Filter):
    """Repetition inside a document: repeated lines and paragraphs, one n-gram taking up much of the text, or
    many characters inside n-grams seen before. Repeats count from the second occurrence on, and a character
    inside several repeated n-grams counts once."""

    name = "gopher_repetition"

    def __init__(
        self,
        max_duplicate_lines: float | None = 0.30,
        max_duplicate_paragraphs: float | None = 0.30,
        max_duplicate_line_chars: float | None = 0.20,
        max_duplicate_paragraph_chars: float | None = 0.20,
        max_top_ngram_chars: dict[Any, float | None] | None = TOP_NGRAM_CHARS,
        max_duplicate_ngram_chars: dict[Any, float | None] | None = DUPLICATE_NGRAM_CHARS,
    ):
        super().__init__()
        _check_limits(
            {"max_duplicate_lines": max_duplicate_lines, "max_duplicate_paragraphs": max_duplicate_paragraphs,
             "max_duplicate_line_chars": max_duplicate_line_chars,
             "max_duplicate_paragraph_chars": max_duplicate_paragraph_chars},
            {},
        )  # fmt: skip
        self.max_duplicate_lines, self.max_duplicate_line_chars = max_duplicate_lines, max_duplicate_line_chars
        self.max_duplicate_paragraphs = max_duplicate_paragraphs
        self.max_duplicate_paragraph_chars = max_duplicate_paragraph_chars
        self.max_top_ngram_chars = _by_n(max_top_ngram_chars or {}, "max_top_ngram_chars")
        self.max_duplicate_ngram_chars = _by_n(max_duplicate_ngram_chars or {}, "max_duplicate_ngram_chars")

    def check(self, doc: Document) -> str | None:
        text = doc.text
        units = (
            ("line", [line.strip() for line in nonblank_lines(text)], self.max_duplicate_lines,
             self.max_duplicate_line_chars),
            ("paragraph", [p.strip() for p in _PARAGRAPH_BREAK.split(text) if p.strip()],
             self.max_duplicate_paragraphs, self.max_duplicate_paragraph_chars),
        )  # fmt: skip
        for unit, items, max_share, max_char_share in units:
            if not items or not (_on(max_share) or _on(max_char_share)):
                continue
            count, chars = repeats(items)
            if _on(max_share) and count / len(items) > max_share:
                return f"gopher_repetition:duplicate_{unit}s"
            if _on(max_char_share) and chars / sum(map(len, items)) > max_char_share:
                return f"gopher_repetition:duplicate_{unit}_chars"
        if not self.max_top_ngram_chars and not self.max_duplicate_ngram_chars:
            return None
        tokens = words(text)
        vocabulary: dict[str, int] = {}
        ids = np.array([vocabulary.setdefault(w, len(vocabulary)) for w in tokens], dtype=np.int64)
        lengths = np.array([len(w) for w in tokens], dtype=np.int64)
        total = int(lengths.sum())
        top, duplicate = self.max_top_ngram_chars, self.max_duplicate_ngram_chars
        for n, numbers, first, counts in _ngram_tables(ids, max([*top, *duplicate])):
            if n in top and _top_ngram_share(lengths, total, n, first, counts) > top[n]:
                return f"gopher_repetition:top_{n}gram_chars"
            if n in duplicate and _duplicate_ngram_share(lengths, total, n, numbers, first) > duplicate[n]:
                return f"gopher_repetition:duplicate_{n}gram_chars"
        return None


def _by_n(limits: dict[Any, float | None], option: str) -> dict[int, float]:
    """{n: limit} with int keys (TOML tables have string keys), sorted, switched-off entries left out."""
    usage = f"{option} must map n-gram sizes (1 or more) to fractions, like {{2 = 0.2}}, got {limits!r}"
    try:
        by_n = {int(n): limit for n, limit in sorted(limits.items(), key=lambda kv: int(kv[0])) if _on(limit)}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(usage) from None
    for n, limit in by_n.items():
        if n < 1 or isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise ValueError(usage)
        check_range(f"{option}.{n}", limit, 0, 1)
    return {n: float(limit) for n, limit in by_n.items()}


def _top_ngram_share(lengths: np.ndarray, total: int, n: int, first: np.ndarray, counts: np.ndarray) -> float:
    """Share of word characters covered by the most frequent n-gram (ties: the longest), if it repeats."""
    window_chars = np.convolve(lengths, np.ones(n, dtype=np.int64), mode="valid")[first]
    best = np.lexsort((-window_chars, -counts))[0]
    if counts[best] < 2:
        return 0.0
    return float(counts[best] * window_chars[best]) / total


def _duplicate_ngram_share(lengths: np.ndarray, total: int, n: int, numbers: np.ndarray, first: np.ndarray) -> float:
    """Share of word characters inside n-grams that already occurred earlier, each character counted once."""
    repeat = np.ones(len(numbers), dtype=bool)
    repeat[first] = False
    starts = np.flatnonzero(repeat)
    if len(starts) == 0:
        return 0.0
    size = len(lengths) + 1
    # +1 where a repeated n-gram starts, -1 where it ends: a running sum above zero is a covered word
    coverage = np.bincount(starts, minlength=size) - np.bincount(starts + n, minlength=size)
    covered = np.cumsum(coverage[:-1]) > 0
    return float(lengths[covered].sum()) / total


# --- C4 -------------------------------------------------------------------------------------------------------

POLICY_PHRASES = ("terms of use", "privacy policy", "cookie policy", "uses cookies", "use of cookies", "use cookies")
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]", re.IGNORECASE)
# A sentence ends at . ! ? followed by space or the line's end (closing quotes allowed), or at CJK 。！？…
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)|[。！？｡…]+[”’」』）]*")


def count_sentences(line: str) -> int:
    return max(1, len(_SENTENCE_END.findall(line)))


@register
class C4Quality(Filter):
    """Keeps the lines of a page that read like prose and drops the page when fewer than `min_sentences`
    sentences survive, or when a kept line shows it is not prose (lorem ipsum, a curly bracket). Blank lines
    between kept lines stay, so paragraphs survive. Removed lines are counted per rule in stats.changed."""

    name = "c4_quality"

    def __init__(
        self,
        terminal_punctuation: bool = True,
        min_words_per_line: int | None = 3,
        min_sentences: int | None = 5,
        max_word_length: int | None = 1000,
        javascript: bool = True,
        policy: bool = True,
        lorem_ipsum: bool = True,
        curly_bracket: bool = True,
        remove_citations: bool = True,
    ):
        super().__init__()
        _check_limits(
            {},
            {"min_words_per_line": min_words_per_line, "min_sentences": min_sentences,
             "max_word_length": max_word_length},
        )  # fmt: skip
        self.terminal_punctuation = terminal_punctuation
        self.min_words_per_line, self.min_sentences = min_words_per_line, min_sentences
        self.max_word_length = max_word_length
        self.javascript, self.policy = javascript, policy
        self.lorem_ipsum, self.curly_bracket = lorem_ipsum, curly_bracket
        self.remove_citations = remove_citations

    def apply(self, doc: Document) -> Document | None:
        kept, changes, reason = self._clean(doc.text)
        if reason is not None:
            self.drop(doc, reason)
            return None
        if not changes:
            return doc
        self.stats.changed["documents rewritten"] += 1
        self.stats.changed.update(changes)
        return replace(doc, text="\n".join(kept))

    def check(self, doc: Document) -> str | None:
        return self._clean(doc.text)[2]

    def _clean(self, text: str) -> tuple[list[str], Counter, str | None]:
        """(kept lines, what was removed: "lines removed: <rule>" and "citations removed" counts, drop reason)."""
        kept: list[str] = []
        changes: Counter = Counter()
        sentences = 0
        paragraph_break = False
        for raw in text.split("\n"):
            line = raw.strip()
            if not line:
                paragraph_break = bool(kept)
                continue
            rule = self._line_rule(line)
            if rule is not None:
                changes[f"lines removed: {rule}"] += 1
                continue
            lowered = line.lower()
            if self.lorem_ipsum and "lorem ipsum" in lowered:
                return [], changes, "c4_quality:lorem_ipsum"
            if self.curly_bracket and "{" in line:
                return [], changes, "c4_quality:curly_bracket"
            if self.remove_citations and "[" in line:
                line, citations = _CITATION.subn("", line)
                if citations:
                    changes["citations removed"] += citations
            if paragraph_break:
                kept.append("")
                paragraph_break = False
            kept.append(line)
            sentences += count_sentences(line)
        if _on(self.min_sentences) and sentences < self.min_sentences:
            return [], changes, "c4_quality:too_few_sentences"
        if not kept:
            return [], changes, "c4_quality:no_lines_left"
        return kept, changes, None

    def _line_rule(self, line: str) -> str | None:
        """Why a line goes, or None to keep it."""
        limit = self.max_word_length
        if _on(limit) and len(line) > limit and any(_too_long(token, limit) for token in line.split()):
            return "word too long"
        if self.terminal_punctuation and (not line.endswith(TERMINAL_PUNCTUATION) or line.endswith("...")):
            return "no terminal punctuation"
        if _on(self.min_words_per_line) and len(words(line)) < self.min_words_per_line:
            return "too few words"
        lowered = line.lower()
        if self.javascript and "javascript" in lowered:
            return "javascript"
        if self.policy and any(phrase in lowered for phrase in POLICY_PHRASES):
            return "policy"
        return None


def _too_long(token: str, limit: int) -> bool:
    # Chinese and Japanese are written without spaces, so a whole CJK sentence is one whitespace token.
    return len(token) > limit and len(token) - len(_WIDE.findall(token)) > limit


# --- FineWeb ----------------------------------------------------------------------------------------------------


@register
class FineWebQuality(Filter):
    """FineWeb's rules: punctuated lines, short lines, duplicated-line characters, newlines per word."""

    name = "fineweb_quality"

    def __init__(
        self,
        min_line_punct_ratio: float | None = 0.12,
        max_short_line_ratio: float | None = 0.67,
        short_line_length: int = 30,
        max_char_duplicates_ratio: float | None = 0.01,
        max_new_line_ratio: float | None = 0.3,
    ):
        super().__init__()
        _check_limits(
            {"min_line_punct_ratio": min_line_punct_ratio, "max_short_line_ratio": max_short_line_ratio,
             "max_char_duplicates_ratio": max_char_duplicates_ratio},
            {"short_line_length": short_line_length, "max_new_line_ratio": max_new_line_ratio},
        )  # fmt: skip
        self.min_line_punct_ratio = min_line_punct_ratio
        self.max_short_line_ratio, self.short_line_length = max_short_line_ratio, short_line_length
        self.max_char_duplicates_ratio = max_char_duplicates_ratio
        self.max_new_line_ratio = max_new_line_ratio

    def check(self, doc: Document) -> str | None:
        text = doc.text
        lines = [line.strip() for line in nonblank_lines(text)]
        if not lines:
            return "fineweb_quality:empty"
        punctuated = sum(line.endswith(TERMINAL_PUNCTUATION) for line in lines) / len(lines)
        if _on(self.min_line_punct_ratio) and punctuated < self.min_line_punct_ratio:
            return "fineweb_quality:line_punct_ratio"
        if _on(self.max_short_line_ratio):
            short = sum(line_width(line) <= self.short_line_length for line in lines)
            if short / len(lines) > self.max_short_line_ratio:
                return "fineweb_quality:short_line_ratio"
        if _on(self.max_char_duplicates_ratio):
            _, repeat_chars = repeats(lines)
            if repeat_chars / max(1, len(text) - text.count("\n")) > self.max_char_duplicates_ratio:
                return "fineweb_quality:char_duplicates_ratio"
        if _on(self.max_new_line_ratio):
            n_words = len(words(text))
            if n_words == 0 or text.count("\n") / n_words > self.max_new_line_ratio:
                return "fineweb_quality:new_line_ratio"
        return None
