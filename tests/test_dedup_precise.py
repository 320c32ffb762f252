"""Near dedup with its default settings against exact Jaccard ground truth, the streaming text source, and the
global phase split by band over jobs, local processes and Ray (same removals every way)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import zstandard

from helpers import dedup_phase_one
from liandan.data.dedup.dedup import MinHasher, NearDedupParams, ShardTexts, exact_hashes, find_duplicates
from liandan.data.dedup.dedup_eval import all_shingle_sets, overlapping_pairs, score_removals, similar_pairs
from liandan.data.dedup.minhash import jaccard
from liandan.data.pipeline.executor import LocalExecutor, RayExecutor

_LATIN = [f"w{i}" for i in range(3000)]
_HAN = [chr(0x4E00 + i) for i in range(2500)]


def _document(rng: random.Random, chinese: bool) -> str:
    # Zipf-like word choice: common words recur across documents, as in real text, so unrelated documents
    # share some shingles and the LSH sees pairs at every similarity
    vocabulary = _HAN if chinese else _LATIN
    length = rng.randrange(60, 400)
    units = [vocabulary[min(int(20 * (rng.paretovariate(1.0) - 1)), len(vocabulary) - 1)] for _ in range(length)]
    return ("" if chinese else " ").join(units)


def _edit(text: str, rate: float, rng: random.Random, chinese: bool) -> str:
    units = list(text) if chinese else text.split(" ")
    vocabulary = _HAN if chinese else _LATIN
    for _ in range(round(rate * len(units))):
        at = rng.randrange(len(units))
        action = rng.random()
        if action < 0.5:
            units[at] = rng.choice(vocabulary)
        elif action < 0.75 and len(units) > 1:
            del units[at]
        else:
            units.insert(at, rng.choice(vocabulary))
    return ("" if chinese else " ").join(units)


def generated_corpus(seed: int, originals: int = 500, copies: int = 300) -> list[str]:
    """English-like and Chinese-like documents with planted near duplicates at edit rates on both sides of
    the 0.8 threshold, copies of copies among them, in shuffled order."""
    rng = random.Random(seed)
    texts = [_document(rng, chinese=i % 3 == 0) for i in range(originals)]
    chinese = [i % 3 == 0 for i in range(originals)]
    for _ in range(copies):
        source = rng.randrange(len(texts))
        rate = rng.choice([0.0, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.05])
        texts.append(_edit(texts[source], rate, rng, chinese[source]))
        chinese.append(chinese[source])
    rng.shuffle(texts)
    return texts


def _write_shard(path: Path, texts: list[str]) -> Path:
    lines = "".join(json.dumps({"id": str(i), "text": t}, ensure_ascii=False) + "\n" for i, t in enumerate(texts))
    path.write_bytes(zstandard.ZstdCompressor().compress(lines.encode()))
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """The generated corpus in three tasks: signature files, clean-style shards and the ground truth."""
    root = tmp_path_factory.mktemp("generated")
    texts = generated_corpus(seed=7)
    tasks = [texts[:300], texts[300:550], texts[550:]]
    exact, sigs = dedup_phase_one(root, tasks, NearDedupParams())
    shards = [_write_shard(root / f"{i}.jsonl.zst", t) for i, t in enumerate(tasks)]
    sets = all_shingle_sets(texts)
    return {
        "texts": texts,
        "exact": exact,
        "sigs": sigs,
        "source": ShardTexts(shards, [len(t) for t in tasks]),
        "sets": sets,
        "pairs": similar_pairs(sets, 0.8),
        "root": root,
    }


@pytest.fixture(scope="module")
def one_process(corpus) -> np.ndarray:
    result = find_duplicates(
        corpus["exact"], corpus["sigs"], NearDedupParams(), corpus["root"] / "w1", corpus["source"]
    )
    return result


def test_ground_truth_by_prefix_filtering_is_every_pair_above_the_threshold(corpus):
    brute_force = overlapping_pairs(corpus["sets"], 0.8)
    assert len(corpus["pairs"]) > 150
    assert np.array_equal(corpus["pairs"], brute_force)
    # and pairs straddle the threshold, so the LSH has something to get wrong
    below = overlapping_pairs(corpus["sets"], 0.6)
    assert len(below) > len(brute_force) + 30


def test_default_near_dedup_is_precise_and_complete_on_generated_duplicates(corpus, one_process):
    scores = score_removals(one_process.remove, one_process.cluster_of, corpus["sets"], corpus["pairs"], 0.8)
    assert scores["due"] > 150
    assert scores["precision"] >= 0.95 and scores["recall"] >= 0.95, scores
    assert scores["precision_any"] == 1.0  # every removal rests on a confirmed pair
    assert scores["recall_components"] >= 0.9  # the rest are chains: kept, as no kept document is close to them
    stats = one_process.stats
    assert stats["verified"] and (stats["bands"], stats["rows"]) == (18, 6)
    assert stats["rejected_by_verification"] > 0  # the recall-leaning bands do let pairs below 0.8 through


def test_unverified_recall_bands_would_remove_documents_without_a_near_duplicate(corpus):
    params = NearDedupParams(verify=False, bands=18, rows=6)
    result = find_duplicates(corpus["exact"], corpus["sigs"], params, corpus["root"] / "w-unverified")
    scores = score_removals(result.remove, result.cluster_of, corpus["sets"], corpus["pairs"], 0.8)
    assert scores["precision_any"] < 0.97  # what verification is there to prevent


def test_removals_rest_only_on_confirmed_pairs_even_when_every_band_collides(tmp_path):
    """Hand-made signatures put every text in one bucket of every band: unrelated texts, an exact duplicate, a
    near duplicate, and a chain a ~ b ~ c whose ends are not near duplicates of each other."""
    rng = random.Random(3)
    base = [_document(rng, chinese=False) for _ in range(4)]
    a = " ".join(f"z{i}" for i in range(200))
    b = " ".join(f"z{i}" if i % 50 != 7 else "q" for i in range(200))
    c = " ".join(f"z{i}" if i % 50 not in (7, 31) else "q" for i in range(200))
    texts = [base[0], base[1], _edit(base[0], 0.01, rng, False), base[2], base[1].upper(), base[3], a, b, c]
    hasher = MinHasher(NearDedupParams())
    similarity = {
        (i, j): jaccard(hasher.shingles(texts[i]), hasher.shingles(texts[j])) for i, j in ((6, 7), (7, 8), (6, 8))
    }
    assert similarity[6, 7] >= 0.8 and similarity[7, 8] >= 0.8 and similarity[6, 8] < 0.8
    params = NearDedupParams(num_perm=16, bands=4, rows=4)
    np.save(tmp_path / "s.npy", np.zeros((len(texts), 16), np.uint32))
    np.save(tmp_path / "e.npy", exact_hashes(texts))
    result = find_duplicates([tmp_path / "e.npy"], [tmp_path / "s.npy"], params, tmp_path / "w", texts)
    assert np.flatnonzero(result.remove).tolist() == [2, 4, 7]  # c stays: the kept a is not close to it
    assert result.cluster_of[6] == result.cluster_of[7] == result.cluster_of[8] >= 0
    assert result.stats["exact_duplicates"] == 1 and result.stats["rejected_by_verification"] > 0
    assert result.stats["kept_without_kept_near_duplicate"] == 1
    unverified = find_duplicates([tmp_path / "e.npy"], [tmp_path / "s.npy"], NearDedupParams(
        num_perm=16, bands=4, rows=4, verify=False), tmp_path / "w2")  # fmt: skip
    assert unverified.remove.sum() == len(texts) - 1


def test_shard_texts_stream_only_the_wanted_documents(corpus):
    source = corpus["source"]
    wanted = np.array([0, 5, 299, 300, 301, 549, 550, len(corpus["texts"]) - 1])
    got = {}
    for ids, texts in source.read(wanted):
        got.update(zip(ids.tolist(), texts))
    assert got == {i: corpus["texts"][i] for i in wanted.tolist()}
    shard_of = [ids.tolist() for ids, _ in source.read(wanted)]
    assert shard_of == [[0, 5, 299], [300, 301, 549], [550, len(corpus["texts"]) - 1]]  # one read per shard


def test_small_verification_batches_and_in_memory_texts_give_the_same_removals(corpus, one_process):
    for name, texts, batch in (("w-batches", corpus["source"], 16), ("w-memory", corpus["texts"], 20_000)):
        again = find_duplicates(
            corpus["exact"], corpus["sigs"], NearDedupParams(), corpus["root"] / name, texts, batch_documents=batch
        )
        assert np.array_equal(again.remove, one_process.remove)
        assert np.array_equal(again.cluster_of, one_process.cluster_of)


def test_band_jobs_in_one_process_give_the_same_removals(corpus, one_process):
    split = find_duplicates(
        corpus["exact"], corpus["sigs"], NearDedupParams(), corpus["root"] / "w5", corpus["source"], workers=5
    )
    assert split.stats["band_jobs"] == 5
    assert np.array_equal(split.remove, one_process.remove)
    assert np.array_equal(split.cluster_of, one_process.cluster_of)


@pytest.mark.slow
def test_band_jobs_on_local_processes_and_ray_give_the_same_removals(corpus, one_process):
    outcomes = {}
    for name, executor in (("local", LocalExecutor(2)), ("ray", RayExecutor(2))):
        try:
            result = find_duplicates(
                corpus["exact"], corpus["sigs"], NearDedupParams(), corpus["root"] / name, corpus["source"],
                workers=3, executor=executor,
            )  # fmt: skip
        finally:
            executor.close()
        outcomes[name] = result
    for name, result in outcomes.items():
        assert result.stats["band_jobs"] == 3, name
        assert np.array_equal(result.remove, one_process.remove), name
        assert np.array_equal(result.cluster_of, one_process.cluster_of), name


def test_dedup_workers_and_verification_are_pipeline_settings(tmp_path):
    from liandan.config import ConfigError
    from liandan.data.pipeline.pipeline import dedup_params
    from liandan.data.pipeline.pipeline_config import load_pipeline

    toml = tmp_path / "pipeline.toml"
    toml.write_text('[[inputs]]\nname = "web"\npaths = ["web.jsonl"]\n\n[dedup]\nworkers = 4\n')
    cfg = load_pipeline(toml)
    assert cfg.dedup.workers == 4 and cfg.dedup.verify and dedup_params(cfg).verify
    assert load_pipeline(toml, ["--dedup.workers=2"]).dedup.workers == 2
    with pytest.raises(ConfigError, match="workers"):
        load_pipeline(toml, ["--dedup.workers=0"])
