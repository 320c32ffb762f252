"""Text normalization: the first pipeline step, so every later rule sees one spelling of the same text.

Each fix can be switched off and counts the documents it changed (`stats.changed["mojibake"]`, ...):

- html: markup to readable text with inscriptis (headings, paragraphs and lists keep their line structure;
  scripts and styles go). Off by default: only for inputs that are HTML.
- fix_mojibake: ftfy repairs text decoded with the wrong codec ("donâ€™t" -> "don’t"). Only its encoding
  repairs run: quotes, ligatures, full-width forms and HTML entities are legitimate text and stay as written.
- control_chars: C0/C1 control characters and stray byte-order marks go; tabs and line breaks stay.
- whitespace: one kind of line break (\\n), exotic spaces to plain spaces, no trailing spaces, at most two
  blank lines in a row, no blank lines at the start or end. The ideographic space (U+3000) is ordinary
  Chinese and Japanese typography and is kept.
- nfc: Unicode NFC, so "é" is one code point whichever way it was typed.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import ftfy
from ftfy.badness import is_bad

from liandan.config import ConfigError
from liandan.data.documents.corpus import Document
from liandan.data.steps.base import Transform, register

_LINE_BREAKS = re.compile("\r\n?|[\v\f\x85\u2028\u2029]")
# Every Unicode space separator except U+0020 and the ideographic space U+3000.
_EXOTIC_SPACES = re.compile("[\u00a0\u1680\u2000-\u200a\u202f\u205f]")
_TRAILING_SPACES = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANK_LINE_RUNS = re.compile(r"\n{4,}")  # four newlines = three blank lines
# C0 and C1 controls other than tab and newline, plus U+FEFF (a byte-order mark inside text is noise)...
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ufeff]")
# ... less \v \f \r and NEL (U+0085), when the whitespace fix is there to turn them into newlines.
_CONTROLS_BUT_LINE_BREAKS = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f\ufeff]")
# What ftfy's enabled fixes act on besides mojibake patterns: terminal escapes, C1 controls, surrogates.
_FTFY_TARGETS = re.compile("[\x1b\x80-\x9f\ud800-\udfff]")
_NON_ASCII_RUN = re.compile(r"[^\x00-\x7f]+")
# Only ftfy's encoding repairs: quotes, ligatures, full-width forms and HTML entities are legitimate text.
_FTFY_CONFIG = ftfy.TextFixerConfig(
    unescape_html=False,
    remove_terminal_escapes=True,
    fix_encoding=True,
    fix_latin_ligatures=False,
    fix_character_width=False,
    uncurl_quotes=False,
    fix_line_breaks=False,
    fix_surrogates=True,
    remove_control_chars=False,
    normalization=None,
    explain=False,
)


@register
class Normalize(Transform):
    """Unicode NFC, mojibake repair, control characters, whitespace, and optionally HTML to text."""

    name = "normalize"

    def __init__(
        self,
        nfc: bool = True,
        fix_mojibake: bool = True,
        control_chars: bool = True,
        whitespace: bool = True,
        html: bool = False,
    ):
        super().__init__()
        if html:
            _inscriptis()  # a missing package is a configuration error, found before the first document
        # Order matters: markup first (it can hide anything), encoding repair before removing controls (ftfy
        # reads C1 controls as evidence of mojibake), controls before whitespace, which may leave nothing.
        candidates = [
            ("html", html, html_to_text),
            ("mojibake", fix_mojibake, repair_mojibake),
            ("control_chars", control_chars, remove_controls if whitespace else remove_all_controls),
            ("whitespace", whitespace, normalize_whitespace),
            ("nfc", nfc, to_nfc),
        ]
        self.fixes: list[tuple[str, Callable[[str], str]]] = [(what, fix) for what, on, fix in candidates if on]

    def transform(self, doc: Document) -> Document:
        text = doc.text
        for what, fix in self.fixes:
            fixed = fix(text)
            if fixed != text:
                self.stats.changed[what] += 1
                text = fixed
        return doc if text is doc.text else replace(doc, text=text)


def html_to_text(text: str) -> str:
    return _inscriptis().get_text(text)


def repair_mojibake(text: str) -> str:
    # Checking the whole document once is far cheaper than letting ftfy walk it line by line when there is
    # nothing for it to do, which is almost always.
    if text.isascii() and "\x1b" not in text:
        return text
    if not (_FTFY_TARGETS.search(text) or is_bad(_non_ascii_neighbourhoods(text))):
        return text
    return ftfy.fix_text(text, _FTFY_CONFIG)


def remove_controls(text: str) -> str:
    """Control characters out, except tab, newline and the line breaks `normalize_whitespace` turns into \\n."""
    return _CONTROLS_BUT_LINE_BREAKS.sub("", text)


def remove_all_controls(text: str) -> str:
    return _CONTROLS.sub("", text)


def normalize_whitespace(text: str) -> str:
    if "\r" in text or not text.isascii():
        text = _LINE_BREAKS.sub("\n", text)
        text = _EXOTIC_SPACES.sub(" ", text)
    elif "\v" in text or "\f" in text:
        text = _LINE_BREAKS.sub("\n", text)
    text = _TRAILING_SPACES.sub("", text)
    text = _BLANK_LINE_RUNS.sub("\n\n\n", text)
    return text.lstrip("\n").rstrip()


def to_nfc(text: str) -> str:
    return text if unicodedata.is_normalized("NFC", text) else unicodedata.normalize("NFC", text)


def _non_ascii_neighbourhoods(text: str, context: int = 3) -> str:
    """The parts of `text` within `context` characters of a non-ASCII character, one per line. Every pattern
    of ftfy's mojibake detector contains a non-ASCII character with at most two others on either side, so it
    matches here exactly when it matches in `text` (a 20x faster check on mostly-ASCII text)."""
    parts = []
    start = end = -1
    for run in _NON_ASCII_RUN.finditer(text):
        left, right = max(0, run.start() - context), run.end() + context
        if left <= end:
            end = right
            continue
        if end >= 0:
            parts.append(text[start:end])
        start, end = left, right
    if end >= 0:
        parts.append(text[start:end])
    return "\n".join(parts)


def _inscriptis() -> Any:
    try:
        import inscriptis
    except ImportError:
        raise ConfigError("normalize html=true needs the inscriptis package (pip install inscriptis)") from None
    return inscriptis
