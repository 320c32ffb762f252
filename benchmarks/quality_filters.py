"""liandan's Gopher and C4 quality filters against datatrove's on the same documents: how often they agree on
keeping or dropping a document, why they disagree, and how fast each runs.

    python benchmarks/quality_filters.py                    # about 4,000 English and 5,400 Chinese documents
    python benchmarks/quality_filters.py --json results.json

Needs the [bench] extra (datatrove, spaCy and jieba: datatrove splits English words with spaCy and Chinese ones
with spaCy + jieba).

Corpus (deterministic, from the shared data): English documents are WikiText-2 sections (an article cut at its
"= = heading = =" lines) and runs of 1 to 16 consecutive speeches of the Shakespeare text; Chinese documents are
the records of the shared classics. Every filter runs with its defaults, which are the published thresholds in
both libraries.

Pairs compared (liandan step / datatrove filter):

* gopher_quality / GopherQualityFilter, on English;
* c4_quality / C4QualityFilter, on English (both keep only the lines that pass and drop the page when fewer than
  five sentences are left; the comparison is of the keep/drop verdict);
* gopher_repetition / GopherRepetitionFilter, on English and on Chinese (datatrove with language "cmn", whose
  words are jieba's; its "zh" would split only at spaces and punctuation).

datatrove's Gopher quality and C4 filters are not run on Chinese: they count English stop words and end
sentences only with ASCII punctuation, so they drop every Chinese document by construction.

Throughput is documents per second on one process, each filter timed alone over the whole corpus after a
warm-up on the first 20 documents (spaCy's pipeline is built on first use); the best of --repeats runs.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"
_SECTION = re.compile(r"\n \n (?== = [^=])")
_SPEECH_BREAK = re.compile(r"\n\s*\n")


def english_documents(seed: int) -> list[tuple[str, str]]:
    """(id, text): WikiText-2 sections and runs of Shakespeare speeches."""
    docs = []
    for line in (SHARED / "en-wikitext2.jsonl").read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        for i, section in enumerate(_SECTION.split(record["text"])):
            if section.strip():
                docs.append((f"{record['id']}/{i}", section.strip()))
    speeches = [s for s in _SPEECH_BREAK.split((SHARED / "en-shakespeare.txt").read_text(encoding="utf-8")) if s]
    rng = random.Random(seed)
    start = 0
    while start < len(speeches):
        size = rng.randint(1, 16)
        docs.append((f"shakespeare/{start}", "\n\n".join(speeches[start : start + size])))
        start += size
    return docs


def chinese_documents() -> list[tuple[str, str]]:
    lines = (SHARED / "zh-classics.jsonl").read_text(encoding="utf-8").splitlines()
    return [(r["id"], r["text"]) for r in map(json.loads, lines)]


# -- the two libraries behind one signature: text -> drop reason or None -------------------------------------------
def liandan_filter(name: str) -> Callable[[str], str | None]:
    from liandan.data.documents.corpus import Document
    from liandan.data.steps.quality import C4Quality, GopherQuality, GopherRepetition

    step = {"gopher_quality": GopherQuality, "c4_quality": C4Quality, "gopher_repetition": GopherRepetition}[name]()
    return lambda text: step.check(Document("bench", "", text))


def datatrove_filter(name: str, language: str) -> Callable[[str], str | None]:
    from datatrove.data import Document
    from datatrove.pipeline.filters import C4QualityFilter, GopherQualityFilter, GopherRepetitionFilter
    from datatrove.utils.typeshelper import Languages

    # datatrove names languages by ISO 639-3 code; its "zh" resolves to a tokenizer that splits on spaces and
    # punctuation only, so Chinese goes in as Mandarin ("cmn": spaCy + jieba).
    language = {"en": Languages.english, "zh": Languages.mandarin_chinese}[language]

    classes = {
        "gopher_quality": GopherQualityFilter,
        "c4_quality": C4QualityFilter,
        "gopher_repetition": GopherRepetitionFilter,
    }
    kept = classes[name](language=language)

    def check(text: str) -> str | None:
        verdict = kept.filter(Document(text=text, id=""))  # C4's rewrites the text: a fresh document each time
        if verdict is True:
            return None
        return verdict[1] if isinstance(verdict, tuple) else "dropped"

    return check


def verdicts(check: Callable[[str], str | None], texts: list[str], repeats: int) -> tuple[list[str | None], float]:
    """Each document's drop reason (None: kept), and the best documents per second over `repeats` runs."""
    for text in texts[:20]:
        check(text)
    best = float("inf")
    results: list[str | None] = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = [check(t) for t in texts]
        best = min(best, time.perf_counter() - start)
    return results, len(texts) / best


def compare(name: str, language: str, docs: list[tuple[str, str]], repeats: int) -> dict:
    texts = [t for _, t in docs]
    ours, our_speed = verdicts(liandan_filter(name), texts, repeats)
    theirs, their_speed = verdicts(datatrove_filter(name, language), texts, repeats)
    cells: Counter = Counter()
    why: dict[str, Counter] = {"liandan keeps, datatrove drops": Counter(), "liandan drops, datatrove keeps": Counter()}
    both_drop_reasons: Counter = Counter()
    examples: dict[str, str] = {}
    for (doc_id, _), a, b in zip(docs, ours, theirs):
        if a is None and b is None:
            cells["both keep"] += 1
        elif a is not None and b is not None:
            cells["both drop"] += 1
            both_drop_reasons[f"{a} / {b}"] += 1
        else:
            cell = "liandan keeps, datatrove drops" if a is None else "liandan drops, datatrove keeps"
            cells[cell] += 1
            reason = b if a is None else a
            why[cell][reason] += 1
            examples.setdefault(f"{cell}: {reason}", doc_id)
    agree = cells["both keep"] + cells["both drop"]
    return {
        "filter": name,
        "language": language,
        "documents": len(docs),
        "agreement": round(agree / len(docs), 4),
        "confusion": {k: cells[k] for k in ("both keep", "both drop", *why)},
        "kept": {"liandan": ours.count(None), "datatrove": theirs.count(None)},
        "disagreement_reasons": {cell: dict(c.most_common(5)) for cell, c in why.items()},
        "both_drop_reasons": dict(both_drop_reasons.most_common(5)),
        "examples": examples,
        "docs_per_s": {"liandan": round(our_speed), "datatrove": round(their_speed)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the results here as well")
    args = parser.parse_args()
    english, chinese = english_documents(args.seed), chinese_documents()
    runs = [
        ("gopher_quality", "en", english),
        ("c4_quality", "en", english),
        ("gopher_repetition", "en", english),
        ("gopher_repetition", "zh", chinese),
    ]
    results = []
    for name, language, docs in runs:
        result = compare(name, language, docs, args.repeats)
        results.append(result)
        c, speed = result["confusion"], result["docs_per_s"]
        print(f"\n{name} ({language}, {result['documents']} documents): agreement {result['agreement']:.1%}")
        for cell, n in c.items():
            reasons = result["disagreement_reasons"].get(cell)
            detail = "; ".join(f"{r} {k}" for r, k in reasons.items()) if reasons else ""
            print(f"  {cell:32s} {n:6d}  {detail}")
        print(f"  docs/s: liandan {speed['liandan']:,}, datatrove {speed['datatrove']:,}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
