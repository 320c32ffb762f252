"""Near-duplicate detection on one CPU core: liandan's MinHash + LSH against datatrove's MinHash pipeline and
datasketch's MinHash + MinHashLSH, on the same corpus, scored against exact Jaccard similarity.

    python benchmarks/near_dedup.py                     # about 18,000 documents, 3 rounds, about 3 minutes
    python benchmarks/near_dedup.py --json results.json
    python benchmarks/near_dedup.py --datatrove-python /path/to/venv/bin/python

datatrove runs in its own interpreter (default: this one if datatrove's MinHash runs in it, else /tmp/dtvenv/bin/python),
because its shingling calls xxhash with str, which xxhash 4 (liandan's) rejects. Set that interpreter up with

    python -m venv /tmp/dtvenv
    /tmp/dtvenv/bin/pip install datatrove spacy jieba tokenizers orjson "xxhash<4"

Corpus (deterministic): paragraphs of WikiText-2, speeches of the Shakespeare text and Chinese classics from the
shared data, plus planted near duplicates: copies of 3,000 random documents (some copied twice) with 0-20% of
their words (characters in Chinese) substituted, deleted or inserted, some also re-cased and re-punctuated.

Ground truth: exact Jaccard similarity of liandan's shingle sets (word 5-grams of
words(normalize_for_matching(text)); every CJK character is a word), all pairs at or above 0.7 found by a
prefix-filtered similarity join. A document is a true duplicate when some other document has J >= 0.8 with it.

Methods, each pinned to one core (os.sched_setaffinity), times in wall seconds:

* liandan: `exact_hashes` + `MinHasher.signatures` saved to .npy (phase 1), then `find_duplicates` (phase 2),
  which confirms candidates by exact Jaccard (the default, `verify`; texts held in memory here).
* datatrove: MinhashDedupSignature, MinhashDedupBuckets and MinhashDedupCluster run with LocalPipelineExecutor,
  workers=1, its default MinhashConfig (5-grams, 14 buckets x 8 hashes, 64-bit). Its tokenizers are language
  specific (spaCy for English, spaCy + jieba for Chinese), so English and Chinese documents go through two
  pipelines (no planted pair crosses languages) and the times are added. Shingles are its own: its text
  normalization and tokens differ a little from liandan's, which the scores reflect.
* datasketch: the same shingles as liandan, built in Python, `MinHash.bulk` (SHA-1 per shingle, affine32),
  `MinHashLSH` query-then-insert per document; pairs found are merged into clusters.

Each method runs --repeats times (default 3) in interleaved rounds; the median time is reported. liandan's
runs (and datasketch's, which use liandan's text units for its shingles) start without the per-process lookup
tables of liandan's text units, as a fresh worker process would (about 0.2 s to build).
Every method runs with datatrove's banding (14 bands of 8 rows of 112 permutations), so the recall is comparable
and the speed ratio compares implementations; liandan and datasketch also run with the bands each chooses for
threshold 0.8. Scores: recall = true duplicates put in a cluster; precision = clustered documents that are true
duplicates (and, looser, that have a partner with J >= 0.7); pair recall = pairs with J >= 0.8 in one cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "corpus"
THRESHOLD = 0.8
DATATROVE_BANDS = (14, 8)


# -- corpus and ground truth ------------------------------------------------------------------------------------
def build_corpus(seed: int, planted: int) -> tuple[list[str], list[str]]:
    """Texts and their language ("en" or "zh")."""
    import random

    with (SHARED / "en-wikitext2.jsonl").open() as handle:
        articles = [json.loads(line)["text"] for line in handle]
    english = [p.strip() for a in articles for p in a.split("\n") if len(p.split()) >= 10]
    english += [s.strip() for s in (SHARED / "en-shakespeare.txt").read_text().split("\n\n") if len(s.split()) >= 10]
    with (SHARED / "zh-classics.jsonl").open() as handle:
        chinese = [t for line in handle if len(t := json.loads(line)["text"]) >= 20]
    texts, languages = english + chinese, ["en"] * len(english) + ["zh"] * len(chinese)
    rng = random.Random(seed)
    for source in rng.sample(range(len(texts)), planted):
        for _ in range(rng.choice([1, 1, 1, 2])):
            texts.append(_edit(texts[source], languages[source], rng))
            languages.append(languages[source])
    order = list(range(len(texts)))
    rng.shuffle(order)  # copies are not always after their source
    return [texts[i] for i in order], [languages[i] for i in order]


def _edit(text: str, language: str, rng) -> str:
    units = list(text) if language == "zh" else text.split(" ")
    rate = rng.choice([0.0, 0.01, 0.03, 0.05, 0.08, 0.12, 0.2])
    filler = "天地玄黄宇宙洪荒日月盈昃" if language == "zh" else ["the", "very", "quite", "sudden", "green", "ten"]
    for _ in range(max(1, round(rate * len(units))) if rate else 0):
        at = rng.randrange(len(units))
        action = rng.random()
        if action < 0.5:
            units[at] = rng.choice(filler)
        elif action < 0.75 and len(units) > 1:
            del units[at]
        else:
            units.insert(at, rng.choice(filler))
    out = ("" if language == "zh" else " ").join(units)
    if rng.random() < 0.3:
        out = out.upper().replace(",", " ,").replace("，", ",")
    return out


def ground_truth(texts: list[str], threshold: float):
    """All pairs (i, j, J) with J >= threshold of liandan's shingle sets, exactly (prefix filtering, as
    `liandan.data.dedup.dedup_eval.similar_pairs` does it)."""
    from liandan.data.dedup.dedup_eval import all_shingle_sets, similar_pairs
    from liandan.data.dedup.minhash import jaccard

    sets = all_shingle_sets(texts)
    return [(a, b, jaccard(sets[a], sets[b])) for a, b in similar_pairs(sets, threshold).tolist()]


def score(cluster_of, pairs, chinese) -> dict[str, float]:
    import numpy as np

    n = len(cluster_of)
    strict, loose = np.zeros(n, bool), np.zeros(n, bool)
    together = []
    for a, b, s in pairs:
        loose[[a, b]] = True
        if s >= THRESHOLD:
            strict[[a, b]] = True
            together.append(cluster_of[a] == cluster_of[b] and cluster_of[a] >= 0)
    flagged = cluster_of >= 0
    return {
        "recall": float((flagged & strict).sum() / max(strict.sum(), 1)),
        "recall_en": float((flagged & strict & ~chinese).sum() / max((strict & ~chinese).sum(), 1)),
        "recall_zh": float((flagged & strict & chinese).sum() / max((strict & chinese).sum(), 1)),
        "precision": float((flagged & strict).sum() / max(flagged.sum(), 1)),
        "precision_j07": float((flagged & loose).sum() / max(flagged.sum(), 1)),
        "pair_recall": float(np.mean(together)) if together else 1.0,
        "flagged": int(flagged.sum()),
    }


def clusters_from_pairs(n: int, a, b):
    """cluster id per document (-1 alone) from duplicate pairs, by connected components."""
    import numpy as np
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    graph = coo_matrix((np.ones(len(a)), (np.asarray(a, int), np.asarray(b, int))), shape=(n, n))
    _, label = connected_components(graph, directed=False)
    size = np.bincount(label)
    return np.where(size[label] > 1, label, -1)


# -- the methods --------------------------------------------------------------------------------------------------
def _forget_text_tables() -> None:
    """Drop the per-process lookup tables of liandan's text units (built on first use, under a second)."""
    from liandan.data.dedup import minhash
    from liandan.data.documents import text

    minhash._code_point_tables.cache_clear()
    text._punctuation_table.cache_clear()


def run_liandan(texts: list[str], bands_rows: tuple[int, int] | None, work: Path) -> tuple[float, object]:
    import numpy as np

    from liandan.data.dedup.dedup import MinHasher, NearDedupParams, exact_hashes, find_duplicates

    bands, rows = bands_rows or (0, 0)
    params = NearDedupParams(threshold=THRESHOLD, num_perm=112, bands=bands, rows=rows)
    _forget_text_tables()  # a fresh process pays for building them: so does this run
    start = time.perf_counter()
    hasher = MinHasher(params)
    exact, signatures = [], []
    for task, lo in enumerate(range(0, len(texts), 5000)):  # a few tasks, as the pipeline makes them
        exact.append(work / f"{task}.exact.npy")
        signatures.append(work / f"{task}.minhash.npy")
        np.save(exact[-1], exact_hashes(texts[lo : lo + 5000]))
        np.save(signatures[-1], hasher.signatures(texts[lo : lo + 5000]))
    result = find_duplicates(exact, signatures, params, work / "dedup", texts)  # verify is on by default
    return time.perf_counter() - start, result.cluster_of


def run_datasketch(texts: list[str], configs: dict[str, dict]) -> dict[str, tuple[float, object]]:
    """One signature pass shared by every LSH configuration; each configuration's time includes it."""
    import numpy as np
    from datasketch import MinHash, MinHashLSH

    from liandan.data.documents.text import normalize_for_matching, words

    _forget_text_tables()
    start = time.perf_counter()
    shingle_lists = []
    for text in texts:
        tokens = words(normalize_for_matching(text))
        grams = [" ".join(tokens[i : i + 5]) for i in range(max(len(tokens) - 4, 1))] if tokens else []
        shingle_lists.append([g.encode() for g in grams])
    minhashes = MinHash.bulk(shingle_lists, num_perm=112)
    signature_time = time.perf_counter() - start
    out = {}
    for name, kwargs in configs.items():
        start = time.perf_counter()
        lsh = MinHashLSH(num_perm=112, **kwargs)
        pairs_a, pairs_b = [], []
        for i, (m, shingles) in enumerate(zip(minhashes, shingle_lists)):
            if not shingles:
                continue
            for j in lsh.query(m):
                pairs_a.append(j)
                pairs_b.append(i)
            lsh.insert(i, m)
        cluster_of = clusters_from_pairs(len(texts), pairs_a, pairs_b)
        out[name] = (signature_time + time.perf_counter() - start, np.asarray(cluster_of))
    return out


def run_datatrove(python: str, texts: list[str], languages: list[str], work: Path) -> tuple[float, object, dict]:
    import numpy as np

    spec = {"work": str(work), "languages": {}}
    for language in ("en", "zh"):
        indices = [i for i, lang in enumerate(languages) if lang == language]
        folder = work / language / "input"
        folder.mkdir(parents=True)
        with (folder / "docs.jsonl").open("w") as handle:
            for i in indices:
                handle.write(json.dumps({"id": str(i), "text": texts[i]}) + "\n")
        spec["languages"][language] = indices
    (work / "spec.json").write_text(json.dumps(spec))
    worker = subprocess.run(
        [python, __file__, "--datatrove-worker", str(work / "spec.json")], capture_output=True, text=True, check=False
    )
    if worker.returncode != 0:
        sys.exit(f"datatrove failed:\n{worker.stderr[-3000:]}")
    report = json.loads((work / "report.json").read_text())
    cluster_of = np.full(len(texts), -1, np.int64)
    next_id = 0
    for language, indices in spec["languages"].items():
        local = np.asarray(report["clusters"][language], np.int64).reshape(-1, 2)
        if len(local):
            ids, local_cluster = np.unique(local[:, 1], return_inverse=True)
            cluster_of[np.asarray(indices)[local[:, 0]]] = next_id + local_cluster
            next_id += len(ids)
    return report["seconds"], cluster_of, report["stages"]


def datatrove_worker(spec_path: str) -> None:
    """Runs inside datatrove's interpreter: the three MinHash stages per language, timed."""
    import logging
    import struct

    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from loguru import logger

    try:  # datatrove >= 0.5 names languages by ISO 639-3 and hashes str, which xxhash 4 refuses
        import datatrove.utils.hashes.xxhash as datatrove_xxhash
        import xxhash
        from datatrove.utils.typeshelper import Languages

        names = {"en": Languages.english, "zh": Languages.chinese}
        if int(xxhash.VERSION.split(".")[0]) >= 4:
            datatrove_xxhash.xxhash64 = lambda d: xxhash.xxh64_intdigest(d.encode() if isinstance(d, str) else d)
            datatrove_xxhash.xxhash32 = lambda d: xxhash.xxh32_intdigest(d.encode() if isinstance(d, str) else d)
    except ImportError:
        names = {"en": "en", "zh": "zh"}

    logger.remove()
    logging.disable(logging.WARNING)
    spec = json.loads(Path(spec_path).read_text())
    config = MinhashConfig()  # 5-grams, 14 buckets x 8 hashes
    total, stages, clusters = 0.0, {}, {}
    for language in spec["languages"]:
        base = Path(spec["work"]) / language
        runs = [
            ("signatures", 1, [JsonlReader(str(base / "input")), MinhashDedupSignature(str(base / "sigs"), config=config, language=names[language])]),
            ("buckets", config.num_buckets, [MinhashDedupBuckets(str(base / "sigs"), str(base / "buckets"), config=config)]),
            ("cluster", 1, [MinhashDedupCluster(str(base / "buckets"), str(base / "remove"), config=config, save_cluster_id=True)]),
        ]  # fmt: skip
        for name, tasks, pipeline in runs:
            executor = LocalPipelineExecutor(pipeline, tasks=tasks, workers=1, logging_dir=str(base / f"logs-{name}"))
            start = time.perf_counter()
            executor.run()
            seconds = time.perf_counter() - start
            stages[f"{language} {name}"] = round(seconds, 3)
            total += seconds
        found = base / "remove" / "000000.clusters"
        raw = found.read_bytes() if found.exists() else b""
        clusters[language] = list(struct.unpack(f"<{len(raw) // 4}I", raw))
    report = {"seconds": total, "stages": stages, "clusters": clusters}
    (Path(spec["work"]) / "report.json").write_text(json.dumps(report))


def find_datatrove_python(given: str | None) -> str | None:
    candidates = [given] if given else [sys.executable, "/tmp/dtvenv/bin/python"]
    for python in candidates:
        if python and Path(python).exists():
            # Importing is not enough: with xxhash 4 datatrove's MinHash fails on its first shingle.
            check = "import spacy; from datatrove.utils.hashes.xxhash import xxhash64; xxhash64('shingle')"
            probe = subprocess.run([python, "-c", check], capture_output=True, check=False)
            if probe.returncode == 0:
                return python
    return None


# -- main ---------------------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--planted", type=int, default=3000, help="documents copied with edits")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3, help="rounds of every method; medians are reported")
    parser.add_argument("--datatrove-python", default=None, help="an interpreter that imports datatrove")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    import numpy as np

    if not SHARED.is_dir():
        sys.exit(f"shared data not found at {SHARED}")
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core, for us and the datatrove child

    texts, languages = build_corpus(args.seed, args.planted)
    n = len(texts)
    start = time.perf_counter()
    pairs = ground_truth(texts, 0.7)
    truth_seconds = time.perf_counter() - start
    strong = sum(s >= THRESHOLD for _, _, s in pairs)
    print(f"corpus: {n} documents ({languages.count('zh')} Chinese); {strong} pairs with J >= {THRESHOLD}, "
          f"{len(pairs) - strong} more with J >= 0.7 (ground truth in {truth_seconds:.1f} s)")  # fmt: skip

    python = find_datatrove_python(args.datatrove_python)
    if python is None:
        print("datatrove: no interpreter with datatrove + spacy found (see the top of this file); skipped")
    seconds: dict[str, list[float]] = {}
    clusters, stages = {}, {}
    # interleaved rounds: a load spike from another process is shared rather than landing on one method
    for round_number in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            timed = {}
            for name, bands_rows in (("liandan 14x8", DATATROVE_BANDS), ("liandan (0.8 -> own bands)", None)):
                (work / name).mkdir()
                timed[name] = run_liandan(texts, bands_rows, work / name)
            timed.update(run_datasketch(
                texts, {"datasketch 14x8": {"params": DATATROVE_BANDS}, "datasketch (0.8 -> own bands)": {"threshold": THRESHOLD}}
            ))  # fmt: skip
            if python is not None:
                (work / "datatrove").mkdir()
                elapsed, cluster_of, stages = run_datatrove(python, texts, languages, work / "datatrove")
                timed["datatrove 14x8"] = (elapsed, cluster_of)
        for name, (elapsed, cluster_of) in timed.items():
            seconds.setdefault(name, []).append(elapsed)
            clusters[name] = cluster_of
        print(f"round {round_number + 1}: " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in timed.items()))
    rows = {name: (statistics.median(seconds[name]), clusters[name]) for name in seconds}

    from liandan.data.dedup.minhash import NearDedupParams

    own = NearDedupParams(threshold=THRESHOLD).bands_rows
    print(f"\nliandan's own bands for 0.8 (verified): {own}; datasketch's: MinHashLSH(threshold=0.8)")
    columns = ("seconds", "docs/s/core", "recall", "en", "zh", "precision", "prec J>=.7", "pair recall")
    print(f"{'method':30}" + "".join(f"{c:>12}" for c in columns))
    chinese = np.array([lang == "zh" for lang in languages])
    results = {}
    for name, (seconds, cluster_of) in rows.items():
        s = score(cluster_of, pairs, chinese)
        results[name] = {"seconds": round(seconds, 3), "docs_per_s": round(n / seconds), **s}
        values = (s["recall"], s["recall_en"], s["recall_zh"], s["precision"], s["precision_j07"], s["pair_recall"])
        print(f"{name:30}{seconds:12.2f}{n / seconds:12,.0f}" + "".join(f"{v:12.3f}" for v in values))
    ratios = {
        f"liandan/{peer.split()[0]}": round(results[peer]["seconds"] / results["liandan 14x8"]["seconds"], 1)
        for peer in ("datatrove 14x8", "datasketch 14x8")
        if peer in results
    }
    print("\nspeed ratios (same bands): " + ", ".join(f"{k} {v}x" for k, v in ratios.items()))
    if stages:
        print("datatrove stages (s): " + ", ".join(f"{k} {v}" for k, v in stages.items()))
    if args.json:
        report = {"documents": n, "results": results, "ratios": ratios, "datatrove_stages": stages}
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--datatrove-worker":
        datatrove_worker(sys.argv[2])
    else:
        main()
