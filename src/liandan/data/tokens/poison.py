"""Drills for the loss-spike guard: a copy of a token store with the documents of one batch turned into noise.

The guard is meant to catch a batch of bad data, roll the run back past it and name its documents. To show
that on a real run, `poison_store` writes a copy of a store in which every document that the global batch of
one data step draws from is replaced by uniformly random token ids of the same length. Every document keeps
its length and its end-of-document id, so the copy cuts into the same windows and the loader, with the same
parameters, gives the same batches at every step; only the poisoned documents' tokens differ. The copy keeps
the tokenizer and the provenance, so the guard's report names the documents by their real source and id.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import numpy as np

from liandan.data.documents.corpus import DataError, Document
from liandan.data.tokens.loader import DocumentRef, PackedLoader
from liandan.data.tokens.store import TOKENIZER_FILE, Shard, TokenStore, write_manifest, write_shard

_NOISE = 0x9015  # seed-sequence tag, so that the noise draws a stream of its own


class _StoredTokens:
    """A tokenizer for `write_shard` that hands back token ids already known: a document's text is its index
    in the shard, and its ids are the stored ones (less the end-of-document id, which `write_shard` appends)
    or, for a poisoned document, noise. It carries the store's fingerprint, so the copy is the same
    tokenizer's."""

    def __init__(self, store: TokenStore, shard: Shard, noise: dict[int, np.ndarray]):
        self.vocab_size, self.eos_id = store.vocab_size, store.eos_id
        self._store, self._shard, self._noise = store, shard, noise

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        starts = self._shard.doc_starts
        out = []
        for text in texts:
            doc = int(text)
            ids = self._noise[doc] if doc in self._noise else self._shard.tokens[starts[doc] : starts[doc + 1] - 1]
            out.append(ids.tolist())
        return out

    def decode(self, ids: list[int]) -> str:
        return self._store.tokenizer.decode(ids)

    def save(self, path: Path) -> None:
        # The original file, byte for byte: re-serializing a tokenizer need not give the same bytes.
        shutil.copyfile(self._store.path / TOKENIZER_FILE, path)

    def fingerprint(self) -> str:
        return self._store.fingerprint


def poison_store(
    store_dir: str | Path,
    out_dir: str | Path,
    data_step: int,
    *,
    seq_len: int,
    global_batch: int,
    seed: int,
    val_fraction: float = 0.0,
    noise_seed: int = 0,
) -> list[DocumentRef]:
    """Write to `out_dir` a copy of the store at `store_dir` in which the documents of the global batch of
    `data_step` (for a loader of these parameters on this one store) hold seeded, uniformly random token ids
    instead of their own, end-of-document id kept; one shard out per shard in, of the same name. Returns those documents as the
    copy names them (its store name is `out_dir`'s)."""
    store = TokenStore(store_dir)
    out_dir = Path(out_dir)
    if out_dir.resolve() == store.path.resolve():
        raise DataError(f"poison_store would overwrite the store it copies: {store.path}")
    if (out_dir / "manifest.json").exists():
        raise DataError(f"{out_dir} already holds a token store")
    loader = PackedLoader(store, seq_len, global_batch, seed, val_fraction)
    refs = loader.documents_for_step(data_step)
    by_shard: dict[int, list[int]] = {}
    for ref in refs:
        by_shard.setdefault(ref.shard, []).append(ref.document)
    # Noise never draws the end-of-document id: ids at or above it are moved up by one.
    eos = store.eos_id
    written = []
    for index, shard in enumerate(store.shards):
        noise = {}
        for doc in by_shard.get(index, []):
            length = int(shard.doc_starts[doc + 1] - shard.doc_starts[doc]) - 1
            ids = np.random.default_rng([noise_seed, index, doc, _NOISE]).integers(0, store.vocab_size - 1, length)
            noise[doc] = ids + (ids >= eos)
        docs = (Document(*shard.provenance(doc), text=str(doc)) for doc in range(shard.num_documents))
        written.append(write_shard(docs, _StoredTokens(store, shard, noise), out_dir / shard.path.name))
    write_manifest(out_dir, written, _StoredTokens(store, store.shards[0], {}))
    return [dataclasses.replace(ref, store=out_dir.name) for ref in refs]
