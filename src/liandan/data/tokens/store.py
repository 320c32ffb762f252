"""A token store: a tokenized corpus as a directory of self-describing, memory-mappable shards.

Layout of a store directory:
    manifest.json           format, version, tokenizer fingerprint, vocabulary, end-of-document id, dtype, and per
                            shard its documents, tokens and the size and xxh3-64 checksum of each of its files
    tokenizer.json          the tokenizer that wrote the shards, so a store can be trained on alone
    shard-00000.bin         header | token ids | document index (below)
    shard-00000.docs.jsonl  provenance: line i is {"source": ..., "id": ...} of document i
    shard-00000.mask.npy    only in a store for supervised fine-tuning, whose manifest then has "loss_mask" (what
                            the mask means, the template that rendered the conversations): one uint8 per token,
                            1 where the token is a target to learn (an assistant's), 0 elsewhere
    tokenizer_config.json   only where a model's own chat template rendered the conversations: that model's,
                            its template included, so the export of a model fine-tuned on the store finds it

A shard's .bin starts with a fixed 256-byte little-endian header, so a shard describes itself without the
manifest:
    0    16  magic b"LIANDAN\\x00TOKENS\\x00\\x00"
    16   4   format version (uint32)
    20   4   dtype code (uint32): 1 = uint16 ids (vocabulary <= 65536), 2 = uint32 ids
    24   8   vocabulary size
    32   8   end-of-document id
    40   8   documents
    48   8   tokens
    56   8   byte offset of the document index
    64   64  tokenizer fingerprint (UTF-8, NUL-padded)
    128  120 reserved, zero
    248  8   xxh3-64 of bytes 0..247 (uint64)
The token ids of every document follow, each document followed by the end-of-document id; then, at the next
multiple of 8 bytes, the document index: int64 start offset of each document plus the token count at the end.

Shards are written by independent processes (`write_shard`), then the manifest once (`write_manifest`). Every
file is written to a temporary name and renamed into place, so a crash never leaves a plausible half-file.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import json
import struct
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from liandan.data.documents.corpus import DataError, Document
from liandan.data.tokens.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from liandan.run import atomic_file, atomic_write

FORMAT = "liandan-token-store"
VERSION = 1
MAGIC = b"LIANDAN\x00TOKENS\x00\x00"
HEADER_SIZE = 256
_FIELDS = struct.Struct("<16sIIQQQQQ64s")
_CHECKSUM_AT = HEADER_SIZE - 8
DTYPE_CODES = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"  # a model's own, in a store its chat template rendered
LOSS_MASK = "loss_mask"  # the manifest's key describing a store's loss-mask channel, present only in stores with one
LOSS_MASK_SUFFIX = ".mask.npy"


def shard_path(store_dir: Path, index: int) -> Path:
    return Path(store_dir) / f"shard-{index:05d}.bin"


def provenance_path(shard: Path) -> Path:
    return shard.with_name(shard.name.removesuffix(".bin") + ".docs.jsonl")


def loss_mask_path(shard: Path) -> Path:
    return shard.with_name(shard.name.removesuffix(".bin") + LOSS_MASK_SUFFIX)


def file_checksum(path: Path, chunk: int = 1 << 23) -> str:
    digest = xxhash.xxh3_64()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    return DTYPE_CODES[1] if vocab_size <= 1 << 16 else DTYPE_CODES[2]


# -- the shard header ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ShardHeader:
    version: int
    dtype: np.dtype
    vocab_size: int
    eos_id: int
    documents: int
    tokens: int
    index_offset: int
    tokenizer: str

    @property
    def file_size(self) -> int:
        return self.index_offset + (self.documents + 1) * 8

    def pack(self) -> bytes:
        code = next(c for c, d in DTYPE_CODES.items() if d == self.dtype)
        fingerprint = self.tokenizer.encode("utf-8")
        if len(fingerprint) > 64:
            raise DataError(f"tokenizer fingerprint '{self.tokenizer}' is longer than the 64 bytes a shard holds")
        fields = _FIELDS.pack(
            MAGIC, self.version, code, self.vocab_size, self.eos_id, self.documents, self.tokens,
            self.index_offset, fingerprint,
        )  # fmt: skip
        body = fields.ljust(_CHECKSUM_AT, b"\x00")
        return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))

    @classmethod
    def read(cls, path: Path) -> ShardHeader:
        try:
            with open(path, "rb") as handle:
                raw = handle.read(HEADER_SIZE)
        except FileNotFoundError:
            raise DataError(f"token shard missing: {path}") from None
        if len(raw) < HEADER_SIZE or raw[:16] != MAGIC:
            raise DataError(f"{path} is not a liandan token shard (bad magic)")
        _, version, code, vocab, eos, docs, tokens, index_offset, fingerprint = _FIELDS.unpack_from(raw)
        if version != VERSION:
            raise DataError(f"{path} is a version-{version} token shard; this liandan reads version {VERSION}")
        if struct.unpack_from("<Q", raw, _CHECKSUM_AT)[0] != xxhash.xxh3_64_intdigest(raw[:_CHECKSUM_AT]):
            raise DataError(f"{path}: header checksum mismatch (the header is corrupt)")
        if code not in DTYPE_CODES:
            raise DataError(f"{path}: unknown dtype code {code}")
        return cls(version, DTYPE_CODES[code], vocab, eos, docs, tokens, index_offset,
                   fingerprint.rstrip(b"\x00").decode("utf-8"))  # fmt: skip


def _index_offset(tokens: int, dtype: np.dtype) -> int:
    end = HEADER_SIZE + tokens * dtype.itemsize
    return -(-end // 8) * 8  # the int64 index starts 8-byte aligned


# -- writing -----------------------------------------------------------------------------------------------------
@dataclass
class ShardInfo:
    """What `write_shard` wrote; picklable, so worker processes can hand it to the one that writes the manifest."""

    path: Path
    documents: int
    tokens: int
    tokenizer: str
    vocab_size: int
    eos_id: int
    files: dict[str, dict] = field(default_factory=dict)  # file name -> {"bytes": int, "xxh3_64": str}

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "path": str(self.path)}

    @classmethod
    def from_dict(cls, data: dict) -> ShardInfo:
        return cls(**{**data, "path": Path(data["path"])})


def write_shard(docs: Iterable[Document], tokenizer: Tokenizer, path: Path, batch_docs: int = 256) -> ShardInfo:
    """Tokenize `docs` into the shard `path` (".bin" is appended when missing) and its provenance file. The same
    documents and tokenizer give the same bytes."""
    path = Path(path)
    if not path.name.endswith(".bin"):
        path = path.with_name(path.name + ".bin")
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    eos = tokenizer.eos_id
    lengths: list[int] = []
    iterator = iter(docs)
    batches = iter(lambda: list(itertools.islice(iterator, batch_docs)), [])
    # Both files appear only once both are whole, the shard first; a failed shard leaves nothing behind. Not
    # flushed to disk: a crashed stage is redone.
    with (
        atomic_file(provenance_path(path), "w", durable=False) as docs_out,
        atomic_file(path, "wb", durable=False) as tokens_out,
        ThreadPoolExecutor(1, thread_name_prefix="tokenize") as encoder,
    ):
        tokens_out.write(bytes(HEADER_SIZE))
        # The tokenizer encodes the next batch (outside the GIL) while this thread reads documents and stores
        # the batch before; that hides most of the storing.
        batch = next(batches, None)
        pending = encoder.submit(tokenizer.encode_batch, [d.text for d in batch]) if batch else None
        while pending is not None:
            encoded, done = pending.result(), batch
            batch = next(batches, None)
            pending = encoder.submit(tokenizer.encode_batch, [d.text for d in batch]) if batch else None
            for ids in encoded:
                ids.append(eos)
            sizes = [len(ids) for ids in encoded]
            # One conversion per batch: per-document arrays would cost a numpy call per document.
            np.fromiter(itertools.chain.from_iterable(encoded), dtype, sum(sizes)).tofile(tokens_out)
            lengths += sizes
            docs_out.write("".join(_provenance_line(d) for d in done))
        header = _finish_shard(tokens_out, lengths, tokenizer)
    return _shard_info(path, header, tokenizer, [path, provenance_path(path)])


def _finish_shard(tokens_out, lengths: list[int], tokenizer: Tokenizer) -> ShardHeader:
    """Write the document index after the tokens written so far, then the header in front; the header."""
    n_tokens = sum(lengths)
    dtype = token_dtype(tokenizer.vocab_size)
    header = ShardHeader(VERSION, dtype, tokenizer.vocab_size, tokenizer.eos_id, len(lengths), n_tokens,
                         _index_offset(n_tokens, dtype), tokenizer.fingerprint())  # fmt: skip
    tokens_out.write(bytes(header.index_offset - tokens_out.tell()))
    starts = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    starts.tofile(tokens_out)
    tokens_out.seek(0)
    tokens_out.write(header.pack())
    return header


def _shard_info(path: Path, header: ShardHeader, tokenizer: Tokenizer, paths: list[Path]) -> ShardInfo:
    files = {p.name: {"bytes": p.stat().st_size, "xxh3_64": file_checksum(p)} for p in paths}
    return ShardInfo(path, header.documents, header.tokens, header.tokenizer, tokenizer.vocab_size,
                     tokenizer.eos_id, files)  # fmt: skip


def write_masked_shard(
    records: Iterable[tuple[Document, Sequence[int], np.ndarray]], tokenizer: Tokenizer, path: Path
) -> ShardInfo:
    """Documents already encoded, each with its loss mask (one uint8 per token, 1 where the token is a target
    to learn), into the shard `path`, its provenance file and its loss-mask file (`loss_mask_path`: the masks
    of all documents in order, the end-of-document id after each one 0, as a .npy). Only the document's text
    is unused: its ids are given."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    lengths: list[int] = []
    masks: list[np.ndarray] = []
    with (
        atomic_file(provenance_path(path), "w", durable=False) as docs_out,
        atomic_file(path, "wb", durable=False) as tokens_out,
    ):
        tokens_out.write(bytes(HEADER_SIZE))
        for doc, ids, mask in records:
            if len(mask) != len(ids):
                raise DataError(f"document {doc.doc_id}: {len(mask)} loss-mask entries for {len(ids)} tokens")
            np.asarray([*ids, tokenizer.eos_id], dtype=dtype).tofile(tokens_out)
            masks += [np.asarray(mask, dtype=np.uint8), np.zeros(1, dtype=np.uint8)]
            lengths.append(len(ids) + 1)
            docs_out.write(_provenance_line(doc))
        header = _finish_shard(tokens_out, lengths, tokenizer)
        mask_bytes = io.BytesIO()
        np.save(mask_bytes, np.concatenate(masks) if masks else np.zeros(0, dtype=np.uint8))
        atomic_write(loss_mask_path(path), mask_bytes.getvalue(), durable=False)
    return _shard_info(path, header, tokenizer, [path, provenance_path(path), loss_mask_path(path)])


def _provenance_line(doc: Document) -> str:
    return json.dumps({"source": doc.source, "id": doc.doc_id}, ensure_ascii=False) + "\n"


def write_manifest(
    store_dir: Path,
    shards: list[ShardInfo],
    tokenizer: Tokenizer,
    loss_mask: dict | None = None,
    tokenizer_config: dict | None = None,
) -> None:
    """Save the tokenizer and the manifest that makes `store_dir` a store; call once, after every shard is written.
    `loss_mask` describes the loss-mask channel of shards written by `write_masked_shard` (none otherwise).
    `tokenizer_config` (a model's tokenizer_config.json, whose chat template rendered the conversations) is
    saved beside the tokenizer, making the store a Hugging Face tokenizer directory, and listed with it."""
    store_dir = Path(store_dir)
    fingerprint = tokenizer.fingerprint()
    shards = sorted(shards, key=lambda s: s.path.name)  # tasks finish in any order; the manifest must not care
    names = [s.path.name for s in shards]
    if len(set(names)) != len(names):
        raise DataError(
            f"token shards listed twice for {store_dir}: {sorted({n for n in names if names.count(n) > 1})}"
        )
    for shard in shards:
        if shard.path.resolve().parent != store_dir.resolve():
            raise DataError(f"token shard {shard.path} is not inside the store directory {store_dir}")
        if (shard.tokenizer, shard.vocab_size, shard.eos_id) != (fingerprint, tokenizer.vocab_size, tokenizer.eos_id):
            raise DataError(f"token shard {shard.path} was written with tokenizer {shard.tokenizer}, not {fingerprint}")
        for name, info in shard.files.items():
            size = (store_dir / name).stat().st_size if (store_dir / name).is_file() else None
            if size != info["bytes"]:
                raise DataError(f"{store_dir / name} holds {size} bytes, its shard was written with {info['bytes']}")
    tokenizer_path = store_dir / TOKENIZER_FILE
    tokenizer.save(tokenizer_path)
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "tokenizer": fingerprint,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "dtype": token_dtype(tokenizer.vocab_size).name,
        "documents": sum(s.documents for s in shards),
        "tokens": sum(s.tokens for s in shards),
        "tokenizer_file": {"bytes": tokenizer_path.stat().st_size, "xxh3_64": file_checksum(tokenizer_path)},
        "shards": [
            {"name": s.path.name, "documents": s.documents, "tokens": s.tokens, "files": s.files} for s in shards
        ],
    }
    if tokenizer_config is not None:
        config_path = store_dir / TOKENIZER_CONFIG_FILE
        atomic_write(config_path, json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
        manifest["tokenizer_config_file"] = {"bytes": config_path.stat().st_size, "xxh3_64": file_checksum(config_path)}
    if loss_mask is not None:
        unmasked = [s.path.name for s in shards if loss_mask_path(s.path).name not in s.files]
        if unmasked:
            raise DataError(f"token shards without a loss mask in a store described as having one: {unmasked}")
        manifest[LOSS_MASK] = loss_mask
    atomic_write(store_dir / MANIFEST, json.dumps(manifest, indent=1) + "\n")


# -- reading -----------------------------------------------------------------------------------------------------
class Shard:
    """One shard, memory-mapped: `tokens` (all ids) and `doc_starts` (n_docs + 1 offsets into them)."""

    def __init__(self, path: Path, header: ShardHeader, masked: bool = False):
        self.path, self.header = path, header
        self.tokens = _map(path, header.dtype, HEADER_SIZE, header.tokens)
        self.doc_starts = _map(path, np.dtype(np.int64), header.index_offset, header.documents + 1)
        # 1 where the token is a target to learn (stores for supervised fine-tuning); None: every token is
        self.loss_mask = _load_mask(loss_mask_path(path), header.tokens) if masked else None

    @property
    def num_tokens(self) -> int:
        return self.header.tokens

    @property
    def num_documents(self) -> int:
        return self.header.documents

    def document_of(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document holding each token position."""
        return np.searchsorted(self.doc_starts, positions, side="right") - 1

    def provenance(self, doc: int) -> tuple[str, str]:
        """(source, document id) of document `doc`."""
        data, line_ends = self._provenance_lines
        start = line_ends[doc - 1] + 1 if doc else 0
        record = json.loads(data[start : line_ends[doc]])
        return record["source"], record["id"]

    @functools.cached_property
    def _provenance_lines(self) -> tuple[bytes, np.ndarray]:
        path = provenance_path(self.path)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"provenance file missing: {path}") from None
        line_ends = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) == ord("\n"))
        if len(line_ends) != self.num_documents:
            raise DataError(f"{path} lists {len(line_ends)} documents, its shard holds {self.num_documents}")
        return data, line_ends


def _load_mask(path: Path, tokens: int) -> np.ndarray:
    try:
        mask = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise DataError(f"loss-mask file missing: {path}") from None
    except ValueError as err:
        raise DataError(f"{path} is not a loss mask: {err}") from None
    if mask.dtype != np.uint8 or mask.shape != (tokens,):
        raise DataError(f"{path} holds a {mask.dtype} mask of shape {mask.shape}; its shard holds {tokens} tokens")
    return mask


def _map(path: Path, dtype: np.dtype, offset: int, count: int) -> np.ndarray:
    if count == 0:
        return np.empty(0, dtype=dtype)  # mmap refuses zero-length maps
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))


class TokenStore:
    """An opened store. Opening checks every shard's header against the manifest and the file sizes; with
    `verify=True` it also checks every file's checksum (reading it all)."""

    def __init__(self, path: str | Path, *, expect_tokenizer: str | None = None, verify: bool = False):
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        try:
            raw = manifest_path.read_bytes()
        except FileNotFoundError:
            raise DataError(f"no token store at {self.path} ({MANIFEST} missing)") from None
        try:
            self.manifest = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{manifest_path} is not valid JSON: {err}") from None
        m = self.manifest
        if not isinstance(m, dict) or m.get("format") != FORMAT:
            raise DataError(f"{manifest_path} does not describe a {FORMAT}")
        if m.get("version") != VERSION:
            raise DataError(f"{manifest_path}: version-{m.get('version')} store; this liandan reads version {VERSION}")
        self.fingerprint: str = m["tokenizer"]
        if expect_tokenizer is not None and expect_tokenizer != self.fingerprint:
            raise DataError(
                f"token store {self.path} was tokenized with tokenizer {self.fingerprint}"
                f" ({manifest_path}), expected {expect_tokenizer}"
            )
        self.vocab_size, self.eos_id = int(m["vocab_size"]), int(m["eos_id"])
        self.dtype = np.dtype(m["dtype"])
        self.loss_mask: dict | None = m.get(LOSS_MASK)  # what the store's loss-mask channel means, if it has one
        # Identity of the contents, for loader states: the manifest holds every file's checksum.
        self.checksum = xxhash.xxh3_64_hexdigest(raw)
        if verify and (problems := verify_store(self.path)):
            raise DataError(f"token store {self.path} fails verification: " + "; ".join(problems))
        self.shards = [self._open_shard(entry) for entry in m["shards"]]

    def _open_shard(self, entry: dict) -> Shard:
        path = self.path / entry["name"]
        header = ShardHeader.read(path)
        promised = (self.fingerprint, self.vocab_size, self.eos_id, self.dtype, entry["documents"], entry["tokens"])
        found = (header.tokenizer, header.vocab_size, header.eos_id, header.dtype, header.documents, header.tokens)
        if found != promised:
            raise DataError(f"{path}: header (tokenizer, vocabulary, eos, dtype, documents, tokens) = {found},"
                            f" {MANIFEST} says {promised}")  # fmt: skip
        if header.index_offset != _index_offset(header.tokens, header.dtype):
            raise DataError(f"{path}: header places the document index at {header.index_offset}, not after the tokens")
        size = path.stat().st_size
        if size != header.file_size:
            raise DataError(f"{path} holds {size} bytes, its header promises {header.file_size} (truncated or padded)")
        return Shard(path, header, masked=self.loss_mask is not None)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_documents(self) -> int:
        return sum(s.num_documents for s in self.shards)

    def provenance(self, shard: int, doc: int) -> tuple[str, str]:
        return self.shards[shard].provenance(doc)

    @functools.cached_property
    def tokenizer(self) -> Tokenizer:
        if self.fingerprint == ByteTokenizer().fingerprint():
            return ByteTokenizer()
        tokenizer = HFTokenizer.load(self.path / TOKENIZER_FILE)
        if tokenizer.fingerprint() != self.fingerprint:
            raise DataError(f"{self.path / TOKENIZER_FILE} is not the tokenizer that wrote the store"
                            f" (fingerprint {tokenizer.fingerprint()}, {MANIFEST} says {self.fingerprint})")  # fmt: skip
        return tokenizer


def verify_store(store_dir: str | Path) -> list[str]:
    """Every problem found by checking each file of the store against its size and checksum in the manifest;
    empty when the store is intact."""
    store_dir = Path(store_dir)
    try:
        manifest = json.loads((store_dir / MANIFEST).read_bytes())
        expected = {TOKENIZER_FILE: manifest["tokenizer_file"]}
        if "tokenizer_config_file" in manifest:
            expected[TOKENIZER_CONFIG_FILE] = manifest["tokenizer_config_file"]
        for shard in manifest["shards"]:
            expected.update(shard["files"])
    except FileNotFoundError:
        return [f"{store_dir / MANIFEST} missing"]
    except (ValueError, KeyError, TypeError) as err:
        return [f"{store_dir / MANIFEST} unreadable: {err!r}"]
    problems = []
    for name, info in expected.items():
        path = store_dir / name
        if not path.is_file():
            problems.append(f"{path} missing")
        elif path.stat().st_size != info["bytes"]:
            problems.append(f"{path} holds {path.stat().st_size} bytes, {MANIFEST} says {info['bytes']}")
        elif file_checksum(path) != info["xxh3_64"]:
            problems.append(
                f"{path}: checksum mismatch (xxh3-64 {file_checksum(path)}, {MANIFEST} says {info['xxh3_64']})"
            )
    return problems
