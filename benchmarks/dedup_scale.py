"""Near dedup at scale: liandan (phase 1 per shard, then the band-split global phase with verification, on
local processes) against datasketch (MinHash + MinHashLSH) and datatrove's four MinHash stages, on a corpus
made by benchmarks/gen_dedup_corpus.py. Documents per second, peak memory (RSS of the driver and of the
largest worker process) and precision/recall against exact Jaccard ground truth.

    python benchmarks/gen_dedup_corpus.py /tmp/dedup1m --documents 1000000
    python benchmarks/dedup_scale.py liandan /tmp/dedup1m /tmp/scale/liandan-1m --workers 2
    python benchmarks/dedup_scale.py liandan /tmp/dedup1m /tmp/scale/liandan-100k --limit 100000 --workers 2
    python benchmarks/dedup_scale.py datasketch /tmp/dedup1m /tmp/scale/datasketch-100k --limit 100000
    python benchmarks/dedup_scale.py datatrove /tmp/dedup1m /tmp/scale/datatrove-100k --limit 100000 --workers 2
    python benchmarks/dedup_scale.py score /tmp/dedup1m /tmp/scale/*      # ground truth and scores

Each method runs in its own process and writes remove.npy / cluster.npy (per document, in corpus order) and
result.json (seconds per phase, documents/s, peak RSS). `--limit N` takes the first N documents (whole
shards). Every method removes, in each of its clusters, all but the document that comes first.

Ground truth (`score`): every pair with Jaccard >= 0.8 of liandan's shingle sets, by prefix filtering in hash
order (exact by the prefix-filter lemma, for any fixed global order of the shingles); scores as
`liandan.data.dedup.dedup_eval.score_removals`, each method on the documents it was given.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import numpy as np

THRESHOLD = 0.8
sys.path.insert(0, str(Path(__file__).resolve().parent))


def shards(corpus: Path, limit: int | None) -> list[Path]:
    files = sorted(corpus.glob("*.jsonl.zst"))
    if limit:
        files = files[: -(-limit // 10_000)]
    return files


def read_texts(path: Path) -> list[dict]:
    from liandan.data.pipeline.pipeline import read_jsonl_zst

    return list(read_jsonl_zst(path))


def peak_rss_mb() -> dict[str, float]:
    """Peak RSS of this process and of its largest child, and the CPU seconds of both (on a shared, loaded
    machine the CPU time says more about the work than the wall time)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {
        "driver_peak_rss_mb": round(own.ru_maxrss / 1024, 1),
        "worker_peak_rss_mb": round(children.ru_maxrss / 1024, 1),
        "cpu_s": round(own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime, 1),
    }


def save(out: Path, remove: np.ndarray, cluster_of: np.ndarray, result: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "remove.npy", remove)
    np.save(out / "cluster.npy", cluster_of)
    (out / "result.json").write_text(json.dumps({**result, **peak_rss_mb()}, indent=2) + "\n")
    print(json.dumps({**result, **peak_rss_mb()}))


def remove_all_but_first(cluster_of: np.ndarray) -> np.ndarray:
    remove = np.zeros(len(cluster_of), bool)
    clustered = np.flatnonzero(cluster_of >= 0)
    _, first = np.unique(cluster_of[clustered], return_index=True)
    remove[clustered] = True
    remove[clustered[first]] = False
    return remove


# -- liandan ------------------------------------------------------------------------------------------------------
def liandan_phase1(shard: str, out: str) -> int:
    from liandan.data.dedup.dedup import MinHasher, NearDedupParams, exact_hashes

    texts = [r["text"] for r in read_texts(Path(shard))]
    stem = Path(out) / Path(shard).name.split(".")[0]
    np.save(f"{stem}.exact.npy", exact_hashes(texts))
    np.save(f"{stem}.minhash.npy", MinHasher(NearDedupParams()).signatures(texts))
    return len(texts)


def run_liandan(corpus: Path, out: Path, limit: int | None, workers: int) -> None:
    from liandan.data.dedup.dedup import NearDedupParams, ShardTexts, find_duplicates
    from liandan.data.pipeline.executor import LocalExecutor

    files = shards(corpus, limit)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    executor = LocalExecutor(workers)
    start = time.perf_counter()
    counts = executor.map(liandan_phase1, [(str(f), str(work)) for f in files], "signatures")
    phase1 = time.perf_counter() - start
    exact = [work / f"{f.name.split('.')[0]}.exact.npy" for f in files]
    sigs = [work / f"{f.name.split('.')[0]}.minhash.npy" for f in files]
    start = time.perf_counter()
    result = find_duplicates(
        exact, sigs, NearDedupParams(), work / "dedup", ShardTexts(files, counts), workers=workers, executor=executor
    )
    phase2 = time.perf_counter() - start
    n = sum(counts)
    stats = {k: v for k, v in result.stats.items() if isinstance(v, int | float | str | bool)}
    save(out, result.remove, result.cluster_of, {
        "method": "liandan", "documents": n, "workers": workers, "phase1_s": round(phase1, 1),
        "phase2_s": round(phase2, 1), "seconds": round(phase1 + phase2, 1),
        "docs_per_s": round(n / (phase1 + phase2)), "stats": stats,
    })  # fmt: skip
    for f in [*exact, *sigs]:
        f.unlink()


# -- datasketch ---------------------------------------------------------------------------------------------------
def run_datasketch(corpus: Path, out: Path, limit: int | None) -> None:
    from datasketch import MinHash, MinHashLSH
    from near_dedup import clusters_from_pairs

    from liandan.data.documents.text import normalize_for_matching, words

    records = [r for f in shards(corpus, limit) for r in read_texts(f)]
    start = time.perf_counter()
    lsh = MinHashLSH(threshold=THRESHOLD, num_perm=112)
    pairs_a, pairs_b = [], []
    for lo in range(0, len(records), 10_000):
        batch = []
        for r in records[lo : lo + 10_000]:
            tokens = words(normalize_for_matching(r["text"]))
            grams = [" ".join(tokens[i : i + 5]) for i in range(max(len(tokens) - 4, 1))] if tokens else []
            batch.append([g.encode() for g in grams])
        for i, m in enumerate(MinHash.bulk(batch, num_perm=112), start=lo):
            for j in lsh.query(m):
                pairs_a.append(j)
                pairs_b.append(i)
            lsh.insert(i, m)
    cluster_of = np.asarray(clusters_from_pairs(len(records), pairs_a, pairs_b))
    seconds = time.perf_counter() - start
    save(out, remove_all_but_first(cluster_of), cluster_of, {
        "method": "datasketch", "documents": len(records), "workers": 1, "seconds": round(seconds, 1),
        "docs_per_s": round(len(records) / seconds),
    })  # fmt: skip


# -- datatrove ----------------------------------------------------------------------------------------------------
def run_datatrove(corpus: Path, out: Path, limit: int | None, workers: int) -> None:
    """Its four stages (signatures, buckets, cluster, filter) with LocalPipelineExecutor, English and Chinese as
    two pipelines (its word tokenizers are per language); the input split is not timed."""
    import datatrove.utils.hashes.xxhash as datatrove_xxhash
    import xxhash
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (
        MinhashConfig,
        MinhashDedupBuckets,
        MinhashDedupCluster,
        MinhashDedupFilter,
        MinhashDedupSignature,
    )
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers import JsonlWriter
    from datatrove.utils.typeshelper import Languages

    # datatrove hashes str, which xxhash 4 refuses; xxhash 3 hashed its UTF-8 bytes, as this does
    datatrove_xxhash.xxhash64 = lambda data: xxhash.xxh64_intdigest(data.encode() if isinstance(data, str) else data)
    datatrove_xxhash.xxhash32 = lambda data: xxhash.xxh32_intdigest(data.encode() if isinstance(data, str) else data)
    records = [r for f in shards(corpus, limit) for r in read_texts(f)]
    n = len(records)
    for lang in ("en", "zh"):
        folder = out / lang / "input"
        folder.mkdir(parents=True, exist_ok=True)
        mine = [r for r in records if r["lang"] == lang]
        per = -(-len(mine) // workers)
        for k in range(workers):
            with (folder / f"{k}.jsonl").open("w") as handle:
                for r in mine[k * per : (k + 1) * per]:
                    handle.write(json.dumps({"id": str(r["id"]), "text": r["text"]}, ensure_ascii=False) + "\n")
    del records
    config = MinhashConfig()
    stages: dict[str, float] = {}
    start = time.perf_counter()
    for lang, language in (("en", Languages.english), ("zh", Languages.chinese)):
        base = out / lang
        runs = [
            ("signatures", workers, [JsonlReader(str(base / "input")), MinhashDedupSignature(str(base / "sigs"), config=config, language=language)]),
            ("buckets", config.num_buckets, [MinhashDedupBuckets(str(base / "sigs"), str(base / "buckets"), config=config)]),
            ("cluster", 1, [MinhashDedupCluster(str(base / "buckets"), str(base / "remove"), config=config, save_cluster_id=True)]),
            ("filter", workers, [JsonlReader(str(base / "input")), MinhashDedupFilter(str(base / "remove"), load_cluster_ids=True), JsonlWriter(str(base / "kept"))]),
        ]  # fmt: skip
        for name, tasks, pipeline in runs:
            executor = LocalPipelineExecutor(
                pipeline, tasks=tasks, workers=workers, logging_dir=str(base / f"logs-{name}")
            )
            t0 = time.perf_counter()
            executor.run()
            stages[f"{lang} {name}"] = round(time.perf_counter() - t0, 1)
    seconds = time.perf_counter() - start
    kept: set[int] = set()
    for lang in ("en", "zh"):
        import gzip

        for path in sorted((out / lang / "kept").glob("*")):
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt") as handle:
                kept.update(int(json.loads(line)["id"]) for line in handle)
    remove = np.ones(n, bool)
    remove[list(kept)] = False
    cluster_of = np.where(remove, 0, -1)  # datatrove reports removals; clusters are not compared
    save(out, remove, cluster_of, {
        "method": "datatrove", "documents": n, "workers": workers, "seconds": round(seconds, 1),
        "docs_per_s": round(n / seconds), "stages": stages,
    })  # fmt: skip


# -- ground truth and scores --------------------------------------------------------------------------------------
def exact_pairs(sets: list[np.ndarray], threshold: float) -> np.ndarray:
    """Every pair with Jaccard >= threshold: prefix filtering with the shingles in hash order (each set is
    sorted by hash, so its prefix is its first |A| - ceil(t|A|) + 1 values)."""
    from liandan.data.dedup.dedup_bands import bucket_pairs
    from liandan.data.dedup.minhash import jaccard

    sizes = np.array([len(s) for s in sets], np.int64)
    keep = np.where(sizes > 0, sizes - np.ceil(threshold * sizes - 1e-9).astype(np.int64) + 1, 0)
    tokens = np.concatenate([s[:k] for s, k in zip(sets, keep.tolist())])
    docs = np.repeat(np.arange(len(sets)), keep)
    a, b = bucket_pairs(tokens, every_pair_up_to=1 << 30)
    a, b = docs[a], docs[b]
    pairs = np.unique(np.minimum(a, b) * len(sets) + np.maximum(a, b))
    pairs = pairs[pairs // len(sets) != pairs % len(sets)]
    found = [(p // len(sets), p % len(sets)) for p in pairs.tolist()]
    good = [(x, y) for x, y in found if jaccard(sets[x], sets[y]) >= threshold]
    return np.array(good, np.int64).reshape(-1, 2)


def score(corpus: Path, outputs: list[Path]) -> None:
    from liandan.data.dedup.dedup_eval import all_shingle_sets, score_removals

    results = [json.loads((o / "result.json").read_text()) for o in outputs]
    n = max(r["documents"] for r in results)
    start = time.perf_counter()
    cache = corpus / f"truth-{n}.npz"  # shingle sets and pairs, kept for the next scoring
    if cache.is_file():
        saved = np.load(cache)
        flat, offsets, pairs = saved["flat"], saved["offsets"], saved["pairs"]
        sets = [flat[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)]
    else:
        texts = [r["text"] for f in shards(corpus, n) for r in read_texts(f)]
        sets = all_shingle_sets(texts)
        del texts
        pairs = exact_pairs(sets, THRESHOLD)
        offsets = np.concatenate([[0], np.cumsum([len(x) for x in sets])])
        np.savez(cache, flat=np.concatenate(sets), offsets=offsets, pairs=pairs)
    print(
        f"ground truth: {len(pairs)} pairs at J >= {THRESHOLD} among {n} documents ({time.perf_counter() - start:.0f} s)"
    )
    for out, result in zip(outputs, results):
        m = result["documents"]
        sub = pairs[(pairs < m).all(axis=1)]
        scores = score_removals(np.load(out / "remove.npy"), np.load(out / "cluster.npy"), sets[:m], sub, THRESHOLD)
        if result["method"] == "datatrove":  # no clusters: a removal counts if any document is close to it
            scores["precision"] = scores["precision_any"]
        result["scores"] = scores
        (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
        print(out.name, json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("method", choices=["liandan", "datasketch", "datatrove", "score"])
    parser.add_argument("corpus", type=Path)
    parser.add_argument("out", type=Path, nargs="+")
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    if args.method == "score":
        score(args.corpus, args.out)
    elif args.method == "liandan":
        run_liandan(args.corpus, args.out[0], args.limit, args.workers)
    elif args.method == "datasketch":
        run_datasketch(args.corpus, args.out[0], args.limit)
    else:
        run_datatrove(args.corpus, args.out[0], args.limit, args.workers)


if __name__ == "__main__":
    main()
