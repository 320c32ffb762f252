"""Exact and near-duplicate removal over a whole corpus, in two phases.

1. Per task, in parallel: `exact_hashes(texts)` and `MinHasher(params).signatures(texts)` for the task's
   documents, in order, saved as .npy files (see `liandan.data.minhash` for how they are computed).
2. Once: `find_duplicates(exact_files, signature_files, params, work_dir)` reads every task's files (signatures
   memory-mapped) and returns which documents to remove, numbering documents globally by concatenating the
   tasks in the order given.

Documents with the same exact hash are duplicates. Near duplicates come from LSH banding: the signature is cut
into b bands of r rows; two documents whose band k is equal are candidates, optionally confirmed by the exact
Jaccard similarity of their n-gram sets (`params.verify`, which needs `text_of`). Each band is handled on its
own: one pass over the signature files hashes every band of every document to 64 bits and writes the keys
to `work_dir` (band-major), then each band's keys are sorted and equal neighbours become candidate pairs. Pairs
join clusters with scipy's connected components; the document with the smallest global index in each cluster
is kept. Peak memory is about 100 bytes per document whatever num_perm is, plus one chunk of signatures.
Documents without any word get no near-duplicate candidates (exact dedup still compares them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from scipy.sparse import coo_matrix
from scipy.sparse.csgraph import connected_components

from liandan.data.corpus import DataError
from liandan.data.minhash import (
    EMPTY,
    MinHasher,
    NearDedupParams,
    exact_hashes,
    fmix64,
    jaccard,
    optimal_bands,
    splitmix64,
)

__all__ = ["DedupResult", "MinHasher", "NearDedupParams", "exact_hashes", "find_duplicates", "optimal_bands"]

_ROWS_PER_CHUNK = 1 << 16  # signature rows read at a time when hashing bands


@dataclass
class DedupResult:
    remove: np.ndarray  # bool per document
    cluster_of: np.ndarray  # int64 per document, -1 for documents without duplicates
    stats: dict[str, Any]

    def clusters_sample(self, k: int) -> list[np.ndarray]:
        """Up to k clusters spread evenly over the corpus, each as its members' indices, ascending (the
        document kept first)."""
        count = int(self.stats["clusters"])
        if count == 0 or k <= 0:
            return []
        chosen = np.unique(np.linspace(0, count - 1, min(k, count)).round().astype(np.int64))
        order = np.argsort(self.cluster_of, kind="stable")
        ids = self.cluster_of[order]
        lo, hi = np.searchsorted(ids, chosen, "left"), np.searchsorted(ids, chosen, "right")
        return [order[a:b] for a, b in zip(lo, hi)]


def find_duplicates(
    exact_files: Sequence[Path],
    signature_files: Sequence[Path],
    params: NearDedupParams,
    work_dir: Path,
    text_of: Callable[[int], str] | None = None,
) -> DedupResult:
    """Which documents to remove, over the concatenation of the tasks' files (see the module doc). Either list
    may be empty, which turns that kind of dedup off; otherwise file i of both lists comes from task i."""
    exact = [_load(Path(f), 2, np.uint64, "exact hashes", "exact_hashes") for f in exact_files]
    signatures = [
        _load(Path(f), params.num_perm, np.uint32, "MinHash signatures", f"MinHasher(num_perm={params.num_perm})")
        for f in signature_files
    ]
    if exact and signatures:
        if len(exact) != len(signatures):
            raise DataError(f"{len(exact)} exact-hash files but {len(signatures)} signature files")
        for ef, e, sf, sig in zip(exact_files, exact, signature_files, signatures):
            if len(e) != len(sig):
                raise DataError(f"{ef} has {len(e)} documents but {sf} has {len(sig)}: they must come from one task")
    if signatures and params.verify and text_of is None:
        raise DataError("near-dedup verification (verify = true) needs the documents' texts (text_of)")
    n = sum(len(a) for a in (exact or signatures))
    parent = np.arange(n, dtype=np.int64)

    exact_duplicates = 0
    if exact:
        heads, members = _equal_runs(np.concatenate(exact))
        _link(parent, heads, members)
        exact_duplicates = len(members)

    bands, rows = params.bands_rows
    near_stats: dict[str, Any] = {}
    if signatures:
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        verifier = _Verifier(MinHasher(params), text_of, params.threshold) if params.verify and text_of else None
        near_stats = _link_near_duplicates(parent, signatures, bands, rows, work_dir / "band_keys.npy", verifier)

    result = _result(parent, exact_duplicates)
    result.stats.update(near_stats)
    if signatures:
        result.stats.update(
            threshold=params.threshold,
            num_perm=params.num_perm,
            ngram=params.ngram,
            bands=bands,
            rows=rows,
            verified=params.verify,
        )
    return result


def _link_near_duplicates(
    parent: np.ndarray,
    signatures: list[np.ndarray],
    bands: int,
    rows: int,
    keys_path: Path,
    verifier: _Verifier | None,
) -> dict[str, int]:
    has_words = _write_band_keys(signatures, bands, rows, keys_path)
    keys = np.load(keys_path, mmap_mode="r")
    live = np.flatnonzero(has_words)
    candidates = 0
    for band in range(bands if len(live) > 1 else 0):
        heads, members = _equal_runs(np.asarray(keys[band])[live])
        heads, members = live[heads], live[members]
        new = _roots(parent, heads) != _roots(parent, members)
        heads, members = heads[new], members[new]
        candidates += len(heads)
        if verifier is not None:
            keep = verifier.confirm(heads, members)
            heads, members = heads[keep], members[keep]
        _link(parent, heads, members)
    del keys
    keys_path.unlink()
    return {
        "candidate_pairs": candidates,
        "rejected_by_verification": verifier.rejected if verifier else 0,
        "documents_without_words": int(len(has_words) - len(live)),
    }


def _load(path: Path, width: int, dtype: type, what: str, producer: str) -> np.ndarray:
    if not path.is_file():
        raise DataError(f"{what} file not found: {path}")
    try:
        array = np.load(path, mmap_mode="r")
    except (ValueError, OSError) as err:
        raise DataError(f"cannot read {what} from {path}: {err}") from None
    if array.ndim != 2 or array.shape[1] != width or array.dtype != dtype:
        raise DataError(
            f"{path} holds a {array.dtype} array of shape {array.shape}; expected {what} of shape "
            f"(documents, {width}) {np.dtype(dtype)} as {producer} writes them"
        )
    return array


def _equal_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For keys (n,) or rows (n, w): pairs (first index, other index) for every index whose key occurs at a
    smaller index too; the first is the smallest index with that key."""
    if len(keys) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if keys.ndim == 1:
        order = np.argsort(keys, kind="stable")
        ordered = keys[order]
        same = ordered[1:] == ordered[:-1]
    else:
        order = np.lexsort(keys.T[::-1])
        ordered = keys[order]
        same = (ordered[1:] == ordered[:-1]).all(axis=1)
    positions = np.arange(1, len(keys))
    run_start = np.maximum.accumulate(np.where(same, 0, positions))
    return order[run_start[same]], order[positions[same]]


@functools.cache
def _band_weights(rows: int) -> np.ndarray:
    return np.array(splitmix64(0x62616E64, rows), np.uint64) | np.uint64(1)


def _write_band_keys(signatures: list[np.ndarray], bands: int, rows: int, path: Path) -> np.ndarray:
    """Hash band k of every document to 64 bits into a (bands, documents) .npy at `path`, reading each
    signature file once; return which documents have words (a signature other than all EMPTY)."""
    n = sum(len(s) for s in signatures)
    keys = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint64, shape=(bands, n))
    has_words = np.zeros(n, bool)
    weights = _band_weights(rows)
    start = 0
    for sig in signatures:
        for lo in range(0, len(sig), _ROWS_PER_CHUNK):
            chunk = np.asarray(sig[lo : lo + _ROWS_PER_CHUNK, : bands * rows])
            at = slice(start + lo, start + lo + len(chunk))
            has_words[at] = (chunk != EMPTY).any(axis=1)
            by_band = chunk.reshape(len(chunk), bands, rows).astype(np.uint64)
            keys[:, at] = fmix64(by_band @ weights).T  # wrap-around uint64 dot product
        start += len(sig)
    keys.flush()
    return has_words


def _roots(parent: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    roots = parent[nodes]
    while True:
        up = parent[roots]
        if np.array_equal(up, roots):
            return roots
        roots = up


def _link(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Merge the clusters of a[i] and b[i] for every i; a cluster's root is its smallest document index, and
    only roots are re-pointed (so `_roots` follows at most one hop per earlier merge)."""
    if len(a) == 0:
        return
    ra, rb = _roots(parent, a), _roots(parent, b)
    nodes, inverse = np.unique(np.concatenate([ra, rb]), return_inverse=True)
    pairs = len(ra)
    graph = coo_matrix((np.ones(pairs, np.int8), (inverse[:pairs], inverse[pairs:])), shape=(len(nodes),) * 2)
    _, label = connected_components(graph, directed=False)
    _, first = np.unique(label, return_index=True)  # nodes ascend, so a label's first node is its smallest
    parent[nodes] = nodes[first[label]]


def _result(parent: np.ndarray, exact_duplicates: int) -> DedupResult:
    n = len(parent)
    while True:  # point every document straight at its root
        up = parent[parent]
        if np.array_equal(up, parent):
            break
        parent = up
    size = np.bincount(parent, minlength=n)
    in_cluster = size[parent] > 1
    cluster_roots = np.flatnonzero((size > 1) & (parent == np.arange(n)))
    cluster_of = np.where(in_cluster, np.searchsorted(cluster_roots, parent), -1).astype(np.int64)
    remove = in_cluster & (parent != np.arange(n))
    removed = int(remove.sum())
    stats = {
        "documents": n,
        "removed": removed,
        "exact_duplicates": exact_duplicates,
        "near_duplicates": removed - exact_duplicates,
        "clusters": len(cluster_roots),
        "largest_cluster": int(size.max()) if len(cluster_roots) else 0,
    }
    return DedupResult(remove, cluster_of, stats)


class _Verifier:
    """Keeps candidate pairs whose n-gram sets really have Jaccard similarity >= threshold."""

    def __init__(self, hasher: MinHasher, text_of: Callable[[int], str], threshold: float) -> None:
        self.threshold = threshold
        self.shingles = functools.lru_cache(maxsize=1 << 16)(lambda i: hasher.shingles(text_of(int(i))))
        self.seen_rejected: set[tuple[int, int]] = set()

    @property
    def rejected(self) -> int:
        return len(self.seen_rejected)

    def confirm(self, heads: np.ndarray, members: np.ndarray) -> np.ndarray:
        keep = np.zeros(len(heads), bool)
        for i, pair in enumerate(zip(heads.tolist(), members.tolist())):
            if pair in self.seen_rejected:
                continue
            keep[i] = jaccard(self.shingles(pair[0]), self.shingles(pair[1])) >= self.threshold
            if not keep[i]:
                self.seen_rejected.add(pair)
        return keep
