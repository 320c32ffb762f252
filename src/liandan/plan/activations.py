"""Activation memory of a training step per device, from the model's shape and the parallel layout alone.

Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models") count, per layer, in
bytes for 16-bit activations, for GPT-3's block (LayerNorm, a 4h GeLU MLP, dropout):

    no recomputation                          s·b·h·(34 + 5·a·s/h)
    tensor parallel t                         s·b·h·(10 + 24/t + 5·a·s/(h·t))
    tensor + sequence parallel t              s·b·h/t·(34 + 5·a·s/h)
    selective recomputation                   the same without the 5·a·s/h attention-score term
    full recomputation                        2·s·b·h (the layer input; /t with sequence parallel)

with s the sequence length, b the micro-batch per rank, h the hidden size and a the heads
(`activation_bytes_per_layer`, shown beside the planner's own count). A Llama block keeps more than 34·sbh: its
RMSNorms compute in fp32, its SwiGLU MLP keeps four hidden values per unit where GeLU keeps two, and there is
no dropout. The planner counts what autograd saves in liandan's block (`block_bytes`), per token, checked
tensor by tensor with `torch.autograd.graph.saved_tensors_hooks` (tests/test_plan_memory.py), c the bytes of
a compute-dtype value:

    each RMSNorm                 its input and its normalised value, in fp32: 8·h
    the projections' inputs      the two normed values, 2·h·c (under autocast, which casts each
                                 projection's input apart, one copy each for the queries, keys, values,
                                 gate and up projections, a MoE block's router and shared experts)
    attention                    queries, keys and values after the rotation (grouped-query keys and
                                 values expanded to every head, as SDPA takes them) and the attention
                                 output, 4·h_q·c, and the log-sum-exp, 4·a (fp32); the scores and the
                                 probabilities, 2·a·s·c, only for eager attention
    the MLP                      4 values per hidden unit f for SwiGLU (the gate's and up projection's
                                 outputs, the gate's activation, their product), 2 for ReLU^2
    a MoE MLP                    4 per active hidden unit (top-k and shared experts), the routed rows
                                 gathered, computed and weighted (3·k·h; the last two in fp32 under
                                 autocast), the router's scores, indices and weights (4·E + 32·k bytes)

Tensor parallelism splits the heads and the MLP's hidden units (/t); sequence parallelism also splits the
norms, whose outputs are gathered whole for the projections. A MoE MLP runs whole on every tensor-parallel
rank. Full recomputation keeps each block's input (h·c; /t with sequence parallelism), selective
recomputation is counted as none (liandan's policy keeps every matmul's output, FlashAttention keeps no
scores: an upper bound).

The output head holds the inputs of the final norm and of the head (2 values per s·b·h, /t with sequence
parallelism) and, for the fp32 loss, 12 bytes per logit (fp32 logits, log-softmax, and their gradient in the
backward pass; 20 with z-loss), measured on the CPU: /t with the vocabulary-parallel loss (each rank holds
its columns only; without it tensor parallelism gathers whole logits on every rank), /c with the loss
computed over c chunks of the tokens (`train.ce_chunks`, one chunk's logits alive at a time; in bf16 the
recomputation adds a second bf16 copy of the head's weight). A block's backward pass holds, besides what the
block saved, the gradients of its MLP's hidden values: of the down projection's input, the up projection's
output, the gate's activation and the gate's output, 4 per hidden unit (measured on the CPU with
torch.profiler's memory timeline: the autograd detail at the peak of a fully recomputed step). Under full
recomputation that block is also rebuilt, one at a time. The head's backward pass frees the logits before
the first block's backward begins: the larger of the two counts.

The count reads the args' `n_layers`, `dim`, `n_heads`, `vocab_size`, and where present `head_dim`, `ffn_dim`, `mlp`, `z_loss` and the MoE fields (a 4h SwiGLU where absent).
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
    block_backward: float  # one block's backward: its gradient working set, and its rebuilt activations
    masks: float  # dense attention masks SDPA keeps (document masks)
    head: float  # final norm and head inputs, fp32 logits, log-softmax and the logits' gradient
    formula: str

    @property
    def total(self) -> float:
        """The head's backward pass runs first and frees the logits before the first block's backward, so the
        two never coexist."""
        return self.layers + self.masks + max(self.head, self.block_backward)


def block_bytes(
    args: Any,
    *,
    micro_batch: int,
    seq_len: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    bytes_per_value: int = 2,
    attention_scores: bool = False,
    autocast: bool = False,
    moe: bool = False,
) -> float:
    """Bytes one decoder block saves for its backward pass without recomputation (module docstring); `moe`
    for a block whose MLP is routed experts."""
    c, s, h, t = bytes_per_value, seq_len, args.dim, tp
    head_dim = getattr(args, "head_dim", 0) or h // args.n_heads
    h_q = args.n_heads * head_dim
    gated = getattr(args, "mlp", "swiglu") != "relu2"
    norms = 2 * 8 * h / (t if sequence_parallel else 1)
    # autocast casts each projection's input apart: queries, keys and values; the MLP's gate and up projections
    # (a MoE block's router and its shared experts' projections)
    mlp_inputs = 2 if gated else 1
    if moe:
        mlp_inputs = 1 + (mlp_inputs if args.moe_shared_experts else 0)
    inputs = (3 + mlp_inputs if autocast else 2) * h * c
    attention = (4 * h_q * c + 4 * args.n_heads) / t
    if attention_scores:
        attention += 2 * args.n_heads * s * c / t
    if moe:
        k, experts = args.moe_top_k, args.moe_experts
        # the routed rows gathered (c), the experts' outputs and their weighted sum (fp32 under autocast); the
        # router's fp32 scores and its int64 indices and fp32 weights per routed row
        routed = k * h * c + 2 * k * h * (4 if autocast else c)
        mlp = 4 * _moe_active_hidden(args) * c + routed + 4 * experts + 32 * k + 4
    else:
        ffn = getattr(args, "ffn_dim", 0) or 4 * h
        mlp = (4 if gated else 2) * ffn * c / t
    return s * micro_batch * (norms + inputs + attention + mlp)


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
    autocast: bool = False,
) -> Activations:
    """What one device's blocks and head keep (module docstring); `autocast` where bf16 comes from
    torch.autocast rather than bf16 parameters."""
    if attention not in ATTENTION_KINDS:
        raise ConfigError(f"attention kind '{attention}' is not one of {', '.join(ATTENTION_KINDS)}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ConfigError(f"activation checkpointing '{checkpoint}' is not one of {', '.join(CHECKPOINT_MODES)}")
    c = BYTES[dtype]
    s, b, h = seq_len, micro_batch, args.dim
    kw = {"micro_batch": b, "seq_len": s, "tp": tp, "sequence_parallel": sequence_parallel, "bytes_per_value": c,
          "attention_scores": attention == "eager", "autocast": autocast}  # fmt: skip
    moe_layers = _moe_block_count(args)
    dense = block_bytes(args, **kw)
    routed = block_bytes(args, moe=True, **kw) if moe_layers else 0.0
    formula = "Llama block" + (" + active experts" if moe_layers else "")
    if checkpoint == "full":
        per_layer = s * b * h * c / (tp if sequence_parallel else 1)
        layers, recompute, formula = args.n_layers * per_layer, max(dense, routed), "block input"
    else:
        layers = (args.n_layers - moe_layers) * dense + moe_layers * routed
        per_layer, recompute = layers / args.n_layers, 0.0
    hidden = max(getattr(args, "ffn_dim", 0) or 4 * h, _moe_active_hidden(args))
    working = 4 * s * b * hidden * c / tp  # the MLP's hidden gradients, column-split under tensor parallelism
    mask_one = b * s * s * c if attention == "dense-mask" else 0
    masks = mask_one * (1 if checkpoint == "full" else args.n_layers)
    sbh = s * b * h / (tp if sequence_parallel else 1)
    logits = s * b * args.vocab_size / (tp if loss_parallel else 1) / ce_chunks
    head = 2 * c * sbh + (20 if getattr(args, "z_loss", 0.0) else 12) * logits
    if ce_chunks > 1 and c == 2:
        # Recomputing a chunk in the backward pass casts the head's weight to bf16 again (measured on an H100).
        head += c * args.vocab_size * args.dim
    return Activations(per_layer, layers, recompute, recompute + working, masks, head, formula)


def _moe_active_hidden(args: Any) -> int:
    """The MLP hidden units a token goes through in a MoE block: its top_k experts' and the shared experts'."""
    if not getattr(args, "moe_experts", 0):
        return 0
    return (args.moe_top_k + args.moe_shared_experts) * args.moe_ffn_dim


def _moe_block_count(args: Any) -> int:
    if not getattr(args, "moe_experts", 0):
        return 0
    return sum(1 for i in range(args.n_layers) if args.is_moe_layer(i))
