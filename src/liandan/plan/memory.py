"""Memory per device of a training run, from the model's shape and the parallel layout alone: no weights, no
devices.

Two accountings of the model states (parameters, gradients, optimizer) are kept side by side:

- **ZeRO paper** (Rajbhandari et al. 2020), mixed-precision Adam at 16 bytes per parameter: 2 (bf16
  parameters) + 2 (bf16 gradients) + 12 (fp32 master copy, Adam m and v). Stage 0 (DDP) replicates all 16;
  ZeRO-1 shards the 12 over the data-parallel ranks, ZeRO-2 the 12 + 2, ZeRO-3 (FSDP) all 16. In fp32 there
  is no master copy: 4 + 4 + 8.
- **liandan**, what the trainer actually allocates: parameters, gradients and Adam m, v are fp32 in every
  layout (16 bytes per parameter). FSDP2 shards all 16 and gathers one block's parameters at a time in the
  compute dtype (plus the next, prefetched, and the root module: embedding, final norm, head); DDP adds a
  flat fp32 copy of the gradients for its all-reduce buckets; single-process and DDP bf16 runs keep
  autocast's bf16 copies of the matmul weights from the forward to the backward pass.

Adam's 8 bytes of state per parameter (m and v in fp32) are the default of `optimizer_state_bytes_per_param`;
an optimizer that keeps more or less state gives its own figure, and both accountings follow it.

Tensor parallelism divides the per-layer matrices, the vocabulary-parallel embedding and the
column-parallel head by tp; norm weights and MoE feed-forwards stay replicated. Expert parallelism's
buffers and imbalance headroom are `ExpertParallelMemory`. Parameter counts and that split come from the model
family's spec (`liandan.model.spec`); activations are counted in `liandan.plan.activations`.

The peak: gradients are set to None after every step, so they are allocated as the backward pass frees
activations. The estimate takes the larger of the start of the backward pass (parameters, optimizer state,
transients, all activations, the head's and one block's gradients) and its end (all gradients instead of
the activations); under gradient accumulation gradients and activations coexist and everything is added.
The numbers, and how far they were off on measured runs, are in docs/planning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from liandan.common.layout import Layout, uses_fsdp
from liandan.config import Config, ConfigError
from liandan.model.spec import ParamSplit, count_params, spec_for
from liandan.plan.activations import BYTES, Activations, activation_memory

GIB = 2**30
DEFAULT_HEADROOM = 0.1  # CUDA context, NCCL buffers and allocator fragmentation
# Under expert parallelism the busiest rank receives this many times the mean number of (token, expert) rows:
# routing is balanced over a step, not in every micro-batch (an assumption, not a measurement).
DEFAULT_EP_IMBALANCE = 1.25
ADAMW_STATE_BYTES_PER_PARAM = 8.0  # m and v, fp32


def optimizer_state_bytes(cfg: Config) -> float:
    """Bytes of state per parameter that the config's optimizer keeps, as its plug-in declares (AdamW: m and
    v in fp32)."""
    from liandan.train.optimizers import optimizer_plugin

    return optimizer_plugin(cfg.optim.name).state_bytes_per_param


# ---------------------------------------------------------------------------------------------------------
# parameters per rank


def param_split(args: Any, tp: int = 1, ep: int = 1) -> ParamSplit:
    """What one tensor-parallel rank holds, as the model family's tensor-parallel plan splits it (Llama:
    q/k/v/w1/w3 column-parallel and wo/w2 row-parallel, divided by tp; the embedding vocabulary-parallel and
    the head column-parallel, divided by tp; norms replicated; MoE feed-forwards whole). Under expert
    parallelism its largest block holds a rank's own experts only."""
    spec = spec_for(args)
    return spec.param_split(args, tp, ep) if ep > 1 else spec.param_split(args, tp)


# ---------------------------------------------------------------------------------------------------------
# model states


@dataclass(frozen=True)
class ModelStates:
    """Bytes of parameters, gradients and optimizer state one device keeps for the whole run."""

    params: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


@dataclass(frozen=True)
class ZeroStage:
    name: str
    sharded: str  # what the stage shards over the data-parallel ranks
    states: ModelStates


def zero_bytes_per_param(
    dtype: str = "bf16", optimizer_state_bytes_per_param: float = ADAMW_STATE_BYTES_PER_PARAM
) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer) bytes per parameter in the ZeRO paper's accounting: in bf16 mixed
    precision the optimizer's share holds the fp32 master copy besides the optimizer's own state."""
    if dtype == "bf16":
        return 2, 2, 4 + optimizer_state_bytes_per_param
    return 4, 4, optimizer_state_bytes_per_param


def zero_stages(
    params: int, dp: int, dtype: str = "bf16", optimizer_state_bytes_per_param: float = ADAMW_STATE_BYTES_PER_PARAM
) -> tuple[ZeroStage, ...]:
    """The ZeRO paper's table for `params` parameters (per tensor-parallel rank) over `dp` data-parallel
    ranks: with Adam, bf16 mixed precision is 2 + 2 + 12 bytes per parameter, fp32 is 4 + 4 + 8."""
    p, g, k = zero_bytes_per_param(dtype, optimizer_state_bytes_per_param)
    n = float(params)
    return (
        ZeroStage("DDP (stage 0)", "nothing", ModelStates(p * n, g * n, k * n)),
        ZeroStage("ZeRO-1", "optimizer", ModelStates(p * n, g * n, k * n / dp)),
        ZeroStage("ZeRO-2", "optimizer, gradients", ModelStates(p * n, g * n / dp, k * n / dp)),
        ZeroStage("ZeRO-3 / FSDP", "optimizer, gradients, parameters", ModelStates(p * n / dp, g * n / dp, k * n / dp)),
    )


# ---------------------------------------------------------------------------------------------------------
# memory per device


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one device needs for a training step in `layout`, by liandan's accounting, with the ZeRO
    paper's table at the same data-parallel degree alongside."""

    layout: Layout
    micro_batch: int
    seq_len: int
    activation_checkpoint: str
    dtype: str
    attention: str
    sharding: str  # how liandan holds the model states: single, ddp or fsdp
    params_per_rank: int  # after tensor parallel, before data-parallel sharding
    params_per_device: float  # what this device keeps for the whole run
    states: ModelStates  # fp32 parameters and gradients, the optimizer's state
    transient: float  # gathered FSDP parameters and gradients, autocast copies, DDP buckets
    transient_what: str
    activations: Activations
    early_grads: float  # gradients of the head and of one block, allocated while activations are all alive
    accumulation: bool  # gradients of earlier micro-batches are alive through the whole backward pass
    zero: tuple[ZeroStage, ...] = field(default=())
    optimizer_state_bytes_per_param: float = ADAMW_STATE_BYTES_PER_PARAM
    expert_parallel: ExpertParallelMemory | None = None  # under parallel.ep > 1

    @property
    def total(self) -> float:
        """The peak. zero_grad sets gradients to None every step, so they appear as the backward pass frees
        activations: the peak is the larger of the start of the backward pass (all activations, the first
        gradients) and its end (all gradients). Under gradient accumulation both are alive at once."""
        base = self.states.params + self.states.optimizer + self.transient
        if self.expert_parallel is not None:
            base += self.expert_parallel.total
        if self.accumulation:
            return base + self.states.grads + self.activations.total
        return base + max(self.activations.total + self.early_grads, self.states.grads)

    @property
    def sum(self) -> float:
        """Everything added up, as if all were alive at once."""
        extra = self.expert_parallel.total if self.expert_parallel is not None else 0.0
        return self.states.total + self.transient + self.activations.total + extra

    def fits(self, device_memory_gib: float, headroom: float = DEFAULT_HEADROOM) -> bool:
        return self.total <= usable_bytes(device_memory_gib, headroom)


@dataclass(frozen=True)
class ExpertParallelMemory:
    """What expert parallelism adds on one device: the all-to-all buffers of one MoE layer's dispatch (the
    rows it sends, tokens x top_k x dim, and the rows the busiest rank receives, `imbalance` times as many),
    and the headroom of the busiest rank's expert activations over the mean (imbalance - 1 times the routed
    experts' activations of every MoE layer). The routed experts' weights, gradients and optimizer state are
    divided over ep x dp_shard / ep = dp_shard as FSDP2 divides them without expert parallelism; what ep
    changes there is the block FSDP2 gathers (a rank's experts / ep), in `MemoryEstimate.transient`."""

    imbalance: float
    buffers: float
    imbalance_headroom: float
    all_to_all_bytes_per_step: float  # sent by one rank per optimizer step, forward and backward

    @property
    def total(self) -> float:
        return self.buffers + self.imbalance_headroom


def expert_parallel_memory(
    args: Any, layout: Layout, *, micro_batch: int, seq_len: int, dtype: str, checkpoint: str,
    accumulation_steps: int, imbalance: float = DEFAULT_EP_IMBALANCE,
) -> ExpertParallelMemory:  # fmt: skip
    """`ExpertParallelMemory` of a step with `micro_batch` sequences of `seq_len` tokens per rank; a MoE
    feed-forward sees whole sequences on every tensor-parallel rank."""
    if not (math.isfinite(imbalance) and imbalance >= 1):
        raise ConfigError(f"expert-parallel imbalance {imbalance:g} must be a finite number >= 1")
    c = BYTES[dtype]
    rows = micro_batch * seq_len * args.moe_top_k
    buffers = (1 + imbalance) * rows * args.dim * c
    moe_layers = sum(1 for i in range(args.n_layers) if args.is_moe_layer(i))
    # The routed part of `activations._moe_activations`: the experts' 19/4 values per hidden unit and row,
    # the gathered and weighted rows; kept unless full recomputation keeps the block's input alone.
    routed = 0.0 if checkpoint == "full" else rows * (19 * args.moe_ffn_dim / 4 + 2 * args.dim) * c / 2
    headroom = (imbalance - 1) * routed * moe_layers
    # Dispatch and combine in the forward pass, their reverses in the backward: 4 all-to-alls of the rows per
    # MoE layer and micro-batch, of which the share for the other ep - 1 ranks leaves the device.
    sent = 4 * rows * args.dim * c * moe_layers * accumulation_steps * (layout.ep - 1) / layout.ep
    return ExpertParallelMemory(imbalance, buffers, headroom, sent)


def usable_bytes(device_memory_gib: float, headroom: float = DEFAULT_HEADROOM) -> float:
    return device_memory_gib * GIB * (1 - headroom)


def memory_per_device(
    args: Any,
    layout: Layout,
    *,
    micro_batch: int,
    seq_len: int,
    activation_checkpoint: str = "none",
    dtype: str = "bf16",
    attention: str = "flash",
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    ce_chunks: int = 1,
    accumulation_steps: int = 1,
    fp8_params: int = 0,
    optimizer_state_bytes_per_param: float = ADAMW_STATE_BYTES_PER_PARAM,
    ep_imbalance: float = DEFAULT_EP_IMBALANCE,
) -> MemoryEstimate:
    """Peak bytes per device of a training step with `micro_batch` sequences of `seq_len` tokens per rank,
    `accumulation_steps` micro-batches per optimizer step.

    `dtype` is the compute dtype ("bf16" or "fp32"; master weights and optimizer state are fp32 either
    way), `attention` one of ATTENTION_KINDS. `fp8_params`: weights of the linears `train.fp8` converts
    (whole model, before tensor parallel); their matmuls cast the weight to fp8 on the fly (one byte a
    weight, and rowwise a second, transposed copy in the backward pass: 2 bytes a weight of one block) and
    save their fp32 or gathered weight for the backward pass, not an autocast bf16 copy.
    `optimizer_state_bytes_per_param`: what the optimizer keeps per parameter it updates (Adam: 8).
    `ep_imbalance`: under expert parallelism, the busiest rank's received rows over the mean."""
    if dtype not in BYTES:
        raise ConfigError(f"dtype '{dtype}' is not one of {', '.join(BYTES)}")
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError(f"micro-batch {micro_batch} and sequence length {seq_len} must be positive")
    if not (math.isfinite(optimizer_state_bytes_per_param) and optimizer_state_bytes_per_param >= 0):
        raise ConfigError(
            f"optimizer state of {optimizer_state_bytes_per_param:g} bytes per parameter must be a finite number >= 0"
        )
    split = param_split(args, layout.tp, layout.ep)
    n = split.total
    c = BYTES[dtype]
    if uses_fsdp(layout):
        sharding = "fsdp"
        shard = layout.dp_shard
        per_device = n / shard
        early = 4 * (split.root + split.block) / shard
        # Gathered in the compute dtype: the root for the whole step, the current and the prefetched block.
        # Gradients of the root and of one block exist unsharded in the compute dtype and, reduced in fp32,
        # as an fp32 copy.
        grad_bytes = c + 4 if c != 4 else 4
        transient = c * (split.root + 2 * split.block) + grad_bytes * (split.root + split.block)
        what = f"gathered {_dtype_word(c)} root + 2 blocks, unsharded root + block gradients"
    else:
        sharding = "ddp" if layout.dp_replicate > 1 else "single"
        per_device = float(n)
        early = 4.0 * (split.root + split.block)
        transient, parts = 0.0, []
        if sharding == "ddp":
            transient += 4 * n  # DDP's flat fp32 gradient buckets (gradient_as_bucket_view is off)
            parts.append("DDP gradient buckets")
        if c == 2:
            # autocast's bf16 weight copies, saved for the backward pass; fp8 linears make none
            transient += 2 * max(0, split.matmul - fp8_params / layout.tp)
            parts.append("autocast bf16 weight copies")
        what = ", ".join(parts) or "none"
    if fp8_params:
        transient += 2 * fp8_params / (layout.tp * args.n_layers)  # one block's fp8 weight casts at a time
        what += ", fp8 weight casts of one block"
    states = ModelStates(4 * per_device, 4 * per_device, optimizer_state_bytes_per_param * per_device)
    acts = activation_memory(
        args,
        micro_batch=micro_batch,
        seq_len=seq_len,
        tp=layout.tp,
        checkpoint=activation_checkpoint,
        dtype=dtype,
        attention=attention,
        sequence_parallel=sequence_parallel,
        loss_parallel=loss_parallel,
        ce_chunks=ce_chunks,
        autocast=c == 2 and sharding != "fsdp",
    )
    zero = zero_stages(n, layout.dp_size, dtype, optimizer_state_bytes_per_param)
    ep = None
    if layout.ep > 1:
        ep = expert_parallel_memory(
            args, layout, micro_batch=micro_batch, seq_len=seq_len, dtype=dtype, checkpoint=activation_checkpoint,
            accumulation_steps=accumulation_steps, imbalance=ep_imbalance,
        )  # fmt: skip
        what += f", a rank's experts (/ep={layout.ep}) in the gathered blocks"
    return MemoryEstimate(
        layout, micro_batch, seq_len, activation_checkpoint, dtype, attention, sharding,
        n, per_device, states, transient, what, acts, early, accumulation_steps > 1, zero,
        optimizer_state_bytes_per_param, ep,
    )  # fmt: skip


def _dtype_word(c: int) -> str:
    return "bf16" if c == 2 else "fp32"


# ---------------------------------------------------------------------------------------------------------
# initialisation


@dataclass(frozen=True)
class InitMemory:
    """Bytes one rank holds while the model is built and initialised, before the first step: the whole
    model in fp32 on every rank when it is built whole (on the device too, where it is moved there before
    sharding), or under meta-device initialisation the rank's fp32 shards plus one whole parameter, the
    largest, drawn on the host at a time (`liandan.train.meta_init`)."""

    meta: bool
    host: float
    device: float
    what: str

    @property
    def peak(self) -> float:
        """The larger of the two: on the CPU they are one memory, on a GPU the device's is the one that binds."""
        return max(self.host, self.device)


def init_memory(args: Any, layout: Layout, meta: bool) -> InitMemory:
    whole = 4.0 * count_params(args).total
    if not meta:
        return InitMemory(False, whole, whole, "the whole model in fp32")
    split = param_split(args, layout.tp)
    shards = 4.0 * split.total / (layout.dp_shard if uses_fsdp(layout) else 1)
    largest = 4.0 * max(math.prod(s) for s in spec_for(args).state_shapes(args).values())
    return InitMemory(True, shards + largest, shards, "the rank's fp32 shards + the largest whole parameter")
