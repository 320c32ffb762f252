"""C4's bad-words rule (Raffel et al. 2020, section 2.2): a document holding any word of a list of obscene or
offensive words is dropped, with the list's language as the reason ("bad_words:en") and the word that matched in
doc.meta["bad_word"], so the rejects file shows why.

The lists ship with liandan (`liandan/data/wordlists/`, one entry a line): the English and Chinese lists of
"List of Dirty, Naughty, Obscene, and Otherwise Bad Words" (LDNOOBW, CC BY 4.0; SOURCE.md there names the
commit), the source C4 used for English. How an entry matches depends on its script:

- entries with a CJK character match as substrings, since Chinese is written without spaces. Entries shorter
  than `min_cjk_chars` (2) are left out: a single character such as 性 or 乳 is in 女性 and 乳燕, and matching it
  dropped 3.8% of the shared Chinese classics against 0.9% without;
- entries of letters, digits and spaces match whole words of `liandan.data.documents.text.words` (case-insensitive), so
  "ass" is found in "an ass" and not in "class"; a phrase matches the same words in a row, across any spacing;
- other entries ("s&m", an emoji) match as written, not glued to a letter or digit on either side;
- entries with no letter or symbol at all (the Chinese list's "13.") are left out: they cannot be told apart
  from ordinary numbering.

The rule is blunt by design and removes ordinary text too: medical and anatomical vocabulary, dialect, and
(Dodge et al. 2021 found for C4) text about sexual minorities. Use `allow_words` to take entries out.
"""

from __future__ import annotations

import re
import unicodedata
from importlib import resources
from pathlib import Path

from liandan.data.documents.corpus import DataError, Document
from liandan.data.documents.text import CJK_CLASS, words
from liandan.data.steps.base import Filter, register

_CJK = re.compile(f"[{CJK_CLASS}]")


def shipped_lists() -> list[str]:
    """The languages that have a word list inside the package."""
    folder = resources.files("liandan.data.steps").joinpath("wordlists")
    return sorted(p.name.removesuffix(".txt") for p in folder.iterdir() if p.name.endswith(".txt"))


def read_word_list(language: str) -> list[str]:
    path = resources.files("liandan.data.steps").joinpath("wordlists", f"{language}.txt")
    if not path.is_file():
        raise ValueError(f"no shipped word list for language {language!r}; shipped: {', '.join(shipped_lists())}")
    return path.read_text(encoding="utf-8").splitlines()


class WordList:
    """One list's entries, sorted by how they match; `find` returns the first entry found in a text."""

    def __init__(self, entries: list[str], min_cjk_chars: int = 2, allow: frozenset[str] = frozenset()):
        substrings: set[str] = set()
        phrases: set[tuple[str, ...]] = set()
        literals: set[str] = set()
        for raw in entries:
            entry = " ".join(raw.lower().split())
            if not entry or entry in allow:
                continue
            if _CJK.search(entry):
                if len(entry) >= min_cjk_chars:
                    substrings.add(entry)
            elif not any(c.isalpha() or unicodedata.category(c) == "So" for c in entry):
                continue
            elif " ".join(words(entry)) == entry:
                phrases.add(tuple(words(entry)))
            else:
                literals.add(entry)
        # Grouped by first character and first word, so a text is only compared with the entries that could
        # start in it: one set intersection per document instead of a scan per entry.
        self.substrings: dict[str, list[str]] = {}
        for entry in sorted(substrings):
            self.substrings.setdefault(entry[0], []).append(entry)
        self.words = {p[0] for p in phrases if len(p) == 1}
        self.phrases = {p for p in phrases if len(p) > 1}
        self.phrase_starts = {p[0] for p in self.phrases}
        self.phrase_lengths = sorted({len(p) for p in self.phrases})
        self.literals = sorted(literals)
        self.literal = (
            re.compile("|".join(rf"(?<![^\W_]){re.escape(e)}(?![^\W_])" for e in self.literals)) if literals else None
        )
        self.size = len(substrings) + len(phrases) + len(literals)

    def __len__(self) -> int:
        return self.size

    def find(self, lowered: str, tokens: list[str]) -> str | None:
        """The first entry in `lowered` (the text in lower case), whose words are `tokens`."""
        if self.substrings:
            for first in sorted(self.substrings.keys() & set(lowered)):
                for entry in self.substrings[first]:
                    if entry in lowered:
                        return entry
        found = self.words.intersection(tokens)
        if found:
            return next(t for t in tokens if t in found)
        for i, token in enumerate(tokens):
            if token in self.phrase_starts:
                for n in self.phrase_lengths:
                    if tuple(tokens[i : i + n]) in self.phrases:
                        return " ".join(tokens[i : i + n])
        if self.literal is not None and (match := self.literal.search(lowered)):
            return match.group(0)
        return None


@register
class BadWords(Filter):
    """C4's rule: drop documents holding a word of the shipped bad-word lists (LDNOOBW English and Chinese)."""

    name = "bad_words"

    def __init__(
        self,
        languages: list[str] = ["en", "zh"],  # noqa: B006 - never mutated
        word_files: list[str] = [],  # noqa: B006
        extra_words: list[str] = [],  # noqa: B006
        allow_words: list[str] = [],  # noqa: B006
        min_cjk_chars: int = 2,
    ):
        super().__init__()
        if min_cjk_chars < 1:
            raise ValueError(f"min_cjk_chars must be at least 1, got {min_cjk_chars}")
        allow = frozenset(" ".join(w.lower().split()) for w in allow_words)
        lists = {language: read_word_list(language) for language in languages}
        for path in word_files:
            lists[Path(path).stem] = _read_user_list(Path(path))
        if extra_words:
            lists["extra"] = list(extra_words)
        if not lists:
            raise ValueError("no word list: name shipped languages, word_files or extra_words")
        self.lists = {name: WordList(entries, min_cjk_chars, allow) for name, entries in lists.items()}

    def check(self, doc: Document) -> str | None:
        lowered = doc.text.lower()
        tokens = words(lowered)
        for name, word_list in self.lists.items():
            found = word_list.find(lowered, tokens)
            if found is not None:
                doc.meta["bad_word"] = found
                return f"bad_words:{name}"
        return None


def _read_user_list(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise DataError(f"bad_words: word file not found: {path}") from None
    except UnicodeDecodeError:
        raise DataError(f"bad_words: word file {path} is not UTF-8 text") from None
