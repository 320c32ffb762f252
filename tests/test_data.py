import json

import pytest

from helpers import SHARED_DATA
from liandan.data import (
    ByteTokenizer,
    DataError,
    ReadStats,
    python_docs_corpus,
    read_documents,
    train_bpe,
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


def test_bpe_learns_the_same_from_one_long_line_cut_into_pieces():
    """A long text is handed to the trainer in pieces (its memory grows with a text's length); the cuts fall
    where the pre-tokeniser splits anyway, so the vocabulary is the one the whole text gives."""
    from liandan.data.tokens import tokenizer as tokenizer_module

    english, chinese = _chinese_and_english()[-1], "".join(_chinese_and_english()[:-1])
    line = (f"{english}  {chinese}  don't  stop\t 3.14 —  ok  " * 40).replace("\n", " ")
    pieces = list(tokenizer_module._in_pieces([line], limit=2000))
    assert len(pieces) > 10 and max(map(len, pieces)) <= 2000 and "".join(pieces) == line
    assert train_bpe([line], 600, piece_chars=2000).fingerprint() == train_bpe([line], 600).fingerprint()


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
