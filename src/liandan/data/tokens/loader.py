"""Fixed-length training sequences from a weighted mixture of token stores: deterministic, shuffled, sharded,
resumable.

Each store is cut into windows of seq_len + 1 tokens (stride seq_len) that never cross a shard's end. A seeded
split holds some windows of each store out for validation; the rest form the store's endless stream, visited
epoch by epoch in seeded permutations. Optimizer step s consumes the global samples [s * B, (s + 1) * B) of
the mixture: `MixtureSchedule` says how many come from each store, those take the next samples of their
store's stream, and a seeded shuffle places them within the global batch so every data-parallel rank gets a
mix. Rank r of R takes the r-th contiguous slice of the global batch. The batch of a step is thus a function
of (seed, step) alone: resuming needs only the step (and the schedule's few counters, kept so it need not
replay the run), and the global batch is the same whatever the number of ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from liandan.data.documents.corpus import DataError
from liandan.data.tokens.store import Shard, TokenStore
from liandan.faults import forgets

# Seed-sequence tags, so that the split, the epochs and the in-batch shuffle draw independent streams.
_SPLIT, _EPOCH, _PLACE, _VALIDATION = 0x5EED, 0xE90C, 0xB1E7, 0xE7A1


@dataclass
class Batch:
    inputs: torch.Tensor  # (b, T) int64
    targets: torch.Tensor  # (b, T) int64
    doc_ids: torch.Tensor  # (b, T) int32, document index within each sequence, from 0
    # What this micro-batch's mean loss is multiplied by to give its share of the step's loss when targets are
    # masked: its targets x data-parallel ranks / the targets of the whole global batch, so that every target
    # of a step weighs the same whichever micro-batch and rank it falls to. None: every micro-batch of a step
    # weighs the same (they hold as many targets).
    loss_weight: float | None = None

    @property
    def tokens(self) -> int:
        return self.inputs.numel()

    def to(self, device: torch.device) -> Batch:
        moved = (t.to(device, non_blocking=True) for t in (self.inputs, self.targets, self.doc_ids))
        return Batch(*moved, loss_weight=self.loss_weight)


@dataclass(frozen=True, order=True)
class DocumentRef:
    """Where a document of a batch came from: its store (directory name), shard and index there, and the
    source and id it had in the raw data."""

    store: str
    shard: int
    document: int
    source: str
    doc_id: str


class MixtureSchedule:
    """How many samples of each step's global batch of B come from each store.

    With weights w (normalized), store i's cumulative count after S steps stays strictly within 1 of
    w_i * S * B, and no step's count is negative. Every step store i gets base_i = floor(w_i * B); the
    R = B - sum(base) other samples of a step ("extras") are a sequence of slots, R per step, in which store
    i's k-th extra must fall in the window [floor((k - 1) / r_i), ceil(k / r_i)) for its rate
    r_i = (w_i * B - base_i) / R. The rates sum to 1, and each slot going to the eligible store whose window
    closes first (earliest deadline first) meets every window, so after S steps store i's extras are within
    1 of its share R * S * r_i. Floats are exact binary fractions, so the weights are taken exactly and all
    of it is integer arithmetic.
    """

    SAVE_EVERY = 1024  # steps between remembered states, so that any past step is quick to recompute

    def __init__(self, weights: Sequence[float], global_batch: int):
        fractions = [Fraction(w) for w in weights]
        denominator = math.lcm(*(f.denominator for f in fractions))
        self.shares = [int(f * denominator) for f in fractions]
        self.total, self.global_batch = sum(self.shares), global_batch
        self.base = [s * global_batch // self.total for s in self.shares]
        self.rest = [s * global_batch % self.total for s in self.shares]
        self.extras_per_step = sum(self.rest) // self.total
        self._slot_scale = self.extras_per_step * self.total  # extras' rates are rest_i / _slot_scale
        # Extras at every SAVE_EVERY-th step computed so far and at restored steps, and at the steps asked lately.
        self._milestones: dict[int, tuple[int, ...]] = {0: (0,) * len(self.shares)}
        self._recent: dict[int, tuple[int, ...]] = {}

    @property
    def weights(self) -> list[float]:
        return [s / self.total for s in self.shares]

    def extras(self, step: int) -> tuple[int, ...]:
        """Extras each store has received before `step`."""
        if step in self._recent:
            return self._recent[step]
        at = max(k for k in itertools.chain(self._milestones, self._recent) if k <= step)
        counts = list(self._milestones.get(at) or self._recent[at])
        while at < step:
            self._advance(at, counts)
            at += 1
            if at % self.SAVE_EVERY == 0:
                self._milestones[at] = tuple(counts)
        if len(self._recent) >= 16:
            del self._recent[next(iter(self._recent))]  # the oldest asked
        self._recent[step] = tuple(counts)
        return self._recent[step]

    def _advance(self, step: int, extras: list[int]) -> None:
        scale = self._slot_scale
        for slot in range(step * self.extras_per_step, (step + 1) * self.extras_per_step):
            due, chosen = None, -1
            for i, rest in enumerate(self.rest):
                if rest and extras[i] * scale // rest <= slot:  # released: its next window has opened
                    deadline = -(-(extras[i] + 1) * scale // rest)
                    if due is None or deadline < due:
                        due, chosen = deadline, i
            extras[chosen] += 1

    def consumed(self, step: int) -> np.ndarray:
        """Samples each store has given before `step`."""
        return np.array([b * step + x for b, x in zip(self.base, self.extras(step))], dtype=np.int64)

    def counts(self, step: int) -> np.ndarray:
        """Samples each store gives to the global batch of `step`."""
        return self.consumed(step + 1) - self.consumed(step)

    def restore(self, step: int, extras: Sequence[int]) -> None:
        """Continue from a state saved by `extras(step)`, refusing one that no schedule of these weights has."""
        extras = tuple(int(x) for x in extras)
        consistent = len(extras) == len(self.rest) and sum(extras) == step * self.extras_per_step
        if not consistent or any(abs(x * self.total - r * step) >= self.total for x, r in zip(extras, self.rest)):
            raise DataError(f"loader state's mixture counters {list(extras)} do not fit step {step} of this mixture")
        self._milestones[step] = extras

    def split(self, n: int) -> np.ndarray:
        """n samples apportioned once by the weights (largest remainder)."""
        exact = [s * n for s in self.shares]
        counts = [e // self.total for e in exact]
        by_remainder = sorted(range(len(counts)), key=lambda i: (-(exact[i] % self.total), i))
        for i in by_remainder[: n - sum(counts)]:
            counts[i] += 1
        return np.array(counts, dtype=np.int64)


class _Stream:
    """One store's windows: the held-out ones and the endless, epoch-by-epoch shuffled training stream."""

    def __init__(self, store: TokenStore, index: int, seq_len: int, seed: int, val_fraction: float,
                 split_seed: int | None = None):  # fmt: skip
        self.store, self.index, self.seq_len, self.seed = store, index, seq_len, seed
        per_shard = np.array([max(0, (s.num_tokens - 1) // seq_len) for s in store.shards], dtype=np.int64)
        self.window_ends = np.cumsum(per_shard)
        self.window_starts = self.window_ends - per_shard
        windows = int(self.window_ends[-1]) if len(per_shard) else 0
        n_val = int(windows * val_fraction)
        if windows - n_val < 1:
            raise DataError(
                f"token store {store.path} of {store.num_tokens:,} tokens is too small for one training"
                f" sequence of {seq_len} tokens"
            )
        index_dtype = np.int32 if windows < 2**31 else np.int64
        split = seed if split_seed is None else split_seed
        order = np.random.default_rng([split, index, _SPLIT]).permutation(windows).astype(index_dtype)
        self.val_windows = order[:n_val]  # kept in random order: any prefix is a fair sample
        self.train_windows = np.sort(order[n_val:])
        self._epochs: dict[int, np.ndarray] = {}

    def train_windows_at(self, positions: np.ndarray) -> np.ndarray:
        """Window of each position of the endless training stream."""
        epochs, offsets = np.divmod(positions, len(self.train_windows))
        out = np.empty(len(positions), dtype=np.int64)
        for epoch in np.unique(epochs):
            sel = epochs == epoch
            out[sel] = self._epoch_order(int(epoch))[offsets[sel]]
        return out

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch not in self._epochs:
            perm = np.random.default_rng([self.seed, self.index, _EPOCH, epoch]).permutation(len(self.train_windows))
            self._epochs = {e: o for e, o in self._epochs.items() if e == epoch - 1}  # a step may straddle two
            self._epochs[epoch] = self.train_windows[perm]
        return self._epochs[epoch]

    def locate(self, windows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, offset of the first token) of each window."""
        shards = np.searchsorted(self.window_ends, windows, side="right")
        return shards, (windows - self.window_starts[shards]) * self.seq_len


class PackedLoader:
    stream_type: type[_Stream] = _Stream  # what a sample is: here a window of packed tokens

    def __init__(
        self,
        stores: TokenStore | Sequence[TokenStore],
        seq_len: int,
        global_batch: int,
        seed: int,
        val_fraction: float = 0.0,
        dp_rank: int = 0,
        dp_size: int = 1,
        weights: Sequence[float] | None = None,
        loss_mask: bool = False,
        split_seed: int = -1,
    ):
        """`loss_mask`: targets that a store's loss-mask channel leaves out (a fine-tuning store's prompts) are
        -1, which the loss skips; every store must have one. Off, every token is a target. `split_seed`: the
        seed of which windows are held out (-1: `seed`), so that runs of other seeds can be scored on the same
        ones."""
        stores = [stores] if isinstance(stores, TokenStore) else list(stores)
        if not stores:
            raise DataError("no token stores to train on")
        if global_batch % dp_size:
            raise DataError(f"global batch {global_batch} does not split evenly over {dp_size} data-parallel ranks")
        fingerprints = {s.fingerprint for s in stores}
        if len(fingerprints) > 1:
            listing = ", ".join(f"{s.path} ({s.fingerprint})" for s in stores)
            raise DataError(f"token stores of one run must share one tokenizer; these differ: {listing}")
        if weights is None or len(weights) == 0:
            weights = [s.num_tokens for s in stores]  # zero-token stores are refused below as too small
        if len(weights) != len(stores):
            raise DataError(f"{len(weights)} mixture weights for {len(stores)} token stores; give one per store")
        # A weight of 0 keeps a store out of training but in the held-out evaluation (a mixture that drops it).
        if not (all(math.isfinite(w) and w >= 0 for w in weights) and sum(weights) > 0):
            raise DataError(f"mixture weights must be non-negative numbers, not all zero, got {list(weights)}")
        if loss_mask and (unmasked := [str(s.path) for s in stores if s.loss_mask is None]):
            raise DataError(f"token stores without a loss mask (not written from chat data): {', '.join(unmasked)}")
        self.loss_mask = loss_mask
        self.stores, self.seq_len, self.global_batch = stores, seq_len, global_batch
        self.seed, self.val_fraction, self.dp_rank, self.dp_size = seed, val_fraction, dp_rank, dp_size
        self.split_seed = seed if split_seed < 0 else split_seed
        self.streams = [self.stream_type(s, i, seq_len, seed, val_fraction, self.split_seed)
                        for i, s in enumerate(stores)]  # fmt: skip
        self.schedule = MixtureSchedule(weights, global_batch)
        self.step = 0  # the next data step: optimizer steps plus the batches skipped so far
        self.skipped: list[tuple[int, int]] = []  # [first, end) data steps skipped, in order

    # -- state for checkpoints -----------------------------------------------------------------------------
    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
            "val_fraction": self.val_fraction,
            "stores": [s.checksum for s in self.stores],
            "weights": self.schedule.weights,
            # only when it is not the seed: states saved before it existed still load
            **({"split_seed": self.split_seed} if self.split_seed != self.seed else {}),
        }

    def state_dict(self) -> dict:
        return {"step": self.step, "mixture": list(self.schedule.extras(self.step)),
                "skipped": [list(r) for r in self.skipped], **self._identity()}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        for key, ours in self._identity().items():
            if key not in state:
                raise DataError(f"loader state has no '{key}': it was saved by an older liandan; start a new run")
            if state[key] != ours:
                if key == "stores":
                    raise DataError(f"loader state was saved for other token stores ({state[key]}; these are {ours})")
                raise DataError(f"loader state has {key}={state[key]}, this run has {ours}")
        if (theirs := state.get("split_seed", state["seed"])) != self.split_seed:
            raise DataError(f"loader state has split_seed={theirs}, this run has {self.split_seed}")
        if forgets("loader", int(state["step"])):  # a planted resume bug: the fresh position stays
            return
        self.schedule.restore(int(state["step"]), state["mixture"])
        self.step = int(state["step"])
        self.skipped = [(int(a), int(b)) for a, b in state.get("skipped", [])]

    def skip(self, batches: int) -> tuple[int, int]:
        """Pass over the next `batches` global batches without training on them (a loss-spike rollback's data
        skip); they stay listed in `skipped` and in the state, so a resume stays exact and
        `batch_at`/`documents_for_step` can still give them back. Returns their [first, end) data steps."""
        first = self.step
        self.step += batches
        self.schedule.extras(self.step)  # advanced here, so the state saved next restores at once
        if batches:
            self.skipped.append((first, self.step))
        return first, self.step

    def batch_at(self, step: int, micro_batch: int, dp_rank: int | None = None) -> list[Batch]:
        """This rank's share of the global batch of data step `step` (a replay; the position is unchanged), or
        data-parallel rank `dp_rank`'s share."""
        saved = self.step
        self.step = step
        try:
            return self.next_step(micro_batch, dp_rank)
        finally:
            self.step = saved

    # -- batches ------------------------------------------------------------------------------------------
    def windows_for_step(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(store index, window index within that store) of each sample of the global batch of `step`, in rank
        order."""
        stores, positions = self._placed(step)
        windows = np.empty(self.global_batch, dtype=np.int64)
        for i, stream in enumerate(self.streams):
            sel = stores == i
            windows[sel] = stream.train_windows_at(positions[sel])
        return stores, windows

    def stores_for_step(self, step: int) -> np.ndarray:
        """The store index of each sample of the global batch of `step`, in rank order, without looking up a
        window: cheap enough to ask every step."""
        return self._placed(step)[0]

    def _placed(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        """(store index, position in that store's stream) of each sample of the global batch of `step`."""
        counts, consumed = self.schedule.counts(step), self.schedule.consumed(step)
        stores = np.repeat(np.arange(len(self.stores)), counts)
        # Stream positions in store order, then placed by a seeded shuffle (a no-op for one store).
        positions = np.repeat(consumed - np.cumsum(counts) + counts, counts) + np.arange(self.global_batch)
        if len(self.stores) > 1:
            place = np.random.default_rng([self.seed, step, _PLACE]).permutation(self.global_batch)
            stores, positions = stores[place], positions[place]
        return stores, positions

    def next_step(self, micro_batch: int, dp_rank: int | None = None) -> list[Batch]:
        """This rank's share of the next step (or data-parallel rank `dp_rank`'s), as micro-batches of
        `micro_batch` sequences."""
        per_rank = self.global_batch // self.dp_size
        stores, windows = self.windows_for_step(self.step)
        rank = self.dp_rank if dp_rank is None else dp_rank
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        batches = [
            self._batch(stores[mine][i : i + micro_batch], windows[mine][i : i + micro_batch])
            for i in range(0, per_rank, micro_batch)
        ]
        if self.loss_mask:
            targets = self._targets_per_window(stores, windows)
            total = max(1, int(targets.sum()))
            for i, batch in zip(range(0, per_rank, micro_batch), batches):
                batch.loss_weight = int(targets[mine][i : i + micro_batch].sum()) * self.dp_size / total
        self.step += 1
        return batches

    def _targets_per_window(self, stores: np.ndarray, windows: np.ndarray) -> np.ndarray:
        """How many targets the loss mask leaves in each window (its tokens after the first)."""
        counts = np.empty(len(windows), dtype=np.int64)
        for i in np.unique(stores):
            rows = np.flatnonzero(stores == i)
            shards, starts = self.streams[i].locate(windows[rows])
            for row, shard_index, start in zip(rows, shards, starts):
                mask = self.stores[i].shards[shard_index].loss_mask
                counts[row] = np.count_nonzero(mask[start + 1 : start + self.seq_len + 1])
        return counts

    def validation(self, n_batches: int, batch_size: int) -> list[Batch]:
        """n_batches * batch_size held-out windows per rank, drawn from the stores by the mixture weights (as
        far as each store holds enough) and split over ranks the same way as training."""
        available = np.array([len(s.val_windows) for s in self.streams])
        counts = np.minimum(self.schedule.split(n_batches * batch_size * self.dp_size), available)
        stores = np.repeat(np.arange(len(self.streams)), counts)
        windows = np.concatenate([s.val_windows[:n].astype(np.int64) for s, n in zip(self.streams, counts)])
        if len(self.streams) > 1:
            place = np.random.default_rng([self.seed, _VALIDATION]).permutation(len(windows))
            stores, windows = stores[place], windows[place]
        even = len(windows) // self.dp_size * self.dp_size  # every rank as many batches: sharded forwards pair up
        stores, windows = stores[:even], windows[:even]
        stores, windows = stores[self.dp_rank :: self.dp_size], windows[self.dp_rank :: self.dp_size]
        return [
            self._batch(stores[i : i + batch_size], windows[i : i + batch_size])
            for i in range(0, len(windows), batch_size)
        ]

    def validation_by_store(self, n_batches: int, batch_size: int) -> list[tuple[str, list[Batch]]]:
        """The windows `validation` draws, store by store: (store name, this rank's batches of them). A store
        keeps as many windows as split evenly over the ranks (every rank runs as many batches: the forwards of
        a sharded model pair up); one with fewer windows than ranks is left out, on every rank alike."""
        available = np.array([len(s.val_windows) for s in self.streams])
        counts = np.minimum(self.schedule.split(n_batches * batch_size * self.dp_size), available)
        found = []
        for index, (stream, count) in enumerate(zip(self.streams, counts)):
            even = int(count) // self.dp_size * self.dp_size
            if not even:
                continue
            windows = stream.val_windows[:even].astype(np.int64)[self.dp_rank :: self.dp_size]
            stores = np.full(len(windows), index)
            batches = [self._batch(stores[i : i + batch_size], windows[i : i + batch_size])
                       for i in range(0, len(windows), batch_size)]  # fmt: skip
            found.append((self.stores[index].name, batches))
        return found

    def heldout_of_store(self, index: int, n_sequences: int) -> Batch | None:
        """The first `n_sequences` held-out windows of store `index` (all of them when it has fewer), the same on
        every rank; None when the store holds none out (`val_fraction` 0)."""
        windows = self.streams[index].val_windows[:n_sequences].astype(np.int64)
        if not len(windows):
            return None
        return self._batch(np.full(len(windows), index), windows)

    def documents_for_step(self, step: int) -> list[DocumentRef]:
        """Every document that the global batch of `step` draws tokens from, sorted."""
        stores, windows = self.windows_for_step(step)
        found: set[tuple[int, int, int]] = set()
        for i in np.unique(stores):
            stream = self.streams[i]
            shards, starts = stream.locate(windows[stores == i])
            for shard_index in np.unique(shards):
                shard = self.stores[i].shards[shard_index]
                first_tokens = starts[shards == shard_index]
                firsts = shard.document_of(first_tokens)
                lasts = shard.document_of(first_tokens + self.seq_len)
                for first, last in zip(firsts.tolist(), lasts.tolist()):
                    found.update((int(i), int(shard_index), doc) for doc in range(first, last + 1))
        return sorted(
            DocumentRef(self.stores[i].name, shard, doc, *self.stores[i].provenance(shard, doc))
            for i, shard, doc in found
        )

    def _batch(self, stores: np.ndarray, windows: np.ndarray) -> Batch:
        tokens = np.empty((len(windows), self.seq_len + 1), dtype=np.int64)
        doc_ids = np.empty((len(windows), self.seq_len), dtype=np.int32)
        trained = np.empty((len(windows), self.seq_len), dtype=bool) if self.loss_mask else None
        offsets = np.arange(self.seq_len + 1)
        for i in np.unique(stores):
            rows = np.flatnonzero(stores == i)
            shards, starts = self.streams[i].locate(windows[rows])
            for shard_index in np.unique(shards):
                shard = self.stores[i].shards[shard_index]
                sel = shards == shard_index
                positions = starts[sel][:, None] + offsets[None, :]
                tokens[rows[sel]] = shard.tokens[positions]
                _check_vocabulary(self.stores[i], shard, tokens[rows[sel]])
                docs = shard.document_of(positions[:, :-1])
                doc_ids[rows[sel]] = docs - docs[:, :1]
                if trained is not None:
                    trained[rows[sel]] = shard.loss_mask[positions[:, 1:]] != 0  # of each target token
        tokens_t = torch.from_numpy(tokens)
        if trained is None:
            return Batch(tokens_t[:, :-1], tokens_t[:, 1:], torch.from_numpy(doc_ids))
        targets = torch.from_numpy(np.where(trained, tokens[:, 1:], -1))
        return Batch(tokens_t[:, :-1], targets, torch.from_numpy(doc_ids))


def _check_vocabulary(store: TokenStore, shard: Shard, tokens: np.ndarray) -> None:
    """An id outside the store's vocabulary (bit rot, or a shard another tokenizer wrote) would index past the
    embedding table on some rank, deep in the model. Name the store instead: it costs one max per batch."""
    largest = int(tokens.max(initial=0))
    if largest >= store.vocab_size:
        raise DataError(
            f"token store {store.path}: {shard.path.name} holds token id {largest}, outside its vocabulary of"
            f" {store.vocab_size} ids (a corrupt shard? check it with `liandan data info {store.path} --verify`)"
        )
