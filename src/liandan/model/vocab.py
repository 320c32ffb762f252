"""Growing a model's vocabulary for an extended tokenizer (`liandan.data.tokens.extend`): the embedding and the
output head get rows for the new ids, each the mean of the rows of the old tokens its text was cut into, so a
warm-started model begins from what it knew of those bytes instead of from noise. Old rows are kept as they
are; rows past the last new id (the padding to a multiple of 64) take the mean of every old row."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn


def grow_vocabulary(model: nn.Module, vocab_size: int, sources: Mapping[int, Sequence[int]]) -> None:
    """Grow `model`'s `tok_embeddings` and (untied) `output` to `vocab_size` rows in place; `sources` maps each
    new id to the old ids whose rows it starts from. `model.args.vocab_size` follows."""
    embedding = model.tok_embeddings
    old = embedding.num_embeddings
    if vocab_size < old:
        raise ValueError(f"the vocabulary can grow, not shrink: {vocab_size} rows asked for, {old} held")
    for new_id, ids in sources.items():
        if not 0 <= new_id < vocab_size:
            raise ValueError(f"new id {new_id} is outside the grown vocabulary of {vocab_size}")
        if not ids or any(not 0 <= i < old for i in ids):
            raise ValueError(f"new id {new_id} starts from ids {list(ids)}, not all among the {old} old rows")
    tied = model.output is not None and model.output.weight is embedding.weight
    with torch.no_grad():
        weight = _grown(embedding.weight, vocab_size, sources)
        model.tok_embeddings = nn.Embedding(vocab_size, weight.shape[1], _weight=weight, device=weight.device,
                                            dtype=weight.dtype)  # fmt: skip
        if tied:
            model.output.weight = model.tok_embeddings.weight
        elif model.output is not None:
            head = nn.Linear(weight.shape[1], vocab_size, bias=False, device=weight.device, dtype=weight.dtype)
            head.weight.copy_(_grown(model.output.weight, vocab_size, sources))
            model.output = head
    model.args.vocab_size = vocab_size


def _grown(rows: torch.Tensor, vocab_size: int, sources: Mapping[int, Sequence[int]]) -> torch.Tensor:
    old = rows.shape[0]
    grown = rows.new_empty(vocab_size, rows.shape[1])
    grown[:old] = rows
    grown[old:] = rows.mean(dim=0)
    for new_id, ids in sources.items():
        grown[new_id] = rows[list(ids)].mean(dim=0)
    return grown
