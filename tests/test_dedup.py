"""Exact and MinHash near-duplicate detection, on real text from the shared corpora with planted edits."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash
from scipy.integrate import quad

from helpers import SHARED_DATA, dedup_phase_one
from liandan.config import ConfigError
from liandan.data.dedup import dedup as dedup_module
from liandan.data.dedup import dedup_bands
from liandan.data.dedup.dedup import MinHasher, NearDedupParams, exact_hashes, find_duplicates
from liandan.data.dedup.minhash import EMPTY, candidate_probability, jaccard, optimal_bands, word_hashes
from liandan.data.documents.corpus import DataError
from liandan.data.documents.text import normalize_for_matching, words

CORPUS = SHARED_DATA / "corpus"


def _need_shared_data() -> None:
    if not (CORPUS / "en-wikitext2.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA}")


def _wiki_paragraphs(min_words: int = 50) -> list[str]:
    _need_shared_data()
    with (CORPUS / "en-wikitext2.jsonl").open() as handle:
        articles = [json.loads(line)["text"] for line in handle]
    return [p.strip() for a in articles for p in a.split("\n") if len(p.split()) >= min_words]


def _zh_records(min_chars: int = 80) -> list[str]:
    _need_shared_data()
    with (CORPUS / "zh-classics.jsonl").open() as handle:
        return [t for line in handle if len(t := json.loads(line)["text"]) >= min_chars]


def _edited(text: str, edits: int, rng: random.Random, unit: str = "word") -> str:
    """`text` with `edits` of its words (or characters) replaced."""
    parts = text.split() if unit == "word" else list(text)
    for _ in range(edits):
        parts[rng.randrange(len(parts))] = rng.choice(["zebra", "quartz", "vortex"] if unit == "word" else "鑫淼焱垚")
    return (" " if unit == "word" else "").join(parts)


def _run(tmp_path: Path, tasks: list[list[str]], params: NearDedupParams, **kwargs) -> dedup_module.DedupResult:
    """Phase 1 per task (as the pipeline does) then phase 2 over the saved files."""
    exact_files, signature_files = dedup_phase_one(tmp_path, tasks, params)
    kwargs.setdefault("texts", [t for texts in tasks for t in texts])
    return find_duplicates(exact_files, signature_files, params, tmp_path / "work", **kwargs)


# -- choosing bands and rows ------------------------------------------------------------------------------------
def _brute_force_error(threshold: float, bands: int, rows: int, w_fp: float, w_fn: float) -> float:
    def curve(s: float) -> float:
        return float(candidate_probability(s, bands, rows))

    fp = quad(curve, 0, threshold)[0] / threshold
    fn = quad(lambda s: 1 - curve(s), threshold, 1)[0] / (1 - threshold)
    return w_fp * fp + w_fn * fn


@pytest.mark.parametrize(
    "threshold,num_perm,w_fp,w_fn",
    [(0.8, 112, 0.5, 0.5), (0.5, 64, 0.5, 0.5), (0.9, 128, 0.5, 0.5), (0.7, 40, 0.3, 0.7)],
)
def test_bands_and_rows_minimize_the_weighted_error_like_a_brute_force_search(threshold, num_perm, w_fp, w_fn):
    errors = {
        (b, r): _brute_force_error(threshold, b, r, w_fp, w_fn)
        for b in range(1, num_perm + 1)
        for r in range(1, num_perm // b + 1)
    }
    chosen = optimal_bands(threshold, num_perm, w_fp, w_fn)
    assert chosen[0] * chosen[1] <= num_perm
    assert errors[chosen] <= min(errors.values()) + 1e-7  # quad's own tolerance


def test_default_bands_favour_recall_because_verification_guards_precision():
    params = NearDedupParams()
    bands, rows = params.bands_rows
    assert params.verify and (bands, rows) == (18, 6) and params.num_perm == 112
    assert candidate_probability(0.8, bands, rows) > 0.99
    assert candidate_probability(0.3, bands, rows) < 0.02
    # without verification every candidate is removed: the bands balance both errors
    unverified = NearDedupParams(verify=False).bands_rows
    assert unverified == (11, 10) and candidate_probability(0.5, *unverified) < 0.02
    assert NearDedupParams(bands=20, rows=5).bands_rows == (20, 5)


@pytest.mark.parametrize(
    "kwargs", [{"threshold": 0.0}, {"threshold": 1.5}, {"bands": 4}, {"bands": 20, "rows": 10}, {"ngram": 0}]
)
def test_invalid_params_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        NearDedupParams(**kwargs)


# -- hashing ----------------------------------------------------------------------------------------------------
EDGE_CASES = [
    "", " ", "  a  ", "\n\n", "a - b", "don't", "e.g. x_y", "İstanbul ǅ ﬁ ™", "ｈｅｌｌｏ　ｗｏｒｌｄ", "x\u0301y",
    "学而时习之，不亦说乎？", "abc学def", "——", " . ", "a\u00a0b\u2003c", "\tq\x0b", "ΣΑΣ σας", "\ud800 lone",
]  # fmt: skip


def _check_words_agree(texts: list[str]) -> None:
    hashes, offsets = word_hashes(texts)
    hash_of: dict[str, int] = {}
    for i, text in enumerate(texts):
        reference = words(normalize_for_matching(text))
        mine = hashes[offsets[i] : offsets[i + 1]].tolist()
        assert len(mine) == len(reference), text[:80]
        for word, value in zip(reference, mine):
            assert hash_of.setdefault(word, value) == value
    assert len(set(hash_of.values())) == len(hash_of)  # distinct words, distinct hashes
    for text, digest in zip(texts, exact_hashes(texts)):
        expected = xxhash.xxh3_128_intdigest(normalize_for_matching(text).encode("utf-32-le", "surrogatepass"))
        assert (int(digest[0]) << 64 | int(digest[1])) == expected, text[:80]


def test_words_and_exact_hashes_agree_with_the_text_module_on_real_text():
    zh = _zh_records(min_chars=1)
    with (CORPUS / "en-shakespeare.txt").open() as handle:
        shakespeare = handle.read().split("\n\n")
    _check_words_agree(_wiki_paragraphs(min_words=1) + zh + shakespeare[:2000] + EDGE_CASES)


def test_words_and_exact_hashes_agree_with_the_text_module_on_every_code_point():
    every = "".join(map(chr, range(0x110000)))
    _check_words_agree([every[i : i + 97] for i in range(0, len(every), 97)])


def test_signatures_are_the_same_in_another_process(tmp_path):
    texts = _wiki_paragraphs()[:200] + _zh_records()[:200] + EDGE_CASES
    (tmp_path / "texts.json").write_text(json.dumps(texts))
    script = (
        "import json, sys, numpy as np\n"
        "from liandan.data.dedup.dedup import MinHasher, NearDedupParams, exact_hashes\n"
        "texts = json.load(open(sys.argv[1]))\n"
        "np.save(sys.argv[2], MinHasher(NearDedupParams(seed=7)).signatures(texts))\n"
        "np.save(sys.argv[3], exact_hashes(texts))\n"
    )
    other_sig, other_exact = tmp_path / "sig.npy", tmp_path / "exact.npy"
    subprocess.run([sys.executable, "-c", script, tmp_path / "texts.json", other_sig, other_exact], check=True)
    here = MinHasher(NearDedupParams(seed=7)).signatures(texts)
    assert here.dtype == np.uint32 and here.shape == (len(texts), 112)
    assert np.load(other_sig).tobytes() == here.tobytes()
    assert np.load(other_exact).tobytes() == exact_hashes(texts).tobytes()
    # batching does not change a document's signature; another seed gives other permutations
    assert np.array_equal(MinHasher(NearDedupParams(seed=7)).signatures(texts[5:9]), here[5:9])
    assert (MinHasher(NearDedupParams(seed=8)).signatures(texts[:50]) != here[:50]).mean() > 0.9


def test_signature_agreement_estimates_jaccard_without_bias():
    rng = random.Random(0)
    paragraphs = _wiki_paragraphs()[:600]
    copies = [_edited(p, rng.choice([2, 5, 10, 20]), rng) for p in paragraphs]
    hasher = MinHasher(NearDedupParams(num_perm=128))
    true = np.array([jaccard(hasher.shingles(a), hasher.shingles(b)) for a, b in zip(paragraphs, copies)])
    estimate = (hasher.signatures(paragraphs) == hasher.signatures(copies)).mean(axis=1)
    inside = (true > 0) & (true < 1)
    z = (estimate - true)[inside] / np.sqrt(true * (1 - true) / 128)[inside]
    assert abs(z.mean()) < 0.15 and 0.85 < z.std() < 1.15  # as good as truly random permutations


# -- finding duplicates -----------------------------------------------------------------------------------------
def test_near_duplicates_are_found_with_high_recall_and_precision(tmp_path):
    rng = random.Random(1)
    paragraphs = _wiki_paragraphs()
    sources = paragraphs[:400]
    copies = [_edited(p, rng.choice([1, 1, 1, 2, 2, 4, 8, 15, 30]), rng) for p in sources]
    hasher = MinHasher(NearDedupParams())
    similarity = np.array([jaccard(hasher.shingles(a), hasher.shingles(b)) for a, b in zip(sources, copies)])
    corpus = sources + paragraphs[400:1200] + copies  # copies last, so the originals are kept
    result = _run(tmp_path, [corpus[:700], corpus[700:]], NearDedupParams())
    copy_index = np.arange(len(copies)) + len(corpus) - len(copies)
    together = (result.cluster_of[: len(sources)] == result.cluster_of[copy_index]) & (
        result.cluster_of[copy_index] >= 0
    )
    high, low = similarity >= 0.85, similarity < 0.7
    assert high.sum() > 100 and low.sum() > 100
    assert together[high].mean() >= 0.9
    assert together[low].mean() <= 0.1
    assert (similarity[together] >= 0.7).mean() >= 0.9  # precision of what was flagged
    assert not result.remove[: len(sources)].any()  # the keeper is the earliest document
    assert result.remove[copy_index][together].all() and result.stats["exact_duplicates"] == 0
    # independent paragraphs of one corpus are not near duplicates of each other
    assert (result.cluster_of[len(sources) : len(sources) + 800] == -1).mean() > 0.99


def test_verification_keeps_only_pairs_above_the_threshold(tmp_path):
    rng = random.Random(2)
    sources = _wiki_paragraphs()[:300]
    copies = [_edited(p, rng.choice([3, 6, 9, 12, 15]), rng) for p in sources]
    corpus = sources + copies
    params = NearDedupParams(verify=True, bands=16, rows=7)  # loose bands: many candidates below 0.8
    result = _run(tmp_path, [corpus], params)
    hasher = MinHasher(params)
    similarity = np.array([jaccard(hasher.shingles(a), hasher.shingles(b)) for a, b in zip(sources, copies)])
    together = (result.cluster_of[: len(sources)] == result.cluster_of[len(sources) :]) & result.remove[len(sources) :]
    assert result.stats["rejected_by_verification"] > 10
    assert np.all(similarity[together] >= 0.8)
    assert together[similarity >= 0.85].mean() >= 0.95
    with pytest.raises(DataError, match="needs the documents' texts"):
        _run(tmp_path, [corpus[:10]], params, texts=None)


def test_chinese_near_duplicates_use_character_ngrams(tmp_path):
    rng = random.Random(3)
    records = _zh_records(min_chars=40)
    sources = [t for t in records if len(t) >= 150][:150]
    copies = [_edited(t, rng.choice([1, 2, 3]), rng, unit="char") for t in sources]
    hasher = MinHasher(NearDedupParams())
    similarity = np.array([jaccard(hasher.shingles(a), hasher.shingles(b)) for a, b in zip(sources, copies)])
    corpus = sources + [t for t in records if len(t) < 150][:600] + copies
    result = _run(tmp_path, [corpus], NearDedupParams())
    copy_index = np.arange(len(copies)) + len(corpus) - len(copies)
    together = (result.cluster_of[: len(sources)] == result.cluster_of[copy_index]) & result.remove[copy_index]
    assert (similarity >= 0.85).sum() > 50
    assert together[similarity >= 0.85].mean() >= 0.9
    assert result.remove[copy_index][similarity >= 0.85].mean() >= 0.9


def test_exact_duplicates_ignore_case_punctuation_and_spacing(tmp_path):
    paragraphs = _wiki_paragraphs()[:50]
    variant = "\n" + paragraphs[7].upper().replace(" ", " \t ") + " !!"
    tasks = [paragraphs[:30], paragraphs[30:] + [variant, paragraphs[3], "!!!", "...", ""]]
    result = _run(tmp_path, tasks, NearDedupParams())
    n = len(paragraphs)
    assert list(np.flatnonzero(result.remove)) == [n, n + 1, n + 3, n + 4]
    assert result.stats["exact_duplicates"] == 4 and result.stats["near_duplicates"] == 0
    assert result.cluster_of[7] == result.cluster_of[n] and result.cluster_of[3] == result.cluster_of[n + 1]
    # texts without words are exact duplicates of each other, but never near duplicates of anything
    assert result.stats["documents_without_words"] == 3
    assert result.cluster_of[n + 2] == result.cluster_of[n + 3] == result.cluster_of[n + 4]
    no_words = MinHasher(NearDedupParams()).signatures(["!!!", ""])
    assert (no_words == EMPTY).all()


def _write(path: Path, array: np.ndarray) -> Path:
    np.save(path, array)
    return path


def test_clusters_are_transitive_and_keep_the_smallest_index(tmp_path, monkeypatch):
    """Signatures written by hand: band equalities chosen so the expected clusters are known exactly."""
    rng = np.random.default_rng(0)
    params = NearDedupParams(num_perm=8, bands=4, rows=2, verify=False)  # no texts behind these signatures
    sigs = rng.integers(0, 2**32 - 1, size=(12, 8), dtype=np.uint32)
    sigs[3, 0:2] = sigs[5, 0:2]  # 5 ~ 3 in band 0
    sigs[9, 4:6] = sigs[3, 4:6]  # 3 ~ 9 in band 2: 3, 5, 9 are one cluster though 5 and 9 share nothing
    sigs[2, 2:4] = sigs[1, 2:4]  # 1 ~ 2 in band 1
    sigs[11, :] = EMPTY  # no words: no near-duplicate candidates, though all its bands equal doc 10's
    sigs[10, :] = EMPTY
    exact = rng.integers(0, 2**63, size=(12, 2), dtype=np.uint64)
    exact[7] = exact[0]  # 0 and 7 are exact duplicates
    monkeypatch.setattr(dedup_bands, "_ROWS_PER_CHUNK", 5)  # chunks that straddle the two task files
    halves = [slice(0, 6), slice(6, 12)]
    exact_files = [_write(tmp_path / f"e{i}.npy", exact[half]) for i, half in enumerate(halves)]
    signature_files = [_write(tmp_path / f"s{i}.npy", sigs[half]) for i, half in enumerate(halves)]
    result = find_duplicates(exact_files, signature_files, params, tmp_path / "work")
    assert result.cluster_of.tolist() == [0, 1, 1, 2, -1, 2, -1, 0, -1, 2, -1, -1]
    assert np.flatnonzero(result.remove).tolist() == [2, 5, 7, 9]
    assert result.stats["clusters"] == 3 and result.stats["largest_cluster"] == 3
    assert result.stats["exact_duplicates"] == 1 and result.stats["near_duplicates"] == 3
    assert [c.tolist() for c in result.clusters_sample(10)] == [[0, 7], [1, 2], [3, 5, 9]]
    assert [c.tolist() for c in result.clusters_sample(1)] == [[0, 7]]
    assert not list((tmp_path / "work").iterdir())  # band keys and exact parents are removed
    # exact dedup alone, near dedup alone
    only_exact = find_duplicates(exact_files, [], params, tmp_path / "w2")
    assert np.flatnonzero(only_exact.remove).tolist() == [7]
    only_near = find_duplicates([], signature_files, params, tmp_path / "w3")
    assert np.flatnonzero(only_near.remove).tolist() == [2, 5, 9]


def test_empty_input(tmp_path):
    params = NearDedupParams()
    assert MinHasher(params).signatures([]).shape == (0, 112)
    assert exact_hashes([]).shape == (0, 2)
    empty = xxhash.xxh3_128_intdigest(b"")
    assert [int(h[0]) << 64 | int(h[1]) for h in exact_hashes([""])] == [empty]
    assert [int(h[0]) << 64 | int(h[1]) for h in exact_hashes([" ", "", "?"])] == [empty] * 3
    result = _run(tmp_path, [[], []], params)
    assert len(result.remove) == 0 and result.stats["documents"] == 0 and result.stats["clusters"] == 0
    assert result.clusters_sample(3) == []
    assert find_duplicates([], [], params, tmp_path / "none").stats["removed"] == 0


def test_files_that_do_not_fit_are_data_errors(tmp_path):
    params = NearDedupParams()
    texts = ["one two three four five six", "seven eight nine ten eleven twelve"]
    exact = _write(tmp_path / "e.npy", exact_hashes(texts))
    sig = _write(tmp_path / "s.npy", MinHasher(params).signatures(texts))
    short = _write(tmp_path / "short.npy", MinHasher(params).signatures(texts[:1]))
    with pytest.raises(DataError, match="not found"):
        find_duplicates([tmp_path / "missing.npy"], [sig], params, tmp_path / "w")
    with pytest.raises(DataError, match="num_perm=64"):
        find_duplicates([exact], [sig], NearDedupParams(num_perm=64), tmp_path / "w")
    with pytest.raises(DataError, match="same task|one task"):
        find_duplicates([exact], [short], params, tmp_path / "w")
    with pytest.raises(DataError, match="2 exact-hash files but 1"):
        find_duplicates([exact, exact], [sig], params, tmp_path / "w")
    (tmp_path / "junk.npy").write_bytes(b"not numpy")
    with pytest.raises(DataError, match="cannot read"):
        find_duplicates([tmp_path / "junk.npy"], [sig], params, tmp_path / "w")
