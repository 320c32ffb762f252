"""Text units shared by filters, dedup, decontamination and inspection, defined once so they agree.

A "word" is a run of letters/digits in space-separated scripts, and a single character in scripts written
without spaces (Chinese, Japanese kana, Korean hangul syllables count as CJK here). Counting words this way
keeps rules such as "at least 50 words" meaningful for Chinese text.
"""

from __future__ import annotations

import functools
import re
import unicodedata

# CJK Unified Ideographs (+ extension A, compatibility), kana, hangul syllables, CJK punctuation-free ranges.
CJK_CLASS = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uac00-\ud7af"
_CJK_RE = re.compile(f"[{CJK_CLASS}]")
_WORD_RE = re.compile(f"[{CJK_CLASS}]|[^\\W{CJK_CLASS}]+")
_SPACE_RE = re.compile(r"\s+")


@functools.cache
def _punctuation_table() -> dict[int, None]:
    """Every punctuation and symbol code point, for str.translate (built once, on first use)."""
    return {i: None for i in range(0x110000) if unicodedata.category(chr(i))[0] in "PS"}


def words(text: str) -> list[str]:
    """Words of `text`: letter/digit runs, and each CJK character on its own."""
    return _WORD_RE.findall(text)


def cjk_share(text: str) -> float:
    """Share of non-space characters that are CJK."""
    visible = len(_SPACE_RE.sub("", text))
    return len(_CJK_RE.findall(text)) / visible if visible else 0.0


def is_mostly_cjk(text: str, threshold: float = 0.3) -> bool:
    """Whether rules that assume space-separated words should be relaxed for this text."""
    return cjk_share(text) >= threshold


def normalize_for_matching(text: str) -> str:
    """Lower case, punctuation and symbols removed, whitespace collapsed: two texts that differ only in those
    compare equal (used by exact dedup and decontamination)."""
    text = unicodedata.normalize("NFKC", text).lower().translate(_punctuation_table())
    return _SPACE_RE.sub(" ", text).strip()


def ngrams(tokens: list[str], n: int) -> list[tuple[str, ...]]:
    """Contiguous n-grams; a sequence shorter than n yields itself once (so short texts still match)."""
    if len(tokens) < n:
        return [tuple(tokens)] if tokens else []
    return [tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)]
