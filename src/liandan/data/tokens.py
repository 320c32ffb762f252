"""A memory-mapped array of token ids with document boundaries: the trainer's view of a tokenized corpus.

Layout of a token-array directory:
    tokens.bin      the ids of every document, each followed by the end-of-document id (uint16 or uint32)
    doc_starts.npy  int64 offset of each document's first token, plus the total length at the end
    meta.json       dtype, counts, vocabulary size and the tokenizer's fingerprint
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from liandan.data.corpus import DataError, Document
from liandan.data.tokenizer import Tokenizer

FORMAT = "liandan-token-array"
VERSION = 1


def write_token_array(
    docs: Iterable[Document], tokenizer: Tokenizer, out_dir: Path, batch_docs: int = 256
) -> TokenArray:
    out_dir.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.uint32
    starts = [0]
    batch: list[str] = []
    with open(out_dir / "tokens.bin", "wb") as handle:

        def flush() -> None:
            for ids in tokenizer.encode_batch(batch):
                ids.append(tokenizer.eos_id)
                np.asarray(ids, dtype=dtype).tofile(handle)
                starts.append(starts[-1] + len(ids))
            batch.clear()

        for doc in docs:
            batch.append(doc.text)
            if len(batch) >= batch_docs:
                flush()
        flush()
    if len(starts) == 1:
        raise DataError("the corpus holds no documents to train on")
    np.save(out_dir / "doc_starts.npy", np.asarray(starts, dtype=np.int64))
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "dtype": np.dtype(dtype).name,
        "tokens": starts[-1],
        "documents": len(starts) - 1,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "tokenizer": tokenizer.fingerprint(),
    }
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return TokenArray(out_dir)


class TokenArray:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        meta_path = self.path / "meta.json"
        if not meta_path.is_file():
            raise DataError(f"no token array at {self.path} (meta.json missing)")
        self.meta = json.loads(meta_path.read_text())
        if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
            raise DataError(f"{meta_path}: not a version-{VERSION} {FORMAT}")
        dtype = np.dtype(self.meta["dtype"])
        expected = self.meta["tokens"] * dtype.itemsize
        actual = (self.path / "tokens.bin").stat().st_size
        if actual != expected:
            raise DataError(f"{self.path / 'tokens.bin'} holds {actual} bytes, meta.json promises {expected}")
        self.tokens = np.memmap(self.path / "tokens.bin", dtype=dtype, mode="r")
        self.doc_starts = np.load(self.path / "doc_starts.npy")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])

    def document_of(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document holding each token position."""
        return np.searchsorted(self.doc_starts, positions, side="right") - 1
