"""Activation memory of a training step per device, from the model's shape and the parallel layout alone.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"), per layer, in bytes for 16-bit activations:

    no recomputation                          s·b·h·(34 + 5·a·s/h)
    tensor parallel t                         s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel t              s·b·h/t·(34 + 5·a·s/h)
    selective recomputation                   the same without the 5·a·s/h attention-score term
    full recomputation                        2·s·b·h (the layer input; /t with sequence parallel)

with s the sequence length, b the micro-batch per rank, h the hidden size and a the heads. They are scaled
by (bytes per value) / 2 for fp32 activations. Attention kernels that never store the s x s scores
(FlashAttention, FlexAttention, memory-efficient SDPA) drop the 5·a·s/h term also without recomputation.
The output head, outside the formulas, holds the inputs of the final norm and of the head (2 values per
s·b·h, /t with sequence parallelism) and, for the fp32 loss, 12 bytes per logit (fp32 logits, log-softmax,
and their gradient in the backward pass; 20 with z-loss), measured on the CPU: /t with the vocabulary-parallel
loss (each rank holds its columns only; without it tensor parallelism gathers whole logits on every rank),
/c with the loss computed over c chunks of the tokens (`train.ce_chunks`, one chunk's logits alive at a time;
in bf16 the recomputation adds a second bf16 copy of the head's weight). Under full recomputation one block
is rebuilt at a time in the backward pass, after the head's backward has freed the logits: the larger of the
two counts.

The formulas read the args' `n_layers`, `dim`, `n_heads`, `vocab_size` and `z_loss` (0 when absent), the
shape of any decoder-only transformer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from liandan.config import ConfigError

BYTES = {"bf16": 2, "fp32": 4}
CHECKPOINT_MODES = ("none", "selective", "full")
# flash: no s x s tensor is kept (FlashAttention, FlexAttention, SDPA's fused kernels with a causal mask);
# dense-mask: a fused kernel, but SDPA keeps the (b, 1, s, s) document mask per layer in the compute dtype;
# eager: attention scores and probabilities are materialised (Korthikanti's 5·a·s/h term).
ATTENTION_KINDS = ("flash", "dense-mask", "eager")


def activation_bytes_per_layer(
    seq_len: int,
    micro_batch: int,
    dim: int,
    n_heads: int,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    checkpoint: str = "none",
    bytes_per_value: int = 2,
    attention_scores: bool = True,
) -> tuple[float, str]:
    """(bytes, formula) one transformer layer keeps for its backward pass, by Korthikanti et al. 2022.
    `attention_scores=False` for kernels that never store the s x s scores (drops the 5·a·s/h term)."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ConfigError(f"activation checkpointing '{checkpoint}' is not one of {', '.join(CHECKPOINT_MODES)}")
    s, b, h, a, t = seq_len, micro_batch, dim, n_heads, tp
    sbh = s * b * h
    scale = bytes_per_value / 2
    if checkpoint == "full":
        if sequence_parallel and t > 1:
            return 2 * sbh / t * scale, "2sbh/t"
        return 2 * sbh * scale, "2sbh"
    scores = checkpoint == "none" and attention_scores
    if t == 1:
        return sbh * (34 + (5 * a * s / h if scores else 0)) * scale, "sbh(34 + 5as/h)" if scores else "34sbh"
    if sequence_parallel:
        value = sbh / t * (34 + (5 * a * s / h if scores else 0)) * scale
        return value, "sbh/t(34 + 5as/h)" if scores else "34sbh/t"
    value = sbh * (10 + 24 / t + (5 * a * s / (h * t) if scores else 0)) * scale
    return value, "sbh(10 + 24/t + 5as/(ht))" if scores else "sbh(10 + 24/t)"


@dataclass(frozen=True)
class Activations:
    """Activation bytes one device holds at the start of the backward pass, its peak."""

    per_layer: float  # one block, as stored between its forward and its backward
    layers: float  # all blocks
    recompute: float  # full recomputation: one block's activations rebuilt at a time in backward
    masks: float  # dense attention masks SDPA keeps (document masks)
    head: float  # final norm and head inputs, fp32 logits, log-softmax and the logits' gradient
    formula: str

    @property
    def total(self) -> float:
        """The head's backward pass runs first and frees the logits before the first block is recomputed,
        so under full recomputation the two never coexist."""
        return self.layers + self.masks + max(self.head, self.recompute)


def activation_memory(
    args: Any,
    *,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    checkpoint: str = "none",
    dtype: str = "bf16",
    attention: str = "flash",
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    ce_chunks: int = 1,
) -> Activations:
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention kind '{attention}' is not one of {', '.join(ATTENTION_KINDS)}")
    c = BYTES[dtype]
    s, b, h = seq_len, micro_batch, args.dim
    kw = {"tp": tp, "sequence_parallel": sequence_parallel, "bytes_per_value": c}
    kw["attention_scores"] = attention == "eager"
    per_layer, formula = activation_bytes_per_layer(s, b, h, args.n_heads, checkpoint=checkpoint, **kw)
    recompute = 0.0
    if checkpoint == "full":
        recompute, _ = activation_bytes_per_layer(s, b, h, args.n_heads, checkpoint="none", **kw)
    layers = args.n_layers * per_layer
    # A MoE feed-forward runs whole on every tensor-parallel rank, on whole sequences under sequence
    # parallelism: the MLP share the formula divided by tp (16 of its 19·sbh, all 19 under sequence
    # parallelism) comes back whole.
    moe_layers, extra = _moe_activations(args, s * b * h, c, checkpoint)
    if moe_layers:
        whole_mlp = 0.0
        if tp > 1:
            whole_mlp = (19 if sequence_parallel else 16) * (1 - 1 / tp) * s * b * h * c / 2
        if checkpoint != "full":
            extra += whole_mlp
        layers += moe_layers * extra
        per_layer, formula = per_layer + extra, formula + " + active experts"
        if checkpoint == "full":
            recompute += _moe_activations(args, s * b * h, c, "none")[1] + whole_mlp
    mask_one = b * s * s * c if attention == "dense-mask" else 0
    masks = mask_one * (1 if checkpoint == "full" else args.n_layers)
    sbh = s * b * h / (tp if sequence_parallel else 1)
    logits = s * b * args.vocab_size / (tp if loss_parallel else 1) / ce_chunks
    head = 2 * c * sbh + (20 if getattr(args, "z_loss", 0.0) else 12) * logits
    if ce_chunks > 1 and c == 2:
        # Recomputing a chunk in the backward pass casts the head's weight to bf16 again (measured on an H100).
        head += c * args.vocab_size * args.dim
    return Activations(per_layer, layers, recompute, masks, head, formula)


def _moe_activations(args: Any, sbh: float, c: int, checkpoint: str) -> tuple[int, float]:
    """(MoE blocks, bytes one keeps above a dense block). The paper's 19·sbh of an MLP of hidden size 4h
    scales with the hidden size a token goes through, here its top_k experts' and the shared experts';
    the routed rows are gathered once and weighted once more (2·top_k·sbh). Expert parallelism's buffers and
    imbalance are in `liandan.plan.memory.ExpertParallelMemory`. Nothing under full recomputation, which
    keeps the block's input alone."""
    experts = getattr(args, "moe_experts", 0)
    if not experts or checkpoint == "full":
        return (0, 0.0) if not experts else (_moe_block_count(args), 0.0)
    active_hidden = (args.moe_top_k + args.moe_shared_experts) * args.moe_ffn_dim
    values = sbh * (19 * active_hidden / (4 * args.dim) - 19 + 2 * args.moe_top_k)
    return _moe_block_count(args), values * c / 2


def _moe_block_count(args: Any) -> int:
    return sum(1 for i in range(args.n_layers) if args.is_moe_layer(i))
