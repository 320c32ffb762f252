"""Hashing text for deduplication and decontamination: word and n-gram hashes, exact-duplicate hashes and MinHash
signatures, all computed for a batch of documents at once with numpy.

Units are those of `liandan.data.documents.text`: the words of `normalize_for_matching(text)`. Every CJK character is a
word, so word 5-grams are character 5-grams in Chinese or Japanese text and one code path serves every script.
A text with fewer than n words has one n-gram made of all its words (so short texts still match each other);
a text with no words has none.

How the hashes are computed (integer numpy arithmetic only, so the bytes are the same in every process and on
every machine):

* Words: the batch is lower-cased and NFKC-normalized by Python, joined with newlines and viewed as an array of
  code points. Punctuation and symbols are deleted and word boundaries found with per-code-point tables built
  from the same definitions as `text.words` and `text.normalize_for_matching` (the tests check that they agree).
  A word's hash is the polynomial sum(c[i] * B**i) of its code points, taken from prefix sums in wrap-around
  uint64 arithmetic (B odd), then scrambled with the murmur3 finalizer.
* N-grams: the same polynomial over the n word hashes (another base B'), from prefix sums too, so the cost
  does not grow with n; scrambled.
* MinHash: permutation k maps a 64-bit n-gram hash x to the high 32 bits of (a_k * x + b_k) mod 2**64 with a_k
  odd (Dietzfelbinger's multiply-add-shift family); the signature is the minimum over the document's n-grams.
  The n-gram hashes are already uniformly scrambled, so each permutation gives an unbiased Jaccard estimate.
  The (a_k, b_k) come from splitmix64 seeded with `seed`, not from numpy's generators, whose streams may
  change between numpy versions.
* Exact duplicates: xxh3-128 of the UTF-32-LE bytes of normalize_for_matching(text), as two uint64 columns.

LSH banding: `optimal_bands` picks b bands of r rows (b * r <= num_perm) minimizing
w_fp * (mean false-positive probability below the threshold) + w_fn * (mean false-negative probability above it),
where a pair of Jaccard similarity s shares at least one band with probability 1 - (1 - s**r)**b. Averaging
rather than integrating gives both sides equal say whatever the threshold. The integrand is a polynomial of
degree b * r, so Gauss-Legendre quadrature with num_perm / 2 + 1 nodes is exact.

Defaults (NearDedupParams): threshold 0.8, 5-word shingles, 112 permutations, candidates confirmed by exact
Jaccard (verify). Verification removes every false positive, so the bands are chosen for recall (w_fp 0.02,
w_fn 0.98): 18 bands of 6 rows, a pair at s = 0.5 / 0.7 / 0.75 / 0.8 / 0.85 is a candidate with probability
0.25 / 0.89 / 0.97 / 0.996 / 0.9998; the extra candidates below the threshold cost only their check. Without
verification the weights are 0.5 / 0.5 (11 bands of 10 rows: 0.01 / 0.27 / 0.47 / 0.71 / 0.91), which trades
recall for precision since every candidate is removed.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

from liandan.config import ConfigError
from liandan.data.documents.text import CJK_CLASS

U64 = np.uint64
EMPTY = np.uint32(0xFFFFFFFF)  # signature value of a document without words; never a band match
_MASK64 = (1 << 64) - 1
_BATCH_CHARS = 1 << 20  # code points per batch: bounds the temporary arrays (about 40 bytes per code point)
_BATCH_DOCS = 2048
_PERM_CHUNK = 8192  # n-grams per block of the (num_perm, n-grams) permutation matrix


def splitmix64(seed: int, count: int) -> list[int]:
    """`count` well-mixed 64-bit integers from `seed` (Steele et al.'s SplitMix64), identical everywhere."""
    out, state = [], seed & _MASK64
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append(z ^ (z >> 31))
    return out


def fmix64(x: np.ndarray) -> np.ndarray:
    """murmur3's 64-bit finalizer, in place: every input bit affects every output bit."""
    x ^= x >> U64(33)
    x *= U64(0xFF51AFD7ED558CCD)
    x ^= x >> U64(33)
    x *= U64(0xC4CEB9FE1A85EC53)
    x ^= x >> U64(33)
    return x


_PUNCTUATION_AND_SYMBOLS = frozenset({"Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So"})


@functools.cache
def _code_point_tables() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per code point: deleted by normalize_for_matching (punctuation and symbols), whitespace as `\\s` sees it,
    and word kind as text.words sees it (0 no word, 1 part of a letter/digit run, 2 a CJK character, a word by
    itself). Built once per process (about 0.2 s) by running the same patterns over every code point."""
    every = np.arange(0x110000, dtype=np.uint32).tobytes().decode("utf-32-le", "surrogatepass")
    deleted = np.fromiter(
        map(_PUNCTUATION_AND_SYMBOLS.__contains__, map(unicodedata.category, every)), bool, len(every)
    )
    space = np.zeros(len(every), bool)
    for match in re.finditer(r"\s+", every):
        space[match.start() : match.end()] = True
    kind = np.zeros(len(every), np.uint8)
    for match in re.finditer(rf"[^\W{CJK_CLASS}]+", every):
        kind[match.start() : match.end()] = 1
    for match in re.finditer(f"[{CJK_CLASS}]+", every):
        kind[match.start() : match.end()] = 2
    return deleted, space, kind


class _Powers:
    """base**i and base**-i mod 2**64 for i < n (base odd, so invertible), grown on demand and kept."""

    def __init__(self, base: int) -> None:
        self.base, self.base_inverse = base, pow(base, -1, 1 << 64)
        self.powers = (np.ones(1, U64), np.ones(1, U64))  # replaced as a pair, so threads never see a mix

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        forward, inverse = self.powers
        if len(forward) < n:
            size = max(n, 2 * len(forward))
            forward, inverse = (
                np.concatenate([[U64(1)], np.multiply.accumulate(np.full(size - 1, base, U64))])
                for base in (self.base, self.base_inverse)
            )
            self.powers = (forward, inverse)
        return forward[:n], inverse[:n]

    def span_hashes(self, values: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
        """sum(values[starts[i] + j] * base**j for j < ends[i] - starts[i]), scrambled, for every i."""
        forward, inverse = self.get(len(values) + 1)
        prefix = np.zeros(len(values) + 1, U64)
        np.cumsum(values.astype(U64) * forward[: len(values)], out=prefix[1:])
        return fmix64((prefix[ends] - prefix[starts]) * inverse[starts])


_CHAR_POWERS = _Powers(0x9E3779B97F4A7C15)
_WORD_POWERS = _Powers(0xD6E8FEB86659FD93)


def _normalized_code_points(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Code points of the texts with punctuation and symbols deleted (before whitespace collapsing), one newline
    between texts, and where each text starts (plus the total length)."""
    if not texts:
        return np.zeros(0, np.uint32), np.zeros(1, np.int64)
    # NFKC is by definition NFKD followed by canonical composition; CPython runs these two steps about
    # five times faster than its NFKC on text full of full-width punctuation, such as Chinese
    lowered = [unicodedata.normalize("NFC", unicodedata.normalize("NFKD", t)).lower() for t in texts]
    joined = "\n".join(lowered)
    raw = np.frombuffer(joined.encode("utf-32-le", "surrogatepass"), np.uint32)
    deleted, _, _ = _code_point_tables()
    keep = ~deleted[raw]
    kept_before = np.concatenate([[0], np.cumsum(keep)])
    raw_starts = np.cumsum([0] + [len(s) + 1 for s in lowered])
    raw_starts[-1] -= 1  # no separator after the last text
    return raw[keep], kept_before[raw_starts]


def _word_spans(code_points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    _, _, kind = _code_point_tables()
    k = kind[code_points]
    run = k == 1
    before = np.concatenate([[False], run[:-1]])
    after = np.concatenate([run[1:], [False]])
    cjk = k == 2
    starts = np.flatnonzero(cjk | (run & ~before))
    ends = np.flatnonzero(cjk | (run & ~after)) + 1
    return starts, ends


def word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of words(normalize_for_matching(t)) for each text, concatenated (uint64), and offsets: the words
    of text i are hashes[offsets[i]:offsets[i + 1]]."""
    code_points, text_starts = _normalized_code_points(texts)
    starts, ends = _word_spans(code_points)
    return _CHAR_POWERS.span_hashes(code_points, starts, ends), np.searchsorted(starts, text_starts)


def ngram_hashes_from_words(words: np.ndarray, offsets: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Hashes of the word n-grams of each text (a text with 1 to n-1 words has one n-gram of all its words),
    concatenated, with per-text offsets as in `word_hashes`."""
    counts = np.diff(offsets)
    per_text = np.where(counts >= n, counts - n + 1, np.minimum(counts, 1))
    ngram_offsets = np.concatenate([[0], np.cumsum(per_text)])
    text_of_ngram = np.repeat(np.arange(len(counts)), per_text)
    starts = offsets[text_of_ngram] + np.arange(ngram_offsets[-1]) - ngram_offsets[text_of_ngram]
    ends = np.minimum(starts + n, offsets[text_of_ngram + 1])
    return _WORD_POWERS.span_hashes(words, starts, ends), ngram_offsets


def ngram_hashes(texts: Sequence[str], n: int) -> tuple[np.ndarray, np.ndarray]:
    return ngram_hashes_from_words(*word_hashes(texts), n)


def exact_hashes(texts: Sequence[str]) -> np.ndarray:
    """xxh3-128 of normalize_for_matching(text) (its UTF-32-LE bytes) per text: an (n, 2) uint64 array."""
    out = np.empty((len(texts), 2), U64)
    _, space, _ = _code_point_tables()
    for lo, hi in _batches(texts):
        code_points, starts = _normalized_code_points(texts[lo:hi])
        # collapse whitespace runs to one U+0020, as normalize_for_matching does
        is_space = space[code_points]
        repeated = is_space & np.concatenate([[False], is_space[:-1]])
        kept_before = np.concatenate([[0], np.cumsum(~repeated)])
        collapsed = np.where(is_space, np.uint32(0x20), code_points)[~repeated]
        is_space = np.append(is_space[~repeated], False)  # one past the end, for empty texts at the end
        begin, end = kept_before[starts[:-1]], kept_before[starts[1:]]
        end[:-1] -= 1  # the newline between texts (now a space) belongs to neither
        # strip: a text's edges may still hold one space each
        begin += (begin < end) & is_space[begin]
        end -= (begin < end) & is_space[np.maximum(end - 1, 0)]
        blob = memoryview(collapsed.tobytes())
        digests = [xxhash.xxh3_128_intdigest(blob[4 * a : 4 * b]) for a, b in zip(begin.tolist(), end.tolist())]
        out[lo:hi, 0] = [d >> 64 for d in digests]
        out[lo:hi, 1] = [d & _MASK64 for d in digests]
    return out


def _batches(texts: Sequence[str]) -> list[tuple[int, int]]:
    """[lo, hi) index ranges of at most _BATCH_DOCS texts and, unless a text alone is longer, _BATCH_CHARS."""
    out, lo, chars = [], 0, 0
    for i, text in enumerate(texts):
        if i > lo and (chars + len(text) > _BATCH_CHARS or i - lo >= _BATCH_DOCS):
            out.append((lo, i))
            lo, chars = i, 0
        chars += len(text)
    if lo < len(texts):
        out.append((lo, len(texts)))
    return out


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two sets given as sorted unique arrays (two empty sets are identical)."""
    if len(a) == 0 and len(b) == 0:
        return 1.0
    common = len(np.intersect1d(a, b, assume_unique=True))
    return common / (len(a) + len(b) - common)


def candidate_probability(similarity: np.ndarray | float, bands: int, rows: int) -> np.ndarray:
    """Probability that a pair of this Jaccard similarity shares at least one of `bands` bands of `rows` rows."""
    return 1.0 - (1.0 - np.asarray(similarity, float) ** rows) ** bands


@functools.lru_cache(maxsize=64)
def optimal_bands(
    threshold: float, num_perm: int, false_positive_weight: float = 0.5, false_negative_weight: float = 0.5
) -> tuple[int, int]:
    """(bands, rows) with bands * rows <= num_perm minimizing the weighted mean false-positive probability over
    similarities below `threshold` plus the mean false-negative probability above it (see the module doc)."""
    nodes, weights = np.polynomial.legendre.leggauss(num_perm // 2 + 1)

    def mean_over(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
        # mean of f over [lo, hi] = sum(weights * f(nodes mapped to [lo, hi])) / 2
        return lo + (hi - lo) * (nodes + 1) / 2, weights / 2

    below, below_w = mean_over(0.0, threshold)
    above, above_w = mean_over(threshold, 1.0)
    if threshold == 1.0:  # nothing lies above: only false positives count
        above_w = np.zeros_like(above_w)
    best, best_error = (1, 1), np.inf
    for bands in range(1, num_perm + 1):
        for rows in range(1, num_perm // bands + 1):
            false_positive = below_w @ candidate_probability(below, bands, rows)
            false_negative = above_w @ (1.0 - candidate_probability(above, bands, rows))
            error = false_positive_weight * false_positive + false_negative_weight * false_negative
            if error < best_error - 1e-12:
                best, best_error = (bands, rows), error
    return best


@dataclass
class NearDedupParams:
    """Near-duplicate detection settings. bands/rows: set both to override the choice from threshold and
    num_perm; verify: confirm LSH candidates with the exact Jaccard similarity of their n-gram sets;
    seed: of the permutations (signatures made with different seeds cannot be compared); the weights of
    false positives and false negatives when choosing bands default to 0.02 / 0.98 with verification (it
    removes false positives, so recall is what the bands decide) and 0.5 / 0.5 without."""

    threshold: float = 0.8
    num_perm: int = 112
    ngram: int = 5
    seed: int = 0
    bands: int = 0  # 0: chosen from threshold and num_perm
    rows: int = 0
    verify: bool = True
    false_positive_weight: float | None = None
    false_negative_weight: float | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ConfigError(f"near-dedup threshold must be in (0, 1], got {self.threshold}")
        if not 1 <= self.num_perm <= 1024:
            raise ConfigError(f"near-dedup num_perm must be between 1 and 1024, got {self.num_perm}")
        if self.ngram < 1:
            raise ConfigError(f"near-dedup ngram must be at least 1, got {self.ngram}")
        w_fp, w_fn = self.weights
        if min(w_fp, w_fn) < 0 or w_fp + w_fn == 0:
            raise ConfigError("near-dedup false_positive_weight and false_negative_weight must be >= 0, not both 0")
        if (self.bands == 0) != (self.rows == 0):
            raise ConfigError("near-dedup: set both bands and rows, or neither (to choose them from the threshold)")
        if self.bands < 0 or self.rows < 0 or self.bands * self.rows > self.num_perm:
            raise ConfigError(
                f"near-dedup needs bands * rows <= num_perm, got {self.bands} * {self.rows} with num_perm {self.num_perm}"
            )

    @property
    def weights(self) -> tuple[float, float]:
        """(false-positive weight, false-negative weight) for choosing the bands."""
        w_fp, w_fn = (0.02, 0.98) if self.verify else (0.5, 0.5)
        return (
            w_fp if self.false_positive_weight is None else self.false_positive_weight,
            w_fn if self.false_negative_weight is None else self.false_negative_weight,
        )

    @property
    def bands_rows(self) -> tuple[int, int]:
        if self.bands:
            return self.bands, self.rows
        return optimal_bands(self.threshold, self.num_perm, *self.weights)


class MinHasher:
    """MinHash signatures of documents' word n-gram sets, deterministic across processes and machines."""

    def __init__(self, params: NearDedupParams) -> None:
        self.params = params
        mixed = splitmix64(params.seed, 2 * params.num_perm)
        self.multipliers = np.array(mixed[0::2], U64) | U64(1)
        self.increments = np.array(mixed[1::2], U64)

    def shingles(self, text: str) -> np.ndarray:
        """The sorted distinct n-gram hashes of one text (its shingle set)."""
        hashes, _ = ngram_hashes([text], self.params.ngram)
        return np.unique(hashes)

    def signatures(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), num_perm) uint32; a text without words gets all EMPTY."""
        out = np.full((len(texts), self.params.num_perm), EMPTY, np.uint32)
        for lo, hi in _batches(texts):
            hashes, offsets = ngram_hashes(texts[lo:hi], self.params.ngram)
            self._min_over_ngrams(hashes, offsets, out[lo:hi])
        return out

    def _min_over_ngrams(self, hashes: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> None:
        filled = np.flatnonzero(np.diff(offsets) > 0)
        starts, ends = offsets[filled], offsets[filled + 1]
        block = np.empty((self.params.num_perm, _PERM_CHUNK), U64)
        # (num_perm, n-grams) layout: the reduction runs along contiguous rows, several times faster than the other
        for lo in range(0, len(hashes), _PERM_CHUNK):
            hi = min(lo + _PERM_CHUNK, len(hashes))
            values = block[:, : hi - lo]
            np.multiply(self.multipliers[:, None], hashes[None, lo:hi], out=values)
            values += self.increments[:, None]
            first, last = np.searchsorted(ends, lo, "right"), np.searchsorted(starts, hi, "left")
            local_starts = np.maximum(starts[first:last] - lo, 0)
            # the minimum of a_k*x+b_k picks the same n-gram as the minimum of its high 32 bits
            mins = (np.minimum.reduceat(values, local_starts, axis=1) >> U64(32)).astype(np.uint32).T
            rows = filled[first:last]
            out[rows] = np.minimum(out[rows], mins)
