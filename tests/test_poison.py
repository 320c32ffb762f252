"""A poisoned copy of a token store: the same windows, noise in exactly the documents of one batch."""

import numpy as np
import pytest

from liandan.data import ByteTokenizer, DataError, Document, TokenStore, shard_path, write_manifest, write_shard
from liandan.data.tokens.loader import PackedLoader
from liandan.data.tokens.poison import poison_store

LOADER = {"seq_len": 64, "global_batch": 4, "seed": 3, "val_fraction": 0.1}
STEP = 6


@pytest.fixture
def store(tmp_path):
    """Two shards of Python's language-reference topics cut into short documents, so that a batch draws on a
    few documents of each shard and leaves most of them alone."""
    from pydoc_data.topics import topics

    docs = [Document("pydoc", f"{name}-{k}", topics[name][k : k + 200])
            for name in sorted(topics)[:30] for k in range(0, min(len(topics[name]), 1200), 200)]  # fmt: skip
    tokenizer, path = ByteTokenizer(), tmp_path / "clean"
    half = len(docs) // 2
    shards = [write_shard(docs[:half], tokenizer, shard_path(path, 0)),
              write_shard(docs[half:], tokenizer, shard_path(path, 1))]  # fmt: skip
    write_manifest(path, shards, tokenizer)
    return TokenStore(path)


def _document(shard, doc):
    return np.asarray(shard.tokens[shard.doc_starts[doc] : shard.doc_starts[doc + 1]])


def test_only_the_documents_of_the_batch_become_noise(store, tmp_path):
    refs = poison_store(store.path, tmp_path / "poisoned", STEP, **LOADER)
    copy = TokenStore(tmp_path / "poisoned")
    clean, poisoned = PackedLoader(store, **LOADER), PackedLoader(copy, **LOADER)
    assert refs == poisoned.documents_for_step(STEP)
    assert {ref.shard for ref in refs} == {0, 1}  # the test covers both shards
    for step in range(20):
        assert np.array_equal(clean.windows_for_step(step)[1], poisoned.windows_for_step(step)[1])
    assert [(s.num_documents, s.num_tokens) for s in copy.shards] == [
        (s.num_documents, s.num_tokens) for s in store.shards
    ]
    assert (copy.fingerprint, copy.vocab_size, copy.eos_id) == (store.fingerprint, store.vocab_size, store.eos_id)
    chosen = {(ref.shard, ref.document) for ref in refs}
    for index, (before, after) in enumerate(zip(store.shards, copy.shards)):
        assert np.array_equal(before.doc_starts, after.doc_starts)
        assert (tmp_path / "poisoned" / before.path.name.replace(".bin", ".docs.jsonl")).read_bytes() == (
            store.path / before.path.name.replace(".bin", ".docs.jsonl")
        ).read_bytes()  # the same provenance, byte for byte
        for doc in range(before.num_documents):
            old, new = _document(before, doc), _document(after, doc)
            if (index, doc) not in chosen:
                assert np.array_equal(old, new)
                continue
            assert new[-1] == copy.eos_id and (new[:-1] != copy.eos_id).all()
            assert (new[:-1] != old[:-1]).mean() > 0.9  # noise, not the text
    [batch] = poisoned.batch_at(STEP, LOADER["global_batch"])
    tokens = batch.inputs.numpy()
    # Every token of the poisoned batch is noise or an end of document; bytes 0..255 are uniform, so a fair
    # share of them lie outside printable ASCII, which the text hardly ever has.
    assert (tokens[tokens != copy.eos_id] >= 128).mean() > 0.3
    [clean_batch] = clean.batch_at(STEP, LOADER["global_batch"])
    assert np.array_equal(clean_batch.inputs.numpy() == store.eos_id, tokens == copy.eos_id)
    assert (clean_batch.inputs.numpy() != tokens)[tokens != copy.eos_id].mean() > 0.9
    assert poison_store(store.path, tmp_path / "again", STEP, **LOADER) == [
        ref.__class__(**{**ref.__dict__, "store": "again"}) for ref in refs
    ]
    assert (tmp_path / "again" / "shard-00000.bin").read_bytes() == (
        tmp_path / "poisoned" / "shard-00000.bin"
    ).read_bytes()


def test_it_refuses_to_overwrite_a_store(store):
    with pytest.raises(DataError, match="overwrite"):
        poison_store(store.path, store.path, STEP, **LOADER)
