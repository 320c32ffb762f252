"""Character classes of a corpus, counted with numpy: what share of the text is backslashes, markup, digits,
control characters, CJK, ... and the usual share of each in clean natural text.

Every code point gets a bit mask of its classes from a lookup table (built once from `unicodedata`); a
batch of documents becomes one UTF-32 array, so counting is a table lookup and a cumulative sum per class
rather than a Python loop per character. Classes found by pattern (escape sequences, HTML tags and
entities, mojibake) run their regex only on documents that hold the class's lead character.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from liandan.data.documents.text import CJK_CLASS


@dataclass(frozen=True)
class CharClass:
    name: str
    # Upper end of the share in clean natural text (of all characters; of cased letters for uppercase).
    # None: the share follows the language (CJK, accented Latin), so only a change against a baseline counts.
    usual: float | None
    description: str


CHAR_CLASSES = (
    # Prose has no backslashes; code, LaTeX and text escaped twice on export do (the OPT-175B data bug).
    CharClass("backslash", 1e-5, "backslashes, with the escape sequences they form (\\n, \\t, \\u, \\\\)"),
    # An occasional comparison or formula; leftover HTML or templates exceed 0.1% within a few tags per page.
    CharClass("markup", 1e-3, "< > { } and HTML entities (&amp; ...)"),
    # An e-mail address or hashtag here and there; navigation bars (' | ') and tokenizer artefacts
    # (wikitext's ' @-@ ') go far beyond one in 10,000 characters.
    CharClass("rare_symbols", 1e-4, "@ # ^ _ | ~ `"),
    # Clean text has none of these; a handful per million characters is noise, more is a broken decoder.
    CharClass("control", 1e-5, "control characters other than tab/newline, BOM, zero-width space, lone surrogates"),
    CharClass("replacement", 1e-5, "U+FFFD, left where bytes failed to decode"),
    CharClass("mojibake", 1e-5, "UTF-8 read as Latin-1/cp1252 ('Ã©', 'â€™')"),
    # Dates and figures are 1-3% of encyclopedic prose; tables and number dumps go far beyond 5%.
    CharClass("digits", 0.05, "decimal digits"),
    # 3-5% of English prose; classical Chinese with full-width marks reaches ~20%.
    CharClass("punctuation", 0.2, "punctuation and symbols"),
    # ~17-20% of English (a space every five letters), less in CJK; layout padding goes beyond.
    CharClass("whitespace", 0.2, "spaces, tabs, newlines"),
    # 3-5% of English prose, ~10% in plays with upper-case speaker names; shouting and menus go beyond.
    CharClass("uppercase", 0.1, "upper-case share of cased letters"),
    CharClass("cjk", None, "Chinese, Japanese kana, Korean hangul"),
    CharClass("non_ascii_latin", None, "accented and extended Latin letters"),
)

# Bits of the per-code-point table. "lower", "amp" and "mojibake_lead" are helpers: the denominator of the
# uppercase share, and the characters that gate the entity and mojibake patterns.
_BITS = {
    "whitespace": 1 << 0, "digits": 1 << 1, "punctuation": 1 << 2, "uppercase": 1 << 3, "lower": 1 << 4,
    "cjk": 1 << 5, "non_ascii_latin": 1 << 6, "control": 1 << 7, "replacement": 1 << 8, "backslash": 1 << 9,
    "markup": 1 << 10, "rare_symbols": 1 << 11, "amp": 1 << 12, "mojibake_lead": 1 << 13,
}  # fmt: skip
_N_CODEPOINTS = 0x110000
_LATIN_RANGES = ((0x00C0, 0x024F), (0x1E00, 0x1EFF), (0x2C60, 0x2C7F), (0xA720, 0xA7FF), (0xAB30, 0xAB6F))

_ESCAPE_RE = re.compile(r"\\(?:u[0-9a-fA-F]{4}|x[0-9a-fA-F]{2}|[ntr0abfv\"'\\/])")
_TAG_RE = re.compile(r"</?[A-Za-z][A-Za-z0-9:-]{0,30}\b[^<>]{0,200}>")
_TAG_NAME_RE = re.compile(r"</?[A-Za-z][A-Za-z0-9:-]*")
_ENTITY_RE = re.compile(r"&(?:[A-Za-z][A-Za-z0-9]{1,31}|#[0-9]{1,7}|#[xX][0-9A-Fa-f]{1,6});")
# UTF-8 lead bytes decoded as cp1252/Latin-1 (Ã, Â, â) followed by what a continuation byte decodes to.
_CONTINUATION = "".join(
    sorted(set(bytes(range(0x80, 0xC0)).decode("cp1252", errors="ignore") + "".join(map(chr, range(0x80, 0xC0)))))
)
_MOJIBAKE_RE = re.compile(f"[ÂÃâ][{re.escape(_CONTINUATION)}]")


@functools.cache
def class_table() -> np.ndarray:
    """Class bits of every code point (built on first use, ~0.5 s)."""
    bits_of_category = {
        "Nd": _BITS["digits"], "Lu": _BITS["uppercase"], "Lt": _BITS["uppercase"], "Ll": _BITS["lower"],
        "Cc": _BITS["control"], "Cs": _BITS["control"],
    }  # fmt: skip
    for cat in ("Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So"):
        bits_of_category[cat] = _BITS["punctuation"]
    categories = [unicodedata.category(chr(cp)) for cp in range(_N_CODEPOINTS)]
    table = np.fromiter((bits_of_category.get(c, 0) for c in categories), dtype=np.uint16, count=_N_CODEPOINTS)
    for cp, cat in enumerate(categories):
        if cat[0] in "ZC" and chr(cp).isspace():
            table[cp] |= _BITS["whitespace"]
    for ch in "\t\n\r":
        table[ord(ch)] &= ~np.uint16(_BITS["control"])
    for cp in (0xFEFF, 0x200B, 0xFFFE, 0xFFFF):
        table[cp] |= _BITS["control"]
    everything = "".join(map(chr, range(_N_CODEPOINTS)))
    for m in re.finditer(f"[{CJK_CLASS}]", everything):
        table[m.start()] |= _BITS["cjk"]
    for lo, hi in _LATIN_RANGES:
        letters = [cp for cp in range(lo, hi + 1) if categories[cp][0] == "L"]
        table[letters] |= _BITS["non_ascii_latin"]
    for chars, bit in (("\ufffd", "replacement"), ("\\", "backslash"), ("<>{}", "markup"), ("@#^_|~`", "rare_symbols"),
                       ("&", "amp"), ("ÂÃâ", "mojibake_lead")):  # fmt: skip
        for ch in chars:
            table[ord(ch)] |= _BITS[bit]
    return table


def _batches(texts: list[str], max_chars: int = 8_000_000):
    """Index ranges of documents holding about `max_chars` characters each (bounds the UTF-32 buffers)."""
    start, size = 0, 0
    for i, text in enumerate(texts):
        size += len(text)
        if size >= max_chars:
            yield start, i + 1
            start, size = i + 1, 0
    if start < len(texts):
        yield start, len(texts)


def count_char_classes(texts: list[str], doc_ids: list[str]) -> dict[str, dict[str, Any]]:
    """Per class: count, share (of characters, or of cased letters for uppercase), share of documents that
    hold it, its most frequent members and an example snippet from the document holding most of it."""
    table = class_table()
    per_doc = {name: np.zeros(len(texts), dtype=np.int64) for name in _BITS}
    codepoint_counts = np.zeros(_N_CODEPOINTS, dtype=np.int64)
    for lo, hi in _batches(texts):
        codepoints = np.frombuffer("".join(texts[lo:hi]).encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        bits = table[codepoints]
        lengths = np.array([len(t) for t in texts[lo:hi]], dtype=np.int64)
        # reduceat sums [start_i, start_i+1); empty documents would break that, and hold nothing anyway.
        filled = np.flatnonzero(lengths)
        starts = (np.cumsum(lengths) - lengths)[filled]
        for name, bit in _BITS.items():
            if filled.size:
                per_doc[name][lo + filled] = np.add.reduceat((bits & bit) != 0, starts, dtype=np.int64)
        codepoint_counts += np.bincount(codepoints, minlength=_N_CODEPOINTS)

    escapes = _pattern_counts(texts, per_doc["backslash"], _ESCAPE_RE, lambda m: m[:2])
    tags = _pattern_counts(texts, per_doc["markup"], _TAG_RE, _tag_name)
    entities = _pattern_counts(texts, per_doc["amp"], _ENTITY_RE)
    mojibake = _pattern_counts(texts, per_doc["mojibake_lead"], _MOJIBAKE_RE)
    per_doc["markup"] = per_doc["markup"] + entities.chars_per_doc
    per_doc["mojibake"] = mojibake.chars_per_doc

    total_chars = sum(map(len, texts))
    cased = int(per_doc["uppercase"].sum() + per_doc["lower"].sum())
    out = {}
    for cls in CHAR_CLASSES:
        counts = per_doc[cls.name]
        count = int(counts.sum())
        of = cased if cls.name == "uppercase" else total_chars
        if cls.name == "backslash":
            top = escapes.top()
        elif cls.name == "markup":
            top = sorted(tags.top() + entities.top(), key=lambda pair: -pair[1])[:10]
            if 2 * sum(len(t) * n for t, n in top) < count:  # not mostly tags: show the characters too
                top += _top_codepoints(codepoint_counts, table, _BITS["markup"])
        elif cls.name == "mojibake":
            top = mojibake.top()
        else:
            top = _top_codepoints(codepoint_counts, table, _BITS[cls.name])
        out[cls.name] = {
            "count": count,
            "of": of,
            "denominator": "cased letters" if cls.name == "uppercase" else "characters",
            "share": float(f"{count / of:.6g}") if of else 0.0,
            "doc_share": float(f"{np.count_nonzero(counts) / len(texts):.6g}") if texts else 0.0,
            "top": top,
            "example": _example(texts, doc_ids, counts, cls.name, table),
        }
    return out


class _PatternCounts:
    def __init__(self, n_docs: int):
        self.members: Counter = Counter()
        self.chars_per_doc = np.zeros(n_docs, dtype=np.int64)

    def top(self, k: int = 10) -> list[list]:
        return [[text, n] for text, n in self.members.most_common(k)]


def _pattern_counts(texts, gate: np.ndarray, pattern: re.Pattern, key=lambda match: match) -> _PatternCounts:
    """Matches of `pattern` (which has no groups) in the documents whose `gate` count is non-zero, grouped
    by `key` of the matched text."""
    result = _PatternCounts(len(texts))
    for i in np.flatnonzero(gate):
        for match, n in Counter(pattern.findall(texts[i])).items():
            result.members[key(match)] += n
            result.chars_per_doc[i] += n * len(match)
    return result


def _tag_name(tag: str) -> str:
    """'<A href=...>' -> '<a>', '</P>' -> '</p>'."""
    return _TAG_NAME_RE.match(tag).group(0).lower() + ">"


def _top_codepoints(counts: np.ndarray, table: np.ndarray, bit: int, k: int = 10) -> list[list]:
    members = np.flatnonzero((table & bit) != 0)
    members = members[counts[members] > 0]
    order = np.lexsort((members, -counts[members]))[:k]
    return [[chr(cp), int(counts[cp])] for cp in members[order]]


_PATTERN_OF = {"mojibake": _MOJIBAKE_RE}


def _example(texts, doc_ids, counts: np.ndarray, name: str, table: np.ndarray, context: int = 40) -> dict | None:
    """Text around the first occurrence of the class in the document that holds the most of it."""
    if not counts.any():
        return None
    i = int(np.argmax(counts))
    text = texts[i]
    if name in _PATTERN_OF:
        pos = _PATTERN_OF[name].search(text).start()
    else:
        bit = _BITS[name]
        codepoints = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        hits = np.flatnonzero(table[codepoints] & bit)
        entity = _ENTITY_RE.search(text) if name == "markup" else None
        candidates = ([int(hits[0])] if hits.size else []) + ([entity.start()] if entity else [])
        pos = min(candidates, default=0)
    return {"doc_id": doc_ids[i], "snippet": text[max(pos - context, 0) : pos + context]}


_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u200b-\u200f\u2028\u2029\ufeff\ud800-\udfff]")
_SHOWN_AS = {"\n": "\u21b5", "\t": "\u21e5"}


def visible(text: str) -> str:
    """Text for a report: line breaks and tabs as arrows, other invisible characters as ⟨U+XXXX⟩. Backslashes
    stay single (repr would double them, and a stray backslash is exactly what a reader must see)."""
    return _INVISIBLE.sub(lambda m: _SHOWN_AS.get(m.group(0)) or f"⟨U+{ord(m.group(0)):04X}⟩", text)


def members(top: list, k: int = 5) -> str:
    """'<unk>' x26936, '@' x11070: the most frequent members of a class, quoted."""
    return ", ".join(f"'{visible(text)}' x{n}" for text, n in top[:k])
