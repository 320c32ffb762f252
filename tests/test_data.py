import json

import numpy as np
import pytest
from helpers import SHARED_DATA, write_corpus

from liandan.data import (
    ByteTokenizer,
    DataError,
    PackedLoader,
    ReadStats,
    TokenArray,
    python_docs_corpus,
    read_documents,
    train_bpe,
    write_token_array,
)


def test_jsonl_reader_counts_and_skips_bad_records(tmp_path):
    path = tmp_path / "mixed.jsonl"
    with path.open("wb") as f:
        f.write(b'{"id": "a", "text": "first good document"}\n')
        f.write(b"{not json\n")
        f.write(b'{"id": "b", "body": "wrong field"}\n')
        f.write(b'{"id": "c", "text": "bad \xff\xfe utf-8"}\n')
        f.write(b'{"id": "d", "text": "   "}\n')
        f.write(b"\n")
        f.write('{"id": "e", "text": "第二个好文档"}\n'.encode())
    stats = ReadStats()
    docs = list(read_documents([str(path)], "text", stats))
    assert [d.doc_id for d in docs] == ["a", "e"]
    assert docs[1].text == "第二个好文档"
    assert stats.skipped == {"malformed JSON": 1, "no string field 'text'": 1, "invalid UTF-8": 1, "empty document": 1}
    assert stats.documents == 2
    assert "1 malformed JSON" in stats.summary()


def test_reader_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="data file not found"):
        list(read_documents([str(tmp_path / "missing.jsonl")]))
    odd = tmp_path / "table.csv"
    odd.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported data file type '.csv'"):
        list(read_documents([str(odd)]))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok \xff")
    stats = ReadStats()
    assert list(read_documents([str(bad)], stats=stats)) == []
    assert "invalid UTF-8 in bad.txt at byte 3" in stats.skipped


def test_python_docs_corpus_is_real_prose():
    stats = ReadStats()
    docs = list(python_docs_corpus(stats))
    assert stats.characters > 500_000
    sources = {d.source for d in docs}
    assert sources == {"pydoc_data.topics", "python-stdlib"}
    assert any("for" in d.doc_id and "statement" in d.text for d in docs)


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo 世界"
    ids = tok.encode_batch([text])[0]
    assert max(ids) < 256 and tok.decode(ids) == text


def _chinese_and_english():
    if (SHARED_DATA / "corpus" / "zh-classics.jsonl").is_file():
        lines = (SHARED_DATA / "corpus" / "zh-classics.jsonl").read_text().splitlines()[:200]
        zh = [json.loads(line)["text"] for line in lines]
    else:
        zh = ["子曰：学而时习之，不亦说乎？有朋自远方来，不亦乐乎？"] * 50
    from pydoc_data.topics import topics

    return zh + [topics[k] for k in sorted(topics)[:30]]


def test_bpe_trains_on_english_and_chinese_and_round_trips(tmp_path):
    texts = _chinese_and_english()
    tok = train_bpe(texts, vocab_size=1000)
    assert tok.vocab_size == 1000
    for text in ("The for statement is used to iterate", "学而时习之，不亦说乎", "mixed 中文 text ✓"):
        ids = tok.encode_batch([text])[0]
        assert tok.decode(ids) == text
    # merges compress: fewer tokens than bytes
    sample = texts[-1]
    assert len(tok.encode_batch([sample])[0]) < 0.6 * len(sample.encode())
    # deterministic: same texts, same tokenizer
    assert train_bpe(texts, vocab_size=1000).fingerprint() == tok.fingerprint()
    tok.save(tmp_path / "tokenizer.json")
    from liandan.data import HFTokenizer

    assert HFTokenizer.load(tmp_path / "tokenizer.json").fingerprint() == tok.fingerprint()


def _array(tmp_path, n_docs=30):
    corpus = write_corpus(tmp_path, n_docs)
    return write_token_array(read_documents([str(corpus)]), ByteTokenizer(), tmp_path / "tokens")


def test_token_array_layout_and_integrity(tmp_path):
    array = _array(tmp_path)
    starts = array.doc_starts
    assert array.meta["documents"] == len(starts) - 1 == 30
    assert starts[-1] == len(array)
    # every document ends with the end-of-document id, and only there
    eos_positions = np.flatnonzero(np.asarray(array.tokens) == ByteTokenizer.eos_id)
    assert np.array_equal(eos_positions, starts[1:] - 1)
    assert array.document_of(np.array([0, starts[1] - 1, starts[1]])).tolist() == [0, 0, 1]
    # a truncated token file is refused with the sizes
    with open(tmp_path / "tokens" / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataError, match="holds 100 bytes"):
        TokenArray(tmp_path / "tokens")
    with pytest.raises(DataError, match="meta.json missing"):
        TokenArray(tmp_path)


def test_loader_is_deterministic_and_rank_invariant(tmp_path):
    array = _array(tmp_path)
    one = PackedLoader(array, seq_len=32, global_batch=8, seed=7, val_fraction=0.1)
    again = PackedLoader(array, seq_len=32, global_batch=8, seed=7, val_fraction=0.1)
    other_seed = PackedLoader(array, seq_len=32, global_batch=8, seed=8, val_fraction=0.1)
    a, b, c = one.next_step(8)[0], again.next_step(8)[0], other_seed.next_step(8)[0]
    assert a.inputs.shape == (8, 32) and a.targets.shape == (8, 32)
    assert a.inputs.equal(b.inputs)
    assert not a.inputs.equal(c.inputs)
    # targets are inputs shifted by one token
    assert a.inputs[:, 1:].equal(a.targets[:, :-1])
    # two data-parallel ranks together see exactly the single-rank global batch, in order
    ranks = [PackedLoader(array, 32, 8, 7, 0.1, dp_rank=r, dp_size=2) for r in range(2)]
    for step in range(5):
        ref = one.next_step(4) if step else None
        halves = [r.next_step(4)[0] for r in ranks]
        if step:
            joined = np.concatenate([h.inputs for h in halves])
            assert np.array_equal(joined, np.concatenate([m.inputs for m in ref]))


def test_loader_resumes_exactly_from_its_state(tmp_path):
    from liandan.data import Document

    docs = [Document("t", str(i), f"doc {i} " * (10 + 3 * i)) for i in range(6)]
    array = write_token_array(docs, ByteTokenizer(), tmp_path / "short")
    straight = PackedLoader(array, 32, 4, seed=3)
    batches = [straight.next_step(2) for _ in range(40)]  # crosses several epochs
    assert straight.samples_per_epoch < 40 * 4
    first = PackedLoader(array, 32, 4, seed=3)
    for _ in range(17):
        first.next_step(2)
    state = first.state_dict()
    resumed = PackedLoader(array, 32, 4, seed=3)
    resumed.load_state_dict(state)
    for step in range(17, 40):
        for got, want in zip(resumed.next_step(2), batches[step]):
            assert got.inputs.equal(want.inputs)
    with pytest.raises(DataError, match="global_batch=4"):
        PackedLoader(array, 32, 8, seed=3).load_state_dict(state)


def test_loader_document_ids_and_split(tmp_path):
    array = _array(tmp_path)
    loader = PackedLoader(array, 64, 8, seed=0, val_fraction=0.2)
    assert not set(loader.val_windows) & set(loader.train_windows)
    assert len(loader.val_windows) + len(loader.train_windows) == (len(array) - 1) // 64
    batch = loader.next_step(8)[0]
    windows = loader.windows_for_step(0)
    for row, window in enumerate(windows):
        positions = window * 64 + np.arange(64)
        docs = array.document_of(positions)
        assert batch.doc_ids[row].tolist() == (docs - docs[0]).tolist()
    assert set(loader.documents_for_step(0)) >= set(array.document_of(windows * 64))
    val = loader.validation(n_batches=2, batch_size=3)
    assert [b.inputs.shape[0] for b in val] == [3, 3]


def test_loader_refuses_corpus_too_small(tmp_path):
    array = write_token_array(
        read_documents([str(_tiny_text(tmp_path))]), ByteTokenizer(), tmp_path / "small"
    )
    with pytest.raises(DataError, match="too small for one training sequence"):
        PackedLoader(array, 256, 4, seed=0)


def _tiny_text(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("just a few words")
    return path
