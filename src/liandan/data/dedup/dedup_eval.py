"""How good a deduplication is, measured against exact Jaccard similarity under liandan's own shingling.

Ground truth: `similar_pairs` finds every pair of documents whose shingle sets have Jaccard similarity >= t by
prefix filtering, which is exact: order all shingles rarest first; if |A ∩ B| >= t |A ∪ B| then A and B share
one of the first |A| - ceil(t |A|) + 1 shingles of A (otherwise the intersection would fit in the rest of A,
which is smaller than t |A| <= t |A ∪ B|), so every such pair shares a prefix shingle and is checked exactly.
`overlapping_pairs` is the brute-force cross-check on small corpora: a sparse documents x shingles product
counts the common shingles of every pair that has any, so no pair can be missed.

Scores (`score_removals`), at document level:
* precision: removed documents with Jaccard >= t to a kept document of their cluster; `precision_any`:
  removed documents with Jaccard >= t to any document.
* recall: in each ground-truth cluster (connected component of the pairs at >= t) the removal rule applied
  with every similarity known (`greedy_removals`: in index order, a document goes if it has Jaccard >= t
  with a document kept before it) says how many documents should go; recall is the share of those
  removals made (counting at most that many per ground-truth cluster). `recall_components` asks instead
  for all but one document of each ground-truth cluster, chains included (a ~ b ~ c with a, c apart).
Documents without shingles (no word) are left out of both.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.sparse import coo_matrix, csr_matrix
from scipy.sparse.csgraph import connected_components

from liandan.data.dedup.dedup_bands import shingle_sets
from liandan.data.dedup.minhash import _batches, jaccard


def all_shingle_sets(texts: Sequence[str], ngram: int = 5) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    for lo, hi in _batches(texts):
        out.extend(shingle_sets(texts[lo:hi], ngram))
    return out


def similar_pairs(sets: Sequence[np.ndarray], threshold: float) -> np.ndarray:
    """Every pair (i, j), i < j, with Jaccard(sets[i], sets[j]) >= threshold, as (k, 2) int64 (prefix
    filtering, see the module doc)."""
    if not sets:
        return np.zeros((0, 2), np.int64)
    values, counts = np.unique(np.concatenate(sets), return_counts=True)
    rank_of = np.empty(len(values), np.int64)
    rank_of[np.lexsort((values, counts))] = np.arange(len(values))
    tokens, docs = [], []
    for doc, shingles in enumerate(sets):
        if len(shingles) == 0:
            continue
        ranks = np.sort(rank_of[np.searchsorted(values, shingles)])
        keep = len(ranks) - int(np.ceil(threshold * len(ranks) - 1e-9)) + 1
        tokens.append(ranks[:keep])
        docs.append(np.full(keep, doc))
    if not tokens:
        return np.zeros((0, 2), np.int64)
    token, doc = np.concatenate(tokens), np.concatenate(docs)
    order = np.lexsort((doc, token))
    token, doc = token[order], doc[order]
    bounds = np.flatnonzero(np.diff(token)) + 1
    candidates = set()
    for group in np.split(doc, bounds):
        if len(group) > 1:
            members = group.tolist()
            candidates.update((a, b) for i, a in enumerate(members) for b in members[i + 1 :])
    found = [(a, b) for a, b in sorted(candidates) if jaccard(sets[a], sets[b]) >= threshold]
    return np.array(found, np.int64).reshape(-1, 2)


def overlapping_pairs(sets: Sequence[np.ndarray], threshold: float, block: int = 2000) -> np.ndarray:
    """The same pairs as `similar_pairs`, by counting the common shingles of every pair that has one."""
    values = np.unique(np.concatenate(sets)) if sets else np.zeros(0, np.uint64)
    sizes = np.array([len(s) for s in sets], np.int64)
    columns = np.concatenate([np.searchsorted(values, s) for s in sets]) if sets else np.zeros(0, np.int64)
    rows = np.repeat(np.arange(len(sets)), sizes)
    matrix = csr_matrix((np.ones(len(rows), np.int32), (rows, columns)), shape=(len(sets), len(values)))
    transposed = matrix.T.tocsr()
    found = []
    for lo in range(0, len(sets), block):
        common = (matrix[lo : lo + block] @ transposed).tocoo()
        a, b, inter = common.row + lo, common.col, common.data
        union = sizes[a] + sizes[b] - inter
        keep = (a < b) & (inter >= threshold * union - 1e-9) & (union > 0)
        found.append(np.stack([a[keep], b[keep]], axis=1))
    pairs = np.concatenate(found) if found else np.zeros((0, 2), np.int64)
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))].astype(np.int64)


def greedy_removals(members: Sequence[int], sets: Sequence[np.ndarray], threshold: float) -> list[int]:
    """The documents of one cluster (ascending) that the removal rule drops when every similarity is known: in
    index order, a document goes if it has Jaccard >= threshold with a document kept before it."""
    kept: list[int] = []
    removed = []
    for m in members:
        if any(jaccard(sets[m], sets[k]) >= threshold for k in kept):
            removed.append(m)
        else:
            kept.append(m)
    return removed


def score_removals(
    remove: np.ndarray, cluster_of: np.ndarray, sets: Sequence[np.ndarray], pairs: np.ndarray, threshold: float
) -> dict[str, float]:
    """Document precision and recall of a dedup's removals against the ground-truth `pairs` (see the module doc)."""
    n = len(remove)
    has_shingles = np.array([len(s) > 0 for s in sets], bool)
    removed = np.flatnonzero(remove & has_shingles)
    kept_of: dict[int, list[int]] = {}
    for i in np.flatnonzero((cluster_of >= 0) & ~remove).tolist():
        kept_of.setdefault(int(cluster_of[i]), []).append(i)
    backed = sum(
        any(jaccard(sets[i], sets[k]) >= threshold for k in kept_of.get(int(cluster_of[i]), []))
        for i in removed.tolist()
    )
    partnered = np.zeros(n, bool)
    partnered[pairs.ravel()] = True
    graph = coo_matrix((np.ones(len(pairs)), (pairs[:, 0], pairs[:, 1])), shape=(n, n))
    components, label = connected_components(graph, directed=False)
    size = np.bincount(label, minlength=components)
    order = np.argsort(label, kind="stable")
    bounds = np.searchsorted(label[order], np.arange(components + 1))
    ideal = np.zeros(components, np.int64)
    for c in np.flatnonzero(size > 1).tolist():
        ideal[c] = len(greedy_removals(order[bounds[c] : bounds[c + 1]].tolist(), sets, threshold))
    removed_in = np.bincount(label[removed], minlength=components)
    return {
        "precision": float(backed / len(removed)) if len(removed) else 1.0,
        "precision_any": float(partnered[removed].mean()) if len(removed) else 1.0,
        "recall": float(np.minimum(removed_in, ideal).sum() / ideal.sum()) if ideal.sum() else 1.0,
        "recall_components": float(np.minimum(removed_in, size - 1).sum() / (size - 1).sum()) if n else 1.0,
        "removed": len(removed),
        "due": int(ideal.sum()),
        "due_components": int((size - 1).sum()),
        "pairs": len(pairs),
    }
