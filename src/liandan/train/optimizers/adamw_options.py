"""AdamW's own keys of the run config, `[optim.adamw]` (or flat in `[optim]`, as before there were others)."""

from __future__ import annotations

from dataclasses import dataclass

from liandan.config import option


@dataclass
class AdamWOptions:
    beta1: float = option(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = option(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = option(1e-8, "AdamW epsilon", min=0.0)
    weight_decay: float = option(0.1, "decoupled weight decay", min=0.0)
    decay_norms_and_embeddings: bool = option(False, "also decay norm weights and embeddings")
    # Speed runs (modded-nanogpt) train the embedding far faster than the rest: each of its rows is updated
    # only by the tokens that use it, so its gradient is sparse and small.
    embedding_lr_scale: float = option(1.0, "the embedding's learning rate over optim.lr (AdamW's share)", min=0.0)
    head_lr_scale: float = option(1.0, "the output head's learning rate over optim.lr (AdamW's share)", min=0.0)
