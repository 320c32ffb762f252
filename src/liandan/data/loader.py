"""Fixed-length training sequences from a token array: deterministic, shuffled, sharded, resumable.

The corpus is cut into windows of seq_len + 1 tokens (stride seq_len). A seeded split holds some windows
out for validation; the rest are visited epoch by epoch in a seeded permutation. Optimizer step s consumes
the global samples [s * global_batch, (s + 1) * global_batch) of that endless stream, and data-parallel rank
r of R takes the r-th contiguous slice of them. The batch of a step is thus a function of (seed, step)
alone: resuming needs only the step, and the global batch is the same whatever the number of ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from liandan.data.corpus import DataError
from liandan.data.tokens import TokenArray


@dataclass
class Batch:
    inputs: torch.Tensor  # (b, T) int64
    targets: torch.Tensor  # (b, T) int64
    doc_ids: torch.Tensor  # (b, T) int32, document index within each sequence, from 0

    @property
    def tokens(self) -> int:
        return self.inputs.numel()

    def to(self, device: torch.device) -> Batch:
        return Batch(*(t.to(device, non_blocking=True) for t in (self.inputs, self.targets, self.doc_ids)))


class PackedLoader:
    def __init__(
        self,
        array: TokenArray,
        seq_len: int,
        global_batch: int,
        seed: int,
        val_fraction: float = 0.0,
        dp_rank: int = 0,
        dp_size: int = 1,
    ):
        if global_batch % dp_size:
            raise DataError(f"global batch {global_batch} does not split evenly over {dp_size} data-parallel ranks")
        self.array, self.seq_len, self.global_batch = array, seq_len, global_batch
        self.seed, self.dp_rank, self.dp_size = seed, dp_rank, dp_size
        windows = (len(array) - 1) // seq_len
        n_val = int(windows * val_fraction)
        if windows - n_val < 1:
            raise DataError(
                f"corpus of {len(array):,} tokens is too small for one training sequence of {seq_len} tokens"
            )
        order = np.random.default_rng([seed, 0x5EED]).permutation(windows)
        self.val_windows = np.sort(order[:n_val])
        self.train_windows = np.sort(order[n_val:])
        self.step = 0
        self._epoch_cache: tuple[int, np.ndarray] | None = None

    # -- state for checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed, "global_batch": self.global_batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key in ("seed", "global_batch", "seq_len"):
            if state[key] != getattr(self, key):
                raise DataError(f"loader state has {key}={state[key]}, this run has {getattr(self, key)}")
        self.step = int(state["step"])

    # -- batches ------------------------------------------------------------------------------------------
    @property
    def samples_per_epoch(self) -> int:
        return len(self.train_windows)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if self._epoch_cache is None or self._epoch_cache[0] != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.train_windows))
            self._epoch_cache = (epoch, self.train_windows[perm])
        return self._epoch_cache[1]

    def windows_for_step(self, step: int) -> np.ndarray:
        """Window indices of the whole global batch of `step`, in rank order."""
        samples = np.arange(step * self.global_batch, (step + 1) * self.global_batch)
        epochs, offsets = np.divmod(samples, self.samples_per_epoch)
        out = np.empty(len(samples), dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._epoch_order(int(epoch))[offsets[sel]]
        return out

    def next_step(self, micro_batch: int) -> list[Batch]:
        """This rank's share of the next step, as micro-batches of `micro_batch` sequences."""
        per_rank = self.global_batch // self.dp_size
        windows = self.windows_for_step(self.step)[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        self.step += 1
        return [self._batch(windows[i : i + micro_batch]) for i in range(0, per_rank, micro_batch)]

    def validation(self, n_batches: int, batch_size: int) -> list[Batch]:
        """The first n_batches * batch_size held-out windows, split over ranks the same way as training."""
        windows = self.val_windows[: n_batches * batch_size * self.dp_size]
        mine = windows[self.dp_rank :: self.dp_size]
        return [self._batch(mine[i : i + batch_size]) for i in range(0, len(mine), batch_size)]

    def documents_for_step(self, step: int) -> np.ndarray:
        """Indices of the corpus documents that the global batch of `step` draws tokens from."""
        starts = self.windows_for_step(step) * self.seq_len
        positions = (starts[:, None] + np.arange(self.seq_len + 1)[None, :]).ravel()
        return np.unique(self.array.document_of(positions))

    def _batch(self, windows: np.ndarray) -> Batch:
        starts = windows * self.seq_len
        positions = starts[:, None] + np.arange(self.seq_len + 1)[None, :]
        tokens = torch.from_numpy(self.array.tokens[positions].astype(np.int64))
        docs = self.array.document_of(positions[:, :-1])
        doc_ids = torch.from_numpy((docs - docs[:, :1]).astype(np.int32))
        return Batch(tokens[:, :-1], tokens[:, 1:], doc_ids)
