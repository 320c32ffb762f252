"""Generate a large corpus with planted near duplicates for the dedup scale benchmark (benchmarks/dedup_scale.py).

    python benchmarks/gen_dedup_corpus.py OUT --documents 1000000

Documents are drawn from the shared text's own vocabulary: English documents are 40-200 words sampled with the
word frequencies of WikiText-2 and the Shakespeare text, Chinese documents 60-300 characters sampled with the
character frequencies of the Chinese classics (a quarter of the documents). Sampled independently, unrelated
documents share almost no 5-gram, so the near duplicates are the planted ones plus whatever chance gives.
Planted: 12% of the documents are copies of earlier ones, with 0-12% of their words (characters) substituted,
deleted or inserted (a copy may be copied again). Documents are shuffled and written as .jsonl.zst shards of
10,000 (fields id, text, lang), plus planted.json (copy -> source, edit rate).
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"
SHARD = 10_000
RATES = np.array([0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.12])


def vocabularies() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    english: Counter[str] = Counter()
    with (SHARED / "en-wikitext2.jsonl").open() as handle:
        for line in handle:
            english.update(re.findall(r"[A-Za-z']+", json.loads(line)["text"]))
    english.update(re.findall(r"[A-Za-z']+", (SHARED / "en-shakespeare.txt").read_text()))
    chinese: Counter[str] = Counter()
    with (SHARED / "zh-classics.jsonl").open() as handle:
        for line in handle:
            chinese.update(c for c in json.loads(line)["text"] if "\u4e00" <= c <= "\u9fff")
    out = {}
    for lang, counts in (("en", english), ("zh", chinese)):
        units = np.array(list(counts))
        freq = np.array(list(counts.values()), float)
        out[lang] = (units, freq / freq.sum())
    return out


def edit(units: list[str], rate: float, vocabulary: np.ndarray, rng: np.random.Generator) -> list[str]:
    units = list(units)
    for _ in range(round(rate * len(units))):
        at = int(rng.integers(len(units)))
        action = rng.random()
        if action < 0.5:
            units[at] = str(vocabulary[rng.integers(len(vocabulary))])
        elif action < 0.75 and len(units) > 1:
            del units[at]
        else:
            units.insert(at, str(vocabulary[rng.integers(len(vocabulary))]))
    return units


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--documents", type=int, default=1_000_000)
    parser.add_argument("--planted-share", type=float, default=0.12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    vocab = vocabularies()
    n = args.documents
    copies = int(n * args.planted_share)
    originals = n - copies
    langs = np.where(rng.random(originals) < 0.25, "zh", "en")
    docs: list[list[str]] = []
    for lang in ("en", "zh"):
        units, freq = vocab[lang]
        count = int((langs == lang).sum())
        lo, hi = (40, 200) if lang == "en" else (60, 300)
        lengths = rng.integers(lo, hi + 1, count)
        drawn = units[rng.choice(len(units), int(lengths.sum()), p=freq)]
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        docs.extend(drawn[a:b].tolist() for a, b in itertools.pairwise(bounds.tolist()))
    languages = ["en"] * int((langs == "en").sum()) + ["zh"] * int((langs == "zh").sum())
    planted = {}
    for _ in range(copies):
        source = int(rng.integers(len(docs)))
        rate = float(rng.choice(RATES))
        units = vocab[languages[source]][0]
        docs.append(edit(docs[source], rate, units, rng))
        languages.append(languages[source])
        planted[len(docs) - 1] = (source, rate)
    order = rng.permutation(len(docs))
    position = np.empty_like(order)
    position[order] = np.arange(len(order))
    args.out.mkdir(parents=True, exist_ok=True)
    import zstandard

    for shard, lo in enumerate(range(0, len(order), SHARD)):
        lines = []
        for i in order[lo : lo + SHARD].tolist():
            text = ("" if languages[i] == "zh" else " ").join(docs[i])
            lines.append(json.dumps({"id": int(position[i]), "text": text, "lang": languages[i]}, ensure_ascii=False))
        data = ("\n".join(lines) + "\n").encode()
        (args.out / f"{shard:05d}.jsonl.zst").write_bytes(zstandard.ZstdCompressor(level=3).compress(data))
    mapping = {int(position[c]): [int(position[s]), r] for c, (s, r) in planted.items()}
    (args.out / "planted.json").write_text(json.dumps({"documents": len(docs), "copies": mapping}))
    print(f"{len(docs)} documents ({languages.count('zh')} Chinese, {copies} planted copies) -> {args.out}")


if __name__ == "__main__":
    main()
