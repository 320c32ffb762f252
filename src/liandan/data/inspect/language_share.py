"""The languages a source holds against the ones it should hold: the inspection's language-share flags.

A source's share of each language is counted over the inspection's sample, from doc.meta["language"] where the
`language` step tagged the documents, and by the same identifier (fastText lid.176) for the documents it did not
tag, when the source has expected languages. Two flags follow:

- unexpected_language: a language outside the expected ones holds more than `unexpected_language_share` of the
  documents (a Chinese crawl that is 20% Japanese, an English source with a block of Russian);
- expected_language_short: the expected languages together hold less than `expected_language_share`, or, in a
  source that expects several, one of them holds less than `expected_language_min_share` (a bilingual source
  whose Chinese half went missing).

Documents without a letter ("und": numbers, symbols) count in the shares and never as an unexpected language;
the short- and empty-document flags speak for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from liandan.data.documents.corpus import Document

UNTAGGED = "unknown"
UNDETERMINED = "und"


def language_shares(sample: Sequence[Document], identify: bool) -> dict[str, float]:
    """Share of the sampled documents per language, most common first. Untagged documents are identified when
    `identify` is set and otherwise count as "unknown"; with no tag at all and nothing identified, {}."""
    labels = [d.meta.get("language") or UNTAGGED for d in sample]
    if identify and UNTAGGED in labels:
        from liandan.data.steps.langid import Language

        detector = Language()
        labels = [label if label != UNTAGGED else detector.identify(d.text)[0] for label, d in zip(labels, sample)]
    counts = Counter(labels)
    if not sample or set(counts) == {UNTAGGED}:
        return {}
    return {language: float(f"{n / len(sample):.6g}") for language, n in counts.most_common()}


def language_flags(shares: dict[str, float], expected: Sequence[str], thresholds: Any) -> list[dict[str, Any]]:
    """The flags of one source as Anomaly fields (less the source): `thresholds` is the inspection's."""
    if not expected or not shares:
        return []
    wanted = [language.lower() for language in expected]
    names = ", ".join(wanted)
    flags = []
    limit = thresholds.unexpected_language_share
    for language, share in shares.items():
        if language in wanted or language in (UNDETERMINED, UNTAGGED) or share <= limit:
            continue
        flags.append(
            {
                "kind": "unexpected_language",
                "message": f"{_pct(share)} of documents are in {language}, which is not among the expected ({names})",
                "value": share,
                "expected": (0.0, limit),
                "statistic": f"{language} language share",
            }
        )
    total = sum(shares.get(language, 0.0) for language in wanted)
    if total < thresholds.expected_language_share:
        what = "the expected languages ({}) hold" if len(wanted) > 1 else "the expected language ({}) holds"
        flags.append(
            {
                "kind": "expected_language_short",
                "message": f"{what.format(names)} only {_pct(total)} of documents",
                "value": total,
                "expected": (thresholds.expected_language_share, None),
                "statistic": f"{'+'.join(wanted)} language share",
            }
        )
    if len(wanted) > 1:
        least = thresholds.expected_language_min_share
        for language in wanted:
            share = shares.get(language, 0.0)
            if share < least:
                flags.append(
                    {
                        "kind": "expected_language_short",
                        "message": f"{language} is expected but holds only {_pct(share)} of documents",
                        "value": share,
                        "expected": (least, None),
                        "statistic": f"{language} language share",
                    }
                )
    return flags


def _pct(x: float) -> str:
    return f"{x * 100:.3g}%"
