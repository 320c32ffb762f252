"""The near-duplicate global phase for a range of LSH bands: candidate pairs, their exact-Jaccard confirmation
and the clusters they form, as one picklable job a local process or a Ray task can run.

`band_edges(job)` reads every task's signature file in chunks, hashes its bands of every document to 64-bit keys
(one pass over the files, keys written band-major to a file in the job's work folder), and in each band takes
as candidates the documents with equal keys (`bucket_pairs`: every pair of a small bucket, a chain through a
large one), a set that depends on the band alone.
The unique candidate pairs of all its bands are then confirmed in batches: a batch needs at most
`batch_documents` documents, whose texts are read from the `TextSource` in one pass (shard by shard) and
turned into shingle sets; a pair is linked only if the exact Jaccard similarity of the two sets reaches the
threshold, and pairs whose documents are already linked are not checked again. The job returns a spanning
forest of what it linked (an edge from every document to its cluster's smallest document: at most n - 1
edges), so the driver's union of the jobs' forests has the same clusters as one process checking every band.

Memory of one job, for n documents: about 40 bytes per document (cluster parents, one band's keys and their
sort order, which documents have words) plus 8 per band of the job (its band keys file, memory-mapped), one
chunk of signature rows (65,536 rows), 16 bytes per unique candidate pair of its bands, and one batch of
shingle sets (8 bytes per shingle plus about 100 bytes per document, for `batch_documents` documents: about
130 MB for 100,000 documents of 150 shingles).
"""

from __future__ import annotations

import functools
import io
import itertools
import json
import resource
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

import numpy as np

from liandan.data.dedup.minhash import EMPTY, NearDedupParams, fmix64, jaccard, ngram_hashes, splitmix64

_ROWS_PER_CHUNK = 1 << 16  # signature rows read at a time when hashing bands
BATCH_DOCUMENTS = 100_000  # documents whose shingle sets one verification batch holds


class TextSource(Protocol):
    """Texts of documents by global index (tasks concatenated in order); picklable, so jobs can carry it."""

    def read(self, ids: np.ndarray) -> Iterator[tuple[np.ndarray, list[str]]]:
        """The texts of `ids` (sorted, unique) in chunks of (their ids, their texts)."""
        ...


class InMemoryTexts:
    """A list of texts held in memory (for tests and benchmarks; the pipeline streams its shards)."""

    def __init__(self, texts: Sequence[str]):
        self.texts = list(texts)

    def read(self, ids: np.ndarray) -> Iterator[tuple[np.ndarray, list[str]]]:
        yield ids, [self.texts[i] for i in ids.tolist()]


class ShardTexts:
    """Documents stored as .jsonl.zst (or plain .jsonl) shards (one JSON object per line with a text field), `counts[k]` lines in
    shard k. A read decompresses each shard that holds a wanted document once, as a stream, parsing only the
    wanted lines; nothing but the wanted texts is kept."""

    def __init__(self, paths: Sequence[str | Path], counts: Sequence[int], text_field: str = "text"):
        if len(paths) != len(counts):
            raise ValueError(f"{len(paths)} shards but {len(counts)} document counts")
        self.paths = [str(p) for p in paths]
        self.offsets = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))])
        self.text_field = text_field

    def read(self, ids: np.ndarray) -> Iterator[tuple[np.ndarray, list[str]]]:
        shard_of = np.searchsorted(self.offsets, ids, "right") - 1
        for shard in np.unique(shard_of).tolist():
            wanted = ids[shard_of == shard]
            lines = set((wanted - self.offsets[shard]).tolist())
            texts: list[str] = []
            with open(self.paths[shard], "rb") as raw:
                # lines stay bytes: only the wanted ones are decoded and parsed
                reader = _decompressed(raw) if self.paths[shard].endswith(".zst") else raw
                last = max(lines)
                for number, line in enumerate(reader):
                    if number in lines:
                        texts.append(json.loads(line)[self.text_field])
                    if number == last:
                        break
            if len(texts) != len(wanted):
                raise ValueError(f"{self.paths[shard]} holds fewer than {last + 1} documents")
            yield wanted, texts


def _decompressed(raw: BinaryIO) -> io.BufferedReader:
    import zstandard

    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw), 1 << 20)


def shingle_sets(texts: Sequence[str], ngram: int) -> list[np.ndarray]:
    """The shingle set of each text (sorted unique n-gram hashes), as `MinHasher.shingles` makes them."""
    hashes, offsets = ngram_hashes(texts, ngram)
    return [np.unique(hashes[a:b]) for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]


@dataclass(frozen=True)
class BandJob:
    signature_files: tuple[str, ...]
    band_range: tuple[int, int]  # [first, last) band
    rows: int
    params: NearDedupParams
    work_dir: str
    exact_parents: str = ""  # .npy of int64 per document: its exact duplicates' smallest index ("" for none)
    texts: TextSource | None = None  # None: candidates are linked unconfirmed (verify = false)
    batch_documents: int = BATCH_DOCUMENTS


def band_edges(job: BandJob) -> dict[str, Any]:
    """Run one job (see the module doc): its spanning forest as `edges` (2, k) int64 and its counts."""
    n = sum(np.load(f, mmap_mode="r").shape[0] for f in job.signature_files)
    first, last = job.band_range
    work = Path(job.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    keys_path = work / f"band_keys_{first}_{last}.npy"
    has_words = write_band_keys(job.signature_files, first, last, job.rows, keys_path)
    parent = np.load(job.exact_parents) if job.exact_parents else np.arange(n, dtype=np.int64)
    live = np.flatnonzero(has_words)
    keys = np.load(keys_path, mmap_mode="r")
    found = []
    for band in range(last - first if len(live) > 1 else 0):
        heads, members = bucket_pairs(np.asarray(keys[band])[live])
        heads, members = live[heads], live[members]
        new = parent[heads] != parent[members]  # exact duplicates are linked already
        found.append(heads[new] * n + members[new])
    del keys
    keys_path.unlink()
    pairs = np.unique(np.concatenate(found)) if found else np.zeros(0, np.int64)
    heads, members = pairs // max(n, 1), pairs % max(n, 1)
    del pairs
    checked = rejected = 0
    if job.texts is None:
        link(parent, heads, members)
    else:
        per_batch = max(1, job.batch_documents // 2)
        for lo in range(0, len(heads), per_batch):
            a, b = heads[lo : lo + per_batch], members[lo : lo + per_batch]
            new = roots(parent, a) != roots(parent, b)
            a, b = a[new], b[new]
            keep = confirm_pairs(a, b, job.texts, job.params, job.batch_documents)
            checked += len(a)
            rejected += int((~keep).sum())
            link(parent, a[keep], b[keep])
    top = flatten(parent)
    linked = np.flatnonzero(top != np.arange(n))
    return {
        "edges": np.stack([top[linked], linked]),
        "candidate_pairs": len(heads),
        "verified_pairs": checked,
        "rejected_by_verification": rejected,
        "documents_without_words": int(n - len(live)),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),  # of the process
    }


def confirm_pairs(
    a: np.ndarray, b: np.ndarray, texts: TextSource, params: NearDedupParams, batch_documents: int
) -> np.ndarray:
    """Whether each pair (a[i], b[i]) has exact Jaccard >= threshold, reading the texts of at most
    `batch_documents` documents at a time (one pass over the source per batch)."""
    keep = np.zeros(len(a), bool)
    per_batch = max(1, batch_documents // 2)
    for lo in range(0, len(a), per_batch):
        batch_a, batch_b = a[lo : lo + per_batch], b[lo : lo + per_batch]
        ids = np.unique(np.concatenate([batch_a, batch_b]))
        sets: list[np.ndarray] = [np.zeros(0, np.uint64)] * len(ids)
        for chunk_ids, chunk_texts in texts.read(ids):
            for i, shingles in zip(np.searchsorted(ids, chunk_ids).tolist(), shingle_sets(chunk_texts, params.ngram)):
                sets[i] = shingles
        at_a, at_b = np.searchsorted(ids, batch_a).tolist(), np.searchsorted(ids, batch_b).tolist()
        keep[lo : lo + len(batch_a)] = [jaccard(sets[i], sets[j]) >= params.threshold for i, j in zip(at_a, at_b)]
    return keep


# -- bands --------------------------------------------------------------------------------------------------------
@functools.cache
def _band_weights(rows: int) -> np.ndarray:
    return np.array(splitmix64(0x62616E64, rows), np.uint64) | np.uint64(1)


def _signature_chunks(path: str) -> Iterator[np.ndarray]:
    """The rows of a signature .npy in chunks of _ROWS_PER_CHUNK, read into memory rather than memory-mapped:
    a band job reads every page of the file, and mapped pages would stay in its resident set."""
    mapped = np.load(path, mmap_mode="r")  # for its header only: shape, dtype, where the data starts
    (length, width), dtype, offset = mapped.shape, mapped.dtype, mapped.offset
    del mapped
    with open(path, "rb") as handle:
        handle.seek(offset)
        for lo in range(0, length, _ROWS_PER_CHUNK):
            count = min(_ROWS_PER_CHUNK, length - lo)
            yield np.fromfile(handle, dtype, count * width).reshape(count, width)


def write_band_keys(signature_files: Sequence[str], first: int, last: int, rows: int, path: Path) -> np.ndarray:
    """Hash bands [first, last) of every document to 64 bits into a (bands, documents) .npy at `path`, reading
    each signature file once; return which documents have words (a signature other than all EMPTY)."""
    counts = [np.load(f, mmap_mode="r").shape[0] for f in signature_files]
    n = sum(counts)
    keys = np.lib.format.open_memmap(path, mode="w+", dtype=np.uint64, shape=(last - first, n))
    has_words = np.zeros(n, bool)
    weights = _band_weights(rows)
    start = 0
    for file in signature_files:
        for chunk in _signature_chunks(file):
            at = slice(start, start + len(chunk))
            # EMPTY fills every column of a document without words; every job looks at the same column
            has_words[at] = chunk[:, 0] != EMPTY
            by_band = chunk[:, first * rows : last * rows].reshape(len(chunk), last - first, rows).astype(np.uint64)
            keys[:, at] = fmix64(by_band @ weights).T  # wrap-around uint64 dot product
            start += len(chunk)
        keys.flush()
    return has_words


def split_bands(bands: int, parts: int) -> list[tuple[int, int]]:
    """[first, last) band ranges of near-equal size, at most `parts` of them."""
    bounds = np.linspace(0, bands, min(parts, bands) + 1).round().astype(int).tolist()
    return list(itertools.pairwise(bounds))


# -- clusters -------------------------------------------------------------------------------------------------------
def equal_runs(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


def bucket_pairs(keys: np.ndarray, every_pair_up_to: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Candidate pairs (a, b), a < b, among indices with equal keys: every pair of a bucket of at most
    `every_pair_up_to` members (so a near-duplicate pair sharing a bucket with unrelated documents is still
    checked), and in a larger bucket each member with its first and with its predecessor (a chain through the
    bucket, linear in its size)."""
    if len(keys) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    order = np.argsort(keys, kind="stable")  # equal keys stay in index order
    ordered = keys[order]
    starts = np.flatnonzero(np.concatenate([[True], ordered[1:] != ordered[:-1]]))
    sizes = np.diff(np.append(starts, len(keys)))
    a_parts, b_parts = [], []
    for size in np.unique(sizes[(sizes >= 2) & (sizes <= every_pair_up_to)]).tolist():
        first, second = np.triu_indices(size, 1)
        base = starts[sizes == size][:, None]
        a_parts.append((base + first).ravel())
        b_parts.append((base + second).ravel())
    for start, size in zip(starts[sizes > every_pair_up_to].tolist(), sizes[sizes > every_pair_up_to].tolist()):
        rest = np.arange(start + 1, start + size)
        a_parts += [np.full(size - 1, start), rest[:-1]]
        b_parts += [rest, rest[1:]]
    if not a_parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return order[np.concatenate(a_parts)], order[np.concatenate(b_parts)]


def roots(parent: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    found = parent[nodes]
    while True:
        up = parent[found]
        if np.array_equal(up, found):
            return found
        found = up


def link(parent: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Merge the clusters of a[i] and b[i] for every i; a cluster's root is its smallest document index, and
    only roots are re-pointed (so `roots` follows at most one hop per earlier merge)."""
    if len(a) == 0:
        return
    # here, not at the top: every training process imports the pipeline, and few of them dedup (0.2 s a process)
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    ra, rb = roots(parent, a), roots(parent, b)
    nodes, inverse = np.unique(np.concatenate([ra, rb]), return_inverse=True)
    pairs = len(ra)
    graph = coo_matrix((np.ones(pairs, np.int8), (inverse[:pairs], inverse[pairs:])), shape=(len(nodes),) * 2)
    _, label = connected_components(graph, directed=False)
    _, first = np.unique(label, return_index=True)  # nodes ascend, so a label's first node is its smallest
    parent[nodes] = nodes[first[label]]


def flatten(parent: np.ndarray) -> np.ndarray:
    """Every document's root (parent pointers followed to the end)."""
    while True:
        up = parent[parent]
        if np.array_equal(up, parent):
            return parent
        parent = up
