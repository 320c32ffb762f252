"""Precision and recall of liandan's near dedup with its DEFAULT settings, against exact Jaccard ground truth.

    python benchmarks/dedup_quality.py                  # both corpora, about a minute
    python benchmarks/dedup_quality.py --json quality.json

Corpora:
* planted: the corpus of benchmarks/near_dedup.py (WikiText-2 paragraphs, Shakespeare speeches, Chinese
  classics from the shared data, plus 3,000 documents copied with 0-20% of their words edited).
* unplanted: the same shared documents with nothing planted: whatever near duplicates real text holds.

Each corpus is split into tasks of 5,000 documents as the pipeline would: per task, `exact_hashes` and
`MinHasher.signatures` (.npy) and the texts as a .jsonl.zst shard; then `find_duplicates` with the defaults
(`NearDedupParams()`: threshold 0.8, 112 permutations, verify on, 18 bands of 6 rows), streaming the texts
from the shards (`ShardTexts`). The previous default (no verification, 11 bands of 10 rows) runs too, for
comparison.

Ground truth (`liandan.data.dedup.dedup_eval`): every pair with Jaccard >= 0.8 of liandan's shingle sets, by
prefix filtering (exact by the prefix-filter lemma), checked against a brute-force sparse product that counts
the common shingles of every pair sharing at least one shingle; the script stops if the two differ. Scores
are document-level, see `score_removals`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

THRESHOLD = 0.8
TASK_DOCUMENTS = 5000


def write_tasks(texts: list[str], work: Path) -> tuple[list[Path], list[Path], list[Path], list[int]]:
    """Per task of TASK_DOCUMENTS texts: exact hashes, signatures (defaults) and a .jsonl.zst shard."""
    import numpy as np
    import zstandard

    from liandan.data.dedup.dedup import MinHasher, NearDedupParams, exact_hashes

    hasher = MinHasher(NearDedupParams())
    exact, sigs, shards, counts = [], [], [], []
    for task, lo in enumerate(range(0, len(texts), TASK_DOCUMENTS)):
        chunk = texts[lo : lo + TASK_DOCUMENTS]
        exact.append(work / f"{task:05d}.exact.npy")
        sigs.append(work / f"{task:05d}.minhash.npy")
        shards.append(work / f"{task:05d}.jsonl.zst")
        np.save(exact[-1], exact_hashes(chunk))
        np.save(sigs[-1], hasher.signatures(chunk))
        lines = "".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in chunk)
        shards[-1].write_bytes(zstandard.ZstdCompressor(level=3).compress(lines.encode()))
        counts.append(len(chunk))
    return exact, sigs, shards, counts


def measure(name: str, texts: list[str]) -> dict:
    import numpy as np

    from liandan.data.dedup.dedup import NearDedupParams, ShardTexts, find_duplicates
    from liandan.data.dedup.dedup_eval import all_shingle_sets, overlapping_pairs, score_removals, similar_pairs

    start = time.perf_counter()
    sets = all_shingle_sets(texts)
    pairs = similar_pairs(sets, THRESHOLD)
    truth_seconds = time.perf_counter() - start
    brute_force = overlapping_pairs(sets, THRESHOLD)
    if not np.array_equal(pairs, brute_force):
        sys.exit(f"{name}: prefix filtering found {len(pairs)} pairs, brute force {len(brute_force)}")
    out = {"documents": len(texts), "pairs_at_threshold": len(pairs), "ground_truth_seconds": round(truth_seconds, 1)}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        exact, sigs, shards, counts = write_tasks(texts, work)
        for label, params in (
            ("default (verify, 18x6)", NearDedupParams()),
            ("previous default (no verify, 11x10)", NearDedupParams(verify=False)),
        ):
            start = time.perf_counter()
            result = find_duplicates(exact, sigs, params, work / "dedup", ShardTexts(shards, counts))
            seconds = time.perf_counter() - start
            scores = score_removals(result.remove, result.cluster_of, sets, pairs, THRESHOLD)
            out[label] = {
                **scores,
                "global_phase_seconds": round(seconds, 2),
                "candidate_pairs": result.stats["candidate_pairs"],
                "rejected_by_verification": result.stats["rejected_by_verification"],
                "bands": f"{result.stats['bands']}x{result.stats['rows']}",
            }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from near_dedup import SHARED, build_corpus

    if not SHARED.is_dir():
        sys.exit(f"shared data not found at {SHARED}")
    report = {}
    for name, planted in (("planted", 3000), ("unplanted", 0)):
        texts, _ = build_corpus(args.seed, planted)
        report[name] = measure(name, texts)
        r = report[name]
        print(f"\n{name}: {r['documents']} documents, {r['pairs_at_threshold']} pairs at J >= {THRESHOLD} "
              f"(ground truth {r['ground_truth_seconds']} s, prefix filtering == brute force)")  # fmt: skip
        columns = ("removed", "due", "precision", "prec any", "recall", "rec comp", "candidates", "rejected", "s")
        print(f"{'settings':38}" + "".join(f"{c:>11}" for c in columns))
        for label, s in r.items():
            if isinstance(s, dict):
                values = (s["removed"], s["due"], f"{s['precision']:.4f}", f"{s['precision_any']:.4f}",
                          f"{s['recall']:.4f}", f"{s['recall_components']:.4f}", s["candidate_pairs"],
                          s["rejected_by_verification"], s["global_phase_seconds"])  # fmt: skip
                print(f"{label:38}" + "".join(f"{v:>11}" for v in values))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
