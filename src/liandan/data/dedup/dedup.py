"""Exact and near-duplicate removal over a whole corpus, in two phases.

1. Per task, in parallel: `exact_hashes(texts)` and `MinHasher(params).signatures(texts)` for the task's
   documents, in order, saved as .npy files (see `liandan.data.dedup.minhash` for how they are computed).
2. Once: `find_duplicates(exact_files, signature_files, params, work_dir, texts)` reads every task's files
   (signatures memory-mapped) and returns which documents to remove, numbering documents globally by
   concatenating the tasks in the order given.

Documents with the same exact hash are duplicates. Near duplicates come from LSH banding: the signature is cut
into b bands of r rows; two documents whose band k is equal are candidates, and a candidate pair counts only
once the exact Jaccard similarity of the two documents' shingle sets reaches the threshold (`params.verify`,
on by default; the texts are streamed from a `TextSource`, shard by shard). Because verification guards
precision, the default bands are chosen for recall (see `NearDedupParams`). Clusters are the connected
components of exact-duplicate pairs and confirmed pairs only; the document with the smallest global index in
each cluster is kept, so every removal is backed by a chain of confirmed pairs.

The near phase is split by band (`liandan.data.dedup.dedup_bands`): `workers` jobs each take a range of bands, find
and confirm their candidates and return a spanning forest of what they linked; the driver unions the forests.
The clusters do not depend on how the bands are split, so one process, local processes and Ray tasks give the
same removals. Documents without any word get no near-duplicate candidates (exact dedup still compares them).
Driver memory: about 40 bytes per document plus the forests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from liandan.data.dedup.dedup_bands import (
    BATCH_DOCUMENTS,
    BandJob,
    InMemoryTexts,
    ShardTexts,
    TextSource,
    band_edges,
    confirm_pairs,
    equal_runs,
    flatten,
    link,
    split_bands,
)
from liandan.data.dedup.minhash import MinHasher, NearDedupParams, exact_hashes, optimal_bands
from liandan.data.documents.corpus import DataError

_MAX_ROUNDS = 8  # of the check that every removed document has a kept near duplicate


class JobRunner(Protocol):
    """Runs the band jobs in parallel: the pipeline's executors (`liandan.data.pipeline.executor`) are such."""

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple], description: str) -> list[Any]: ...


__all__ = [
    "DedupResult",
    "InMemoryTexts",
    "MinHasher",
    "NearDedupParams",
    "ShardTexts",
    "TextSource",
    "exact_hashes",
    "find_duplicates",
    "optimal_bands",
]


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
    texts: TextSource | Sequence[str] | None = None,
    workers: int = 1,
    executor: JobRunner | None = None,
    batch_documents: int = BATCH_DOCUMENTS,
) -> DedupResult:
    """Which documents to remove, over the concatenation of the tasks' files (see the module doc). Either list
    may be empty, which turns that kind of dedup off; otherwise file i of both lists comes from task i.
    `texts` (a TextSource, or the texts themselves) is needed when params.verify is on. The near phase runs
    as `workers` jobs split by band, on `executor` (in this process when it is None)."""
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
    if signatures and params.verify and texts is None:
        raise DataError("near-dedup verification (verify = true) needs the documents' texts")
    if workers < 1:
        raise DataError(f"near-dedup workers must be at least 1, got {workers}")
    n = sum(len(a) for a in (exact or signatures))
    parent = np.arange(n, dtype=np.int64)

    exact_duplicates = 0
    if exact:
        heads, members = equal_runs(np.concatenate(exact))
        link(parent, heads, members)
        exact_duplicates = len(members)
    exact_parent = flatten(parent).copy()
    remove = None

    bands, rows = params.bands_rows
    near_stats: dict[str, Any] = {}
    if signatures:
        work_dir = Path(work_dir)
        work_dir.mkdir(parents=True, exist_ok=True)
        job = BandJob(
            signature_files=tuple(str(Path(f).resolve()) for f in signature_files),
            band_range=(0, bands),
            rows=rows,
            params=params,
            work_dir=str(work_dir.resolve()),
            texts=_text_source(texts) if params.verify else None,
            batch_documents=batch_documents,
        )
        if exact_duplicates:
            np.save(work_dir / "exact_parents.npy", flatten(parent))
            job = replace(job, exact_parents=str((work_dir / "exact_parents.npy").resolve()))
        jobs = [(replace(job, band_range=r),) for r in split_bands(bands, workers)]
        if executor is None or len(jobs) == 1:
            outcomes = [band_edges(*j) for j in jobs]
        else:
            outcomes = executor.map(band_edges, jobs, "dedup: bands")
        for outcome in outcomes:
            link(parent, *outcome.pop("edges"))
        (work_dir / "exact_parents.npy").unlink(missing_ok=True)
        near_stats = {
            key: sum(o[key] for o in outcomes)
            for key in ("candidate_pairs", "verified_pairs", "rejected_by_verification")
        }
        near_stats["documents_without_words"] = outcomes[0]["documents_without_words"]
        near_stats["band_jobs"] = len(jobs)
        near_stats["band_job_peak_rss_mb"] = max(o["peak_rss_mb"] for o in outcomes)
        if job.texts is not None:
            remove, near_stats["kept_without_kept_near_duplicate"] = _backed_removals(
                flatten(parent), exact_parent, job.texts, params, batch_documents
            )

    result = _result(parent, exact_duplicates, remove)
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


def _text_source(texts: TextSource | Sequence[str] | None) -> TextSource | None:
    if texts is None or hasattr(texts, "read"):
        return texts  # type: ignore[return-value]
    return InMemoryTexts(texts)  # type: ignore[arg-type]


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


def _backed_removals(
    root: np.ndarray, exact_root: np.ndarray, texts: TextSource, params: NearDedupParams, batch_documents: int
) -> tuple[np.ndarray, int]:
    """Which clustered documents to remove so that every removed one has Jaccard >= threshold with a kept one
    of its cluster (a chain of confirmed pairs alone does not say so: a ~ b and b ~ c, yet c may be far from
    a). Each cluster keeps its first document; in rounds, the undecided members are checked against the
    cluster's newest kept document, those that match are removed, and the first of the rest is kept too.
    Exact duplicates match without reading their texts. Depends only on the clusters, so it is the same
    however the bands were split; members still undecided after _MAX_ROUNDS are kept."""
    n = len(root)
    remove = np.zeros(n, bool)
    pending = np.flatnonzero(root != np.arange(n))
    against = root[pending]
    for _ in range(_MAX_ROUNDS):
        if len(pending) == 0:
            break
        same = exact_root[pending] == exact_root[against]
        match = same.copy()
        match[~same] = confirm_pairs(against[~same], pending[~same], texts, params, batch_documents)
        remove[pending[match]] = True
        pending = pending[~match]
        _, first = np.unique(root[pending], return_index=True)  # pending ascends: first = smallest per cluster
        kept = np.zeros(len(pending), bool)
        kept[first] = True
        newest = np.full(n, -1, np.int64)
        newest[root[pending[first]]] = pending[first]
        pending = pending[~kept]
        against = newest[root[pending]]
    return remove, int((root != np.arange(n)).sum() - remove.sum())


def _result(parent: np.ndarray, exact_duplicates: int, remove: np.ndarray | None = None) -> DedupResult:
    n = len(parent)
    parent = flatten(parent)
    size = np.bincount(parent, minlength=n)
    in_cluster = size[parent] > 1
    cluster_roots = np.flatnonzero((size > 1) & (parent == np.arange(n)))
    cluster_of = np.where(in_cluster, np.searchsorted(cluster_roots, parent), -1).astype(np.int64)
    if remove is None:
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
