"""A second model family in one file, as a package outside liandan would ship it: its config keys
(`[model.toy]`), its model and its spec. Registered by the tests that use it, the way an entry point would:

    plugins.register(Plugin("model_family", "toy", "toy_family:TOY", options="toy_family:ToyOptions"))

No attention, no tensor-parallel plan, no Hugging Face adapter: token embedding, residual MLP blocks in a
container named "stack", a head."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from liandan.config import option
from liandan.model import lm_loss
from liandan.model.spec import ModelSpec, ParamCounts, ParamSplit


@dataclass
class ToyOptions:
    dim: int = option(32, "hidden size", min=8)
    n_layers: int = option(2, "residual MLP blocks", min=1)
    n_heads: int = option(1, "read by the planner's activation formulas", min=1)
    hidden_ratio: int = option(2, "MLP hidden size as a multiple of dim", min=1)


@dataclass
class ToyArgs:
    vocab_size: int = 320
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 1
    hidden: int = 64


class ToyBlock(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.up = nn.Linear(args.dim, args.hidden, bias=False)
        self.down = nn.Linear(args.hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class ToyModel(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.stack = nn.ModuleList([ToyBlock(args) for _ in range(args.n_layers)])
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens, targets=None, doc_ids=None, prefix=None, positions=None):
        h = self.embed(tokens)
        for block in self.stack:
            h = block(h)
        logits = self.head(h)
        return logits if targets is None else lm_loss(logits, targets)


def toy_shapes(a: ToyArgs) -> dict[str, tuple[int, ...]]:
    shapes = {"embed.weight": (a.vocab_size, a.dim)}
    for i in range(a.n_layers):
        shapes[f"stack.{i}.up.weight"] = (a.hidden, a.dim)
        shapes[f"stack.{i}.down.weight"] = (a.dim, a.hidden)
    shapes["head.weight"] = (a.vocab_size, a.dim)
    return shapes


def toy_counts(a: ToyArgs) -> ParamCounts:
    embedding, blocks, head = a.vocab_size * a.dim, a.n_layers * 2 * a.dim * a.hidden, a.vocab_size * a.dim
    return ParamCounts(embedding + blocks + head, embedding, blocks + head, blocks + head)


def toy_split(a: ToyArgs, tp: int) -> ParamSplit:
    assert tp == 1
    return ParamSplit(a.n_layers, 2 * a.dim * a.hidden, 2 * a.vocab_size * a.dim, toy_counts(a).matmul)


def toy_args(section, vocab: int) -> ToyArgs:
    o = section.options
    return ToyArgs(vocab, o.dim, o.n_layers, o.n_heads, o.hidden_ratio * o.dim)


TOY = ModelSpec(
    name="toy",
    args_type=ToyArgs,
    args_from_config=toy_args,
    build=ToyModel,
    state_shapes=toy_shapes,
    count_params=toy_counts,
    flops_per_token=lambda a, seq_len: 6.0 * toy_counts(a).matmul,
    param_split=toy_split,
    shape_fields=("vocab_size", "dim", "n_layers", "hidden"),
    blocks="stack",
    head="head",
)
