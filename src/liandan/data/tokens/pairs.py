"""Preference pairs as training samples: the loader of a DPO run.

A preference store (`data/pipeline/preferences.py`) holds each pair as two documents in a row, chosen then
rejected. Here a sample is a pair, not a window of packed tokens: each of its two conversations becomes a row
of its own, cut to seq_len + 1 tokens and padded after its end (padding is never a target and is a document
of its own), so no two conversations ever share a row and every row starts at its conversation's beginning.
A micro-batch of n pairs is a `Batch` of 2n rows, chosen and rejected alternating: rows 2i and 2i + 1 are
pair i's.

Everything else is `PackedLoader`'s: the seeded hold-out split, the epoch-by-epoch shuffled stream of each
store, the mixture of several stores, the split over data-parallel ranks and the state, so a step's pairs are
a function of (seed, step) alone and a resume is exact. `global_batch` and `micro_batch` count pairs.

A micro-batch's `loss_weight` counts the targets of its chosen replies: its share of the chosen replies'
targets of the whole global batch x data-parallel ranks, so that a loss averaged over those targets (ORPO's
negative log-likelihood) weighs each of them the same whichever micro-batch and rank it falls to.
"""

from __future__ import annotations

import numpy as np
import torch

from liandan.data.documents.corpus import DataError
from liandan.data.tokens.loader import _SPLIT, Batch, DocumentRef, PackedLoader, _check_vocabulary, _Stream
from liandan.data.tokens.store import TokenStore


class _PairStream(_Stream):
    """One store's pairs: the held-out ones and the endless, epoch-by-epoch shuffled training stream (the
    windows of `_Stream` are pairs here)."""

    def __init__(self, store: TokenStore, index: int, seq_len: int, seed: int, val_fraction: float,
                 split_seed: int | None = None):  # fmt: skip
        self.store, self.index, self.seq_len, self.seed = store, index, seq_len, seed
        per_shard = np.array([s.num_documents // 2 for s in store.shards], dtype=np.int64)
        self.window_ends = np.cumsum(per_shard)
        self.window_starts = self.window_ends - per_shard
        pairs = int(self.window_ends[-1]) if len(per_shard) else 0
        n_val = int(pairs * val_fraction)
        if pairs - n_val < 1:
            raise DataError(f"preference store {store.path} holds no pair to train on ({pairs} pairs,"
                            f" {n_val} held out)")  # fmt: skip
        order = np.random.default_rng([seed if split_seed is None else split_seed, index, _SPLIT]).permutation(pairs)
        self.val_windows = order[:n_val]
        self.train_windows = np.sort(order[n_val:])
        self._epochs: dict[int, np.ndarray] = {}

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, index of the chosen conversation's document there) of each pair."""
        shards = np.searchsorted(self.window_ends, windows, side="right")
        return shards, (windows - self.window_starts[shards]) * 2


class PairLoader(PackedLoader):
    stream_type = _PairStream

    def __init__(self, stores, seq_len, global_batch, seed, val_fraction=0.0, dp_rank=0, dp_size=1, weights=None,
                 split_seed=-1):  # fmt: skip
        stores = [stores] if isinstance(stores, TokenStore) else list(stores)
        if unpaired := [str(s.path) for s in stores if not (s.loss_mask or {}).get("pairs")]:
            raise DataError(f"token stores without preference pairs (not written from prompt/chosen/rejected"
                            f" records): {', '.join(unpaired)}")  # fmt: skip
        super().__init__(stores, seq_len, global_batch, seed, val_fraction, dp_rank, dp_size, weights,
                         loss_mask=True, split_seed=split_seed)  # fmt: skip

    def truncated(self) -> tuple[int, int]:
        """(conversations longer than a row, conversations): the longer ones lose their ends."""
        lengths = np.concatenate([np.diff(shard.doc_starts) for store in self.stores for shard in store.shards])
        return int((lengths > self.seq_len + 1).sum()), len(lengths)

    def _targets_per_window(self, stores: np.ndarray, windows: np.ndarray) -> np.ndarray:
        """How many targets each pair's chosen reply has in its row (after the row's first token, up to its cut)."""
        counts = np.empty(len(windows), dtype=np.int64)
        for sample, (store_index, window) in enumerate(zip(stores.tolist(), windows.tolist())):
            shard_indices, firsts = self.streams[store_index].locate(np.array([window]))
            shard = self.stores[store_index].shards[int(shard_indices[0])]
            start, end = int(shard.doc_starts[int(firsts[0])]), int(shard.doc_starts[int(firsts[0]) + 1])
            counts[sample] = np.count_nonzero(shard.loss_mask[start + 1 : min(end, start + self.seq_len + 1)])
        return counts

    def _batch(self, stores: np.ndarray, windows: np.ndarray) -> Batch:
        rows = 2 * len(windows)
        tokens = np.zeros((rows, self.seq_len + 1), dtype=np.int64)
        trained = np.zeros((rows, self.seq_len + 1), dtype=bool)
        doc_ids = np.ones((rows, self.seq_len), dtype=np.int32)  # padding: a document of its own
        for sample, (store_index, window) in enumerate(zip(stores.tolist(), windows.tolist())):
            store = self.stores[store_index]
            shard_indices, firsts = self.streams[store_index].locate(np.array([window]))
            shard = store.shards[int(shard_indices[0])]
            for side in range(2):
                doc, row = int(firsts[0]) + side, 2 * sample + side
                start, end = int(shard.doc_starts[doc]), int(shard.doc_starts[doc + 1])
                end = min(end, start + self.seq_len + 1)
                tokens[row, : end - start] = shard.tokens[start:end]
                trained[row, : end - start] = shard.loss_mask[start:end] != 0
                doc_ids[row, : end - start] = 0
            _check_vocabulary(store, shard, tokens[2 * sample : 2 * sample + 2])
        targets = np.where(trained[:, 1:], tokens[:, 1:], -1)
        return Batch(torch.from_numpy(tokens[:, :-1]), torch.from_numpy(targets), torch.from_numpy(doc_ids))

    def documents_for_step(self, step: int) -> list[DocumentRef]:
        """Both conversations of every pair of the global batch of `step`, sorted."""
        stores, windows = self.windows_for_step(step)
        found = set()
        for store_index, window in zip(stores.tolist(), windows.tolist()):
            shards, firsts = self.streams[store_index].locate(np.array([window]))
            for doc in (int(firsts[0]), int(firsts[0]) + 1):
                found.add((store_index, int(shards[0]), doc))
        return sorted(
            DocumentRef(self.stores[i].name, shard, doc, *self.stores[i].provenance(shard, doc))
            for i, shard, doc in found
        )
