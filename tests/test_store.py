import json
import struct

import numpy as np
import pytest

from helpers import SHARED_DATA
from liandan.data import (
    ByteTokenizer,
    DataError,
    Document,
    TokenStore,
    shard_path,
    train_bpe,
    verify_store,
    write_manifest,
    write_shard,
)
from liandan.data.tokens.store import HEADER_SIZE, MAGIC, ShardHeader, ShardInfo


def _pydoc_documents(start=0, count=40, source="pydoc"):
    from pydoc_data.topics import topics

    return [Document(source, name, topics[name]) for name in sorted(topics)[start : start + count]]


def _shared_documents():
    wiki, zh = SHARED_DATA / "corpus" / "en-wikitext2.jsonl", SHARED_DATA / "corpus" / "zh-classics.jsonl"
    if not (wiki.is_file() and zh.is_file()):
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    records = [("wiki", json.loads(line)) for line in wiki.read_text().splitlines()[:40]]
    records += [("zh", json.loads(line)) for line in zh.read_text().splitlines()[:300]]
    return [Document(source, str(r["id"]), r["text"]) for source, r in records]


def _byte_store(directory, shards=((0, 20), (20, 15))):
    infos = [
        write_shard(_pydoc_documents(a, n), ByteTokenizer(), shard_path(directory, i))
        for i, (a, n) in enumerate(shards)
    ]
    write_manifest(directory, infos, ByteTokenizer())
    return directory


def test_store_round_trip_with_bpe_on_english_and_chinese(tmp_path):
    docs = _shared_documents()
    tokenizer = train_bpe((d.text for d in docs), vocab_size=800)
    store_dir = tmp_path / "store"
    halves = [docs[::2], docs[1::2]]
    infos = [write_shard(half, tokenizer, store_dir / f"shard-{i:05d}") for i, half in enumerate(halves)]
    write_manifest(store_dir, infos[::-1], tokenizer)  # finishing order does not matter

    store = TokenStore(store_dir, expect_tokenizer=tokenizer.fingerprint())
    assert [s.path.name for s in store.shards] == ["shard-00000.bin", "shard-00001.bin"]
    assert store.num_documents == len(docs) and store.num_tokens == sum(i.tokens for i in infos)
    assert store.dtype == np.uint16 and store.vocab_size == 800 and store.eos_id == tokenizer.eos_id
    # the store carries its own tokenizer
    assert store.tokenizer.fingerprint() == tokenizer.fingerprint() == store.fingerprint
    for shard_index, half in enumerate(halves):
        shard = store.shards[shard_index]
        starts = np.asarray(shard.doc_starts)
        assert starts[0] == 0 and starts[-1] == shard.num_tokens == len(shard.tokens)
        eos_positions = np.flatnonzero(np.asarray(shard.tokens) == store.eos_id)
        assert np.array_equal(eos_positions, starts[1:] - 1)  # each document ends with eos, and only there
        for doc_index in (0, 7, len(half) - 1):
            ids = shard.tokens[starts[doc_index] : starts[doc_index + 1] - 1].tolist()
            assert store.tokenizer.decode(ids) == half[doc_index].text
            assert store.provenance(shard_index, doc_index) == (half[doc_index].source, half[doc_index].doc_id)
        assert shard.document_of(np.array([0, starts[1] - 1, starts[1]])).tolist() == [0, 0, 1]
    assert verify_store(store_dir) == []


def test_header_describes_the_shard_without_the_manifest(tmp_path):
    info = write_shard(_pydoc_documents(0, 5), ByteTokenizer(), tmp_path / "shard-00000.bin")
    raw = info.path.read_bytes()
    magic, version, code, vocab, eos, docs, tokens, index_offset, fingerprint = struct.unpack_from(
        "<16sIIQQQQQ64s", raw
    )
    assert magic == MAGIC == b"LIANDAN\x00TOKENS\x00\x00" and version == 1
    assert (code, vocab, eos, docs) == (1, 257, 256, 5)  # 1: uint16 ids
    assert fingerprint.rstrip(b"\x00") == b"byte-v1"
    assert tokens == info.tokens and index_offset % 8 == 0 and index_offset >= HEADER_SIZE + 2 * tokens
    starts = np.frombuffer(raw, dtype=np.int64, offset=index_offset)
    assert len(starts) == docs + 1 and starts[-1] == tokens
    ids = np.frombuffer(raw, dtype=np.uint16, count=tokens, offset=HEADER_SIZE)
    assert bytes(ids[: starts[1] - 1].astype(np.uint8)).decode() == _pydoc_documents(0, 1)[0].text
    lines = (tmp_path / "shard-00000.docs.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == [d.doc_id for d in _pydoc_documents(0, 5)]
    assert ShardInfo.from_dict(json.loads(json.dumps(info.to_dict()))) == info


class WideByteTokenizer(ByteTokenizer):
    """Byte ids shifted past 65535: a vocabulary that needs 32-bit ids."""

    vocab_size = 70_000
    eos_id = 69_999

    def encode_batch(self, texts):
        return [[b + 65_536 for b in ids] for ids in super().encode_batch(texts)]

    def fingerprint(self):
        return "wide-bytes"


def test_large_vocabularies_use_32_bit_ids(tmp_path):
    tokenizer = WideByteTokenizer()
    info = write_shard(_pydoc_documents(0, 3), tokenizer, shard_path(tmp_path, 0))
    header = ShardHeader.read(info.path)
    assert header.dtype == np.uint32 and header.vocab_size == 70_000
    ids = np.fromfile(info.path, dtype=np.uint32, count=info.tokens, offset=HEADER_SIZE)
    assert ids.min() >= 65_536 and ids.max() == 69_999


def test_same_documents_same_bytes(tmp_path):
    for name in ("a", "b"):
        _byte_store(tmp_path / name)
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert "tokenizer.json" in files and "manifest.json" in files and "shard-00001.docs.jsonl" in files
    for name in files:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_manifest_lists_every_file_with_its_checksum(tmp_path):
    store_dir = _byte_store(tmp_path / "s")
    manifest = json.loads((store_dir / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"], manifest["dtype"]) == ("liandan-token-store", 1, "uint16")
    assert manifest["documents"] == 35 and manifest["tokenizer"] == "byte-v1"
    first = manifest["shards"][0]
    assert first["name"] == "shard-00000.bin" and first["documents"] == 20
    assert set(first["files"]) == {"shard-00000.bin", "shard-00000.docs.jsonl"}
    assert first["files"]["shard-00000.bin"]["bytes"] == (store_dir / "shard-00000.bin").stat().st_size


def test_wrong_tokenizer_is_refused(tmp_path):
    store_dir = _byte_store(tmp_path / "s")
    with pytest.raises(DataError, match=r"tokenized with tokenizer byte-v1 .*manifest.json.*expected 0123abcd"):
        TokenStore(store_dir, expect_tokenizer="0123abcd")
    other = write_shard(_pydoc_documents(0, 2), WideByteTokenizer(), tmp_path / "s" / "shard-00009.bin")
    with pytest.raises(DataError, match="shard-00009.bin was written with tokenizer wide-bytes"):
        write_manifest(store_dir, [other], ByteTokenizer())


def test_truncated_shard_is_refused(tmp_path):
    store_dir = _byte_store(tmp_path / "s")
    path = store_dir / "shard-00001.bin"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size - 8)
    with pytest.raises(DataError, match=rf"shard-00001.bin holds {size - 8} bytes, its header promises {size}"):
        TokenStore(store_dir)
    assert any("shard-00001.bin holds" in p for p in verify_store(store_dir))


def test_flipped_byte_fails_the_checksum(tmp_path):
    store_dir = _byte_store(tmp_path / "s")
    path = store_dir / "shard-00000.bin"
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + 100] ^= 0x01  # one bit of one token
    path.write_bytes(bytes(data))
    TokenStore(store_dir)  # sizes and headers still agree: only reading everything can tell
    with pytest.raises(DataError, match=r"shard-00000.bin: checksum mismatch"):
        TokenStore(store_dir, verify=True)
    problems = verify_store(store_dir)
    assert len(problems) == 1 and "shard-00000.bin: checksum mismatch" in problems[0]
    data[20] ^= 0x01  # the dtype code: the header's own checksum catches it without verify
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match="shard-00000.bin: header checksum mismatch"):
        TokenStore(store_dir)


def test_bad_magic_version_and_missing_files(tmp_path):
    store_dir = _byte_store(tmp_path / "s")
    path = store_dir / "shard-00000.bin"
    original = path.read_bytes()
    path.write_bytes(b"NOTATOKENSHARD!!" + original[16:])
    with pytest.raises(DataError, match="shard-00000.bin is not a liandan token shard"):
        TokenStore(store_dir)
    header = ShardHeader.read(store_dir / "shard-00001.bin")
    newer = ShardHeader(**{**header.__dict__, "version": 2}).pack()
    path.write_bytes(newer + original[HEADER_SIZE:])
    with pytest.raises(DataError, match="version-2 token shard; this liandan reads version 1"):
        TokenStore(store_dir)
    path.unlink()
    with pytest.raises(DataError, match="token shard missing: .*shard-00000.bin"):
        TokenStore(store_dir)
    with pytest.raises(DataError, match=r"no token store at .* \(manifest.json missing\)"):
        TokenStore(tmp_path)
    manifest = json.loads((store_dir / "manifest.json").read_text())
    (store_dir / "manifest.json").write_text(json.dumps({**manifest, "version": 9}))
    with pytest.raises(DataError, match="version-9 store; this liandan reads version 1"):
        TokenStore(store_dir)


def test_empty_shard_is_a_valid_part_of_a_store(tmp_path):
    store_dir = tmp_path / "s"
    infos = [write_shard([], ByteTokenizer(), shard_path(store_dir, 0))]
    infos.append(write_shard(_pydoc_documents(0, 3), ByteTokenizer(), shard_path(store_dir, 1)))
    write_manifest(store_dir, infos, ByteTokenizer())
    store = TokenStore(store_dir, verify=True)
    assert [s.num_documents for s in store.shards] == [0, 3]
    assert store.shards[0].path.stat().st_size == HEADER_SIZE + 8  # header and the single index entry


def test_provenance_file_must_match_its_shard(tmp_path):
    store_dir = _byte_store(tmp_path / "s")
    docs_file = store_dir / "shard-00000.docs.jsonl"
    docs_file.write_text("".join(docs_file.read_text().splitlines(keepends=True)[:-1]))
    with pytest.raises(DataError, match="lists 19 documents, its shard holds 20"):
        TokenStore(store_dir).provenance(0, 3)


def test_a_failed_shard_leaves_no_files(tmp_path):
    def documents_then_a_bad_file():
        yield from _pydoc_documents(0, 300)
        raise DataError("data file not found: later.jsonl")

    with pytest.raises(DataError, match="later.jsonl"):
        write_shard(documents_then_a_bad_file(), ByteTokenizer(), shard_path(tmp_path, 0), batch_docs=16)
    assert list(tmp_path.iterdir()) == []
