"""How much text a tokenizer puts in a token, per source and per language: bytes, characters and words per
token (the tokenizer's fertility, inverted). A tokenizer trained on English spends several tokens on a
Chinese character; this says how many before a model is trained on it.

Words are counted as runs of letters and digits, except that each Chinese, Japanese or Korean ideograph
counts as a word of its own (those scripts do not separate words with spaces, and a character is the unit
their readers count). Each document's language is fastText's lid.176 (`liandan.data.steps.langid`), read from
its first characters.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

from liandan.data.steps.langid import Language

# An ideograph is a word; elsewhere a word is a run of letters and digits.
_IDEOGRAPH = "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\U00020000-\U0002fa1f"
WORD = re.compile(rf"[{_IDEOGRAPH}]|[^\W_{_IDEOGRAPH}]+")
BATCH = 256


@dataclass
class Fertility:
    source: str
    language: str
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    characters: int = 0
    words: int = 0

    def add(self, other: Fertility) -> None:
        for key in ("documents", "tokens", "bytes", "characters", "words"):
            setattr(self, key, getattr(self, key) + getattr(other, key))

    def per_token(self, what: str) -> float:
        return getattr(self, what) / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict:
        out = asdict(self)
        out.update({f"{k}_per_token": round(self.per_token(k), 4) for k in ("bytes", "characters", "words")})
        return out


def fertility(
    documents: Iterable[tuple[str, str]],
    encode_batch: Callable[[list[str]], list[list[int]]],
    identify: Callable[[str], str] | None = None,
) -> list[Fertility]:
    """One row per (source, language) of `documents` ((source, text) pairs), sorted by source then language,
    each with its documents, tokens, bytes (UTF-8), characters and words."""
    identify = identify or _fasttext_language()
    rows: dict[tuple[str, str], Fertility] = {}
    batch: list[tuple[str, str]] = []

    def flush() -> None:
        for (source, text), ids in zip(batch, encode_batch([text for _, text in batch]), strict=True):
            key = (source, identify(text))
            row = rows.setdefault(key, Fertility(*key))
            row.add(Fertility(source, key[1], 1, len(ids), len(text.encode("utf-8", "surrogatepass")), len(text),
                              len(WORD.findall(text))))  # fmt: skip
        batch.clear()

    for source, text in documents:
        if text:
            batch.append((source, text))
        if len(batch) >= BATCH:
            flush()
    flush()
    return [rows[k] for k in sorted(rows)]


def by_language(rows: list[Fertility]) -> list[Fertility]:
    """The rows summed over sources: one per language."""
    totals: dict[str, Fertility] = {}
    for row in rows:
        totals.setdefault(row.language, Fertility("(all)", row.language)).add(row)
    return [totals[k] for k in sorted(totals)]


def _fasttext_language() -> Callable[[str], str]:
    detector = Language()
    return lambda text: detector.identify(text)[0]
