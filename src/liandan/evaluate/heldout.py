"""Held-out loss per data source, in nats per token and in bits per byte.

The held-out windows of each store in the mixture (the loader's validation split, which training never
draws) are scored separately, so a mixture's average cannot hide a source that got worse. Loss per token
depends on the tokenizer; bits per byte does not: the summed negative log-likelihood in bits divided by the
UTF-8 bytes of the text the scored tokens decode to, so runs with different tokenizers compare.

Every rank scores the same windows (a model sharded with FSDP2 or tensor parallelism needs every rank in each
forward); `split` instead spreads the windows over processes that each hold the whole model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class HeldoutResult:
    source: str
    nats: float
    tokens: int
    bytes: int

    @property
    def loss(self) -> float:
        return self.nats / self.tokens if self.tokens else math.nan

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / self.bytes if self.bytes else math.nan

    def event(self, step: int) -> dict[str, Any]:
        """The "eval_heldout" event's fields."""
        return {"step": step, "source": self.source, "loss": self.loss, "bits_per_byte": self.bits_per_byte,
                "tokens": self.tokens, "bytes": self.bytes}  # fmt: skip

    def line(self) -> str:
        return (f"held-out {self.source}: loss {self.loss:.4f} nats/token, {self.bits_per_byte:.4f} bits/byte"
                f" ({self.tokens:,} tokens, {self.bytes:,} bytes)")  # fmt: skip


@torch.no_grad()
def heldout_losses(
    model: torch.nn.Module, loader: Any, tokenizer: Any, *, sequences: int, batch_size: int = 8,
    document_mask: bool = True, device: torch.device | None = None, autocast: Callable[[], Any] | None = None,
    split: Any = None,
) -> list[HeldoutResult]:  # fmt: skip
    """Per store of `loader` (a PackedLoader), the loss over its first `sequences` held-out windows; stores that
    hold none out are left out. `split` (runner.Split) spreads the windows over processes and sums."""
    results = []
    was_training = model.training
    model.eval()
    try:
        for index, store in enumerate(loader.stores):
            batch = loader.heldout_of_store(index, sequences)
            if batch is None:
                continue
            rows = list(range(batch.inputs.shape[0]))
            if split is not None:
                rows = rows[split.rank :: split.size]
            sums = _score_rows(model, batch, rows, tokenizer, batch_size, document_mask, device, autocast)
            if split is not None:
                sums = _sum_parts(split.gather([sums]))
            results.append(HeldoutResult(store.name, sums[0], int(sums[1]), int(sums[2])))
    finally:
        model.train(was_training)
    return results


def _sum_parts(parts: list[list[list[float]]]) -> list[float]:
    flat = [p for part in parts for p in part]
    return [sum(p[k] for p in flat) for k in range(3)]


def _score_rows(
    model: torch.nn.Module, batch: Any, rows: list[int], tokenizer: Any, batch_size: int, document_mask: bool,
    device: torch.device | None, autocast: Callable[[], Any] | None,
) -> list[float]:  # fmt: skip
    """[summed nats, tokens, bytes] over `rows` of the batch."""
    nats, tokens, n_bytes = 0.0, 0, 0
    for start in range(0, len(rows), batch_size):
        chosen = rows[start : start + batch_size]
        inputs, targets = batch.inputs[chosen], batch.targets[chosen]
        doc_ids = batch.doc_ids[chosen] if document_mask else None
        if device is not None:
            inputs, targets = inputs.to(device), targets.to(device)
            doc_ids = doc_ids.to(device) if doc_ids is not None else None
        with autocast() if autocast is not None else contextlib.nullcontext():
            logits = model(inputs, doc_ids=doc_ids)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        nats += float(loss)
        tokens += targets.numel()
        n_bytes += sum(len(tokenizer.decode(row).encode("utf-8")) for row in targets.cpu().tolist())
    return [nats, tokens, n_bytes]
