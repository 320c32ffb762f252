"""Memory per device, FLOPs and run time of a training run, from the model's shape and the parallel layout
alone: no weights, no devices.

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

Tensor parallelism divides the per-layer matrices, the vocabulary-parallel embedding and the
column-parallel head by tp; norm weights stay replicated. Parameter and FLOP counts and that split come from
the model family's spec (`liandan.model.spec`); the activation formulas below read the args' `n_layers`,
`dim`, `n_heads`, `vocab_size` and `z_loss` (0 when absent), the shape of any decoder-only transformer.

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
in bf16 the recomputation adds a second bf16 copy of the head's weight). Under full recomputation one block is rebuilt at a
time in the backward pass, after the head's backward has freed the logits: the larger of the two counts.

The peak: gradients are set to None after every step, so they are allocated as the backward pass frees
activations. The estimate takes the larger of the start of the backward pass (parameters, optimizer state,
transients, all activations, the head's and one block's gradients) and its end (all gradients instead of
the activations); under gradient accumulation gradients and activations coexist and everything is added.
The numbers, and how far they were off on measured runs, are in docs/planning.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from liandan.config import Config, ConfigError
from liandan.model.spec import ParamCounts, ParamSplit, count_params, flops_per_token, model_args, spec_for
from liandan.model.spec import get as get_model_spec
from liandan.plan.devices import Device
from liandan.plan.fp8 import Fp8Count, plan_fp8
from liandan.run.remote import is_url
from liandan.spec.layout import Layout, resolve_layout, uses_fsdp
from liandan.spec.peaks import mixed_peak_flops

GIB = 2**30
BYTES = {"bf16": 2, "fp32": 4}
CHECKPOINT_MODES = ("none", "selective", "full")
# flash: no s x s tensor is kept (FlashAttention, FlexAttention, SDPA's fused kernels with a causal mask);
# dense-mask: a fused kernel, but SDPA keeps the (b, 1, s, s) document mask per layer in the compute dtype;
# eager: attention scores and probabilities are materialised (Korthikanti's 5·a·s/h term).
ATTENTION_KINDS = ("flash", "dense-mask", "eager")
DEFAULT_HEADROOM = 0.1  # CUDA context, NCCL buffers and allocator fragmentation


# ---------------------------------------------------------------------------------------------------------
# parameters per rank


def param_split(args: Any, tp: int = 1) -> ParamSplit:
    """What one tensor-parallel rank holds, as the model family's tensor-parallel plan splits it (Llama:
    q/k/v/w1/w3 column-parallel and wo/w2 row-parallel, divided by tp; the embedding vocabulary-parallel and
    the head column-parallel, divided by tp; norms replicated)."""
    return spec_for(args).param_split(args, tp)


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


def zero_stages(params: int, dp: int, dtype: str = "bf16") -> tuple[ZeroStage, ...]:
    """The ZeRO paper's table for `params` parameters (per tensor-parallel rank) over `dp` data-parallel
    ranks: bf16 mixed precision is 2 + 2 + 12 bytes per parameter, fp32 is 4 + 4 + 8."""
    p, g, k = (2, 2, 12) if dtype == "bf16" else (4, 4, 8)
    n = float(params)
    return (
        ZeroStage("DDP (stage 0)", "nothing", ModelStates(p * n, g * n, k * n)),
        ZeroStage("ZeRO-1", "optimizer", ModelStates(p * n, g * n, k * n / dp)),
        ZeroStage("ZeRO-2", "optimizer, gradients", ModelStates(p * n, g * n / dp, k * n / dp)),
        ZeroStage("ZeRO-3 / FSDP", "optimizer, gradients, parameters", ModelStates(p * n / dp, g * n / dp, k * n / dp)),
    )


# ---------------------------------------------------------------------------------------------------------
# activations


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
    mask_one = b * s * s * c if attention == "dense-mask" else 0
    masks = mask_one * (1 if checkpoint == "full" else args.n_layers)
    sbh = s * b * h / (tp if sequence_parallel else 1)
    logits = s * b * args.vocab_size / (tp if loss_parallel else 1) / ce_chunks
    head = 2 * c * sbh + (20 if getattr(args, "z_loss", 0.0) else 12) * logits
    if ce_chunks > 1 and c == 2:
        # Recomputing a chunk in the backward pass casts the head's weight to bf16 again (measured on an H100).
        head += c * args.vocab_size * args.dim
    return Activations(per_layer, args.n_layers * per_layer, recompute, masks, head, formula)


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
    states: ModelStates  # fp32 parameters, gradients and Adam m, v
    transient: float  # gathered FSDP parameters and gradients, autocast copies, DDP buckets
    transient_what: str
    activations: Activations
    early_grads: float  # gradients of the head and of one block, allocated while activations are all alive
    accumulation: bool  # gradients of earlier micro-batches are alive through the whole backward pass
    zero: tuple[ZeroStage, ...] = field(default=())

    @property
    def total(self) -> float:
        """The peak. zero_grad sets gradients to None every step, so they appear as the backward pass frees
        activations: the peak is the larger of the start of the backward pass (all activations, the first
        gradients) and its end (all gradients). Under gradient accumulation both are alive at once."""
        base = self.states.params + self.states.optimizer + self.transient
        if self.accumulation:
            return base + self.states.grads + self.activations.total
        return base + max(self.activations.total + self.early_grads, self.states.grads)

    @property
    def sum(self) -> float:
        """Everything added up, as if all were alive at once."""
        return self.states.total + self.transient + self.activations.total

    def fits(self, device_memory_gib: float, headroom: float = DEFAULT_HEADROOM) -> bool:
        return self.total <= usable_bytes(device_memory_gib, headroom)


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
) -> MemoryEstimate:
    """Peak bytes per device of a training step with `micro_batch` sequences of `seq_len` tokens per rank,
    `accumulation_steps` micro-batches per optimizer step.

    `dtype` is the compute dtype ("bf16" or "fp32"; master weights and optimizer state are fp32 either
    way), `attention` one of ATTENTION_KINDS. `fp8_params`: weights of the linears `train.fp8` converts
    (whole model, before tensor parallel); their matmuls cast the weight to fp8 on the fly (one byte a
    weight, and rowwise a second, transposed copy in the backward pass: 2 bytes a weight of one block) and
    save their fp32 or gathered weight for the backward pass, not an autocast bf16 copy."""
    if dtype not in BYTES:
        raise ConfigError(f"dtype '{dtype}' is not one of {', '.join(BYTES)}")
    if micro_batch < 1 or seq_len < 1:
        raise ConfigError(f"micro-batch {micro_batch} and sequence length {seq_len} must be positive")
    split = param_split(args, layout.tp)
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
    states = ModelStates(4 * per_device, 4 * per_device, 8 * per_device)
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
    )
    zero = zero_stages(n, layout.dp_size, dtype)
    return MemoryEstimate(
        layout, micro_batch, seq_len, activation_checkpoint, dtype, attention, sharding,
        n, per_device, states, transient, what, acts, early, accumulation_steps > 1, zero,
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


# ---------------------------------------------------------------------------------------------------------
# the smallest layout that fits


@dataclass(frozen=True)
class LayoutFit:
    nproc: int
    layout: Layout
    activation_checkpoint: str
    micro_batch: int
    estimate: MemoryEstimate


def micro_batch_for(global_batch: int, micro_batch: int, layout: Layout) -> int | None:
    """Sequences per rank per forward pass in `layout`, as the trainer derives them (micro_batch = 0: the
    whole per-rank batch), or None where the global batch does not split into whole micro-batches."""
    if global_batch % layout.dp_size:
        return None
    per_rank = global_batch // layout.dp_size
    b = micro_batch or per_rank
    return b if per_rank % b == 0 else None


def tp_degrees(args: Any, nproc: int, max_tp: int = 8) -> list[int]:
    """Tensor-parallel degrees liandan accepts for this model on `nproc` devices (powers of two): those its
    family's tensor-parallel plan can split it by."""
    spec = spec_for(args)
    out, t = [], 1
    while t <= min(max_tp, nproc):
        if nproc % t == 0 and spec.tp_refusal(args, t) is None:
            out.append(t)
        t *= 2
    return out


def smallest_fitting_layout(
    args: Any,
    *,
    seq_len: int,
    global_batch: int,
    micro_batch: int = 0,
    device_memory_gib: float,
    headroom: float = DEFAULT_HEADROOM,
    dtype: str = "bf16",
    attention: str = "flash",
    checkpoint_modes: tuple[str, ...] = CHECKPOINT_MODES,
    max_tp: int = 8,
    max_nproc: int | None = None,
    **head: Any,
) -> LayoutFit | None:
    """The fewest devices (a power of two) on which a step fits, searching FSDP2 x tensor-parallel splits
    (dp_shard = nproc / tp) and recomputation modes. At equal device count it prefers the least
    recomputation, then the smallest tensor-parallel degree. None when nothing up to `max_nproc` (default:
    as many devices as the global batch allows data-parallel ranks, times max_tp) fits. `head`: the
    sequence_parallel, loss_parallel and ce_chunks settings `memory_per_device` takes."""
    limit = max_nproc or min(2**16, global_batch * max_tp)
    nproc = 1
    while nproc <= limit:
        for mode in checkpoint_modes:
            for tp in tp_degrees(args, nproc, max_tp):
                layout = Layout(1, nproc // tp, tp)
                b = micro_batch_for(global_batch, micro_batch, layout)
                if b is None:
                    continue
                est = memory_per_device(
                    args, layout, micro_batch=b, seq_len=seq_len, activation_checkpoint=mode, dtype=dtype,
                    attention=attention, accumulation_steps=global_batch // layout.dp_size // b, **head,
                )  # fmt: skip
                if est.fits(device_memory_gib, headroom):
                    return LayoutFit(nproc, layout, mode, b, est)
        nproc *= 2
    return None


# ---------------------------------------------------------------------------------------------------------
# FLOPs, time and cost


@dataclass(frozen=True)
class RunFlops:
    tokens: int  # steps x global batch x sequence length
    per_token: float  # PaLM: 6N + 12·L·H·Q·T
    total: float  # per_token x tokens
    six_nd: float  # 6 x parameters used in matmuls x tokens, without the attention term


def run_flops(args: Any, *, seq_len: int, steps: int, global_batch: int) -> RunFlops:
    tokens = steps * global_batch * seq_len
    per_token = flops_per_token(args, seq_len)
    return RunFlops(tokens, per_token, per_token * tokens, 6.0 * count_params(args).matmul * tokens)


@dataclass(frozen=True)
class RunTime:
    flops: float
    nproc: int
    peak_flops_per_device: float
    mfu: float
    seconds: float
    device_hours: float
    cost: float | None  # device hours x price, when a price is given


def run_time_estimate(
    flops: float, nproc: int, peak_flops_per_device: float, mfu: float = 0.4, price_per_device_hour: float | None = None
) -> RunTime:
    """Wall-clock time of `flops` model FLOPs on `nproc` devices at `mfu` of their peak (MFU counts model
    FLOPs, so recomputation is part of what keeps it below 1), and its cost."""
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu = {mfu:g} must be in (0, 1]")
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be at least 1")
    if price_per_device_hour is not None and price_per_device_hour < 0:
        raise ConfigError(f"--price-per-device-hour = {price_per_device_hour:g} must not be negative")
    seconds = flops / (nproc * peak_flops_per_device * mfu)
    hours = seconds / 3600 * nproc
    cost = None if price_per_device_hour is None else hours * price_per_device_hour
    return RunTime(flops, nproc, peak_flops_per_device, mfu, seconds, hours, cost)


# ---------------------------------------------------------------------------------------------------------
# a run config's plan


def plan_model_args(cfg: Config) -> Any:
    """The model a config trains, in its family's args. With model.vocab_size = 0 the size comes from the
    tokenizer the config names, rounded up to a multiple of 64 as the trainer does."""
    m = cfg.model
    get_model_spec(m.family)  # an unknown family is the first thing to report
    tokenizer_vocab = 0
    if not m.vocab_size:
        spec = cfg.data.tokenizer
        if cfg.data.stores and is_url(cfg.data.stores[0]):  # its manifest says, without fetching the store
            tokenizer_vocab = _store_url_vocab(cfg.data.stores[0])
        elif cfg.data.stores:  # a pipeline's store carries its tokenizer beside its manifest
            tokenizer_vocab = _tokenizer_file_vocab(str(Path(cfg.data.stores[0]) / "tokenizer.json"))
        elif spec == "byte":
            tokenizer_vocab = 257
        elif spec == "bpe":
            tokenizer_vocab = cfg.data.bpe_vocab_size
        else:
            tokenizer_vocab = _tokenizer_file_vocab(spec)
    return model_args(m, tokenizer_vocab)


def _store_url_vocab(url: str) -> int:
    from liandan.data.tokens.cache import store_manifest

    return int(store_manifest(url)["vocab_size"])


def _tokenizer_file_vocab(path: str) -> int:
    if not Path(path).is_file():
        raise ConfigError(f"tokenizer file not found: {path} (or set model.vocab_size to plan without it)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(path).get_vocab_size()
    except Exception as err:  # noqa: BLE001 - tokenizers raises a bare Exception for unreadable files
        raise ConfigError(f"cannot read tokenizer {path}: {err}") from None


def plan_dtype(cfg: Config) -> str:
    """The compute dtype on a GPU: auto means bf16."""
    return "fp32" if cfg.train.dtype == "fp32" else "bf16"


def plan_attention(cfg: Config) -> str:
    """What the attention kernel keeps on a GPU: FlexAttention (auto, flex) and SDPA with a causal mask keep
    no s x s tensor; SDPA with document masks keeps the dense mask; eager keeps the scores."""
    kind = cfg.model.attention
    if kind == "eager":
        return "eager"
    if kind == "sdpa" and cfg.train.mask == "document":
        return "dense-mask"
    return "flash"


def default_nproc(cfg: Config) -> int:
    """The fewest processes the config's [parallel] section admits: the product of its fixed sizes."""
    p = cfg.parallel
    return p.dp_replicate * p.tp * (p.dp_shard if p.dp_shard > 0 else 1)


@dataclass(frozen=True)
class ActivationVariant:
    """One row of Korthikanti et al.'s table for this run's s, b, h, a and t."""

    checkpoint: str
    parallel: str  # none, tp=t, or tp=t + sp (sequence parallel)
    formula: str
    paper_bytes: float  # per layer, attention scores stored as the paper assumes
    kernel_bytes: float  # per layer, with this run's attention kernel
    used: bool  # the variant this run trains with


@dataclass(frozen=True)
class Plan:
    model: Any
    params: ParamCounts
    flops: RunFlops
    nproc: int
    device: Device
    headroom: float
    memory: MemoryEstimate
    fits: bool
    smallest: LayoutFit | None
    time: RunTime
    variants: tuple[ActivationVariant, ...]
    init: InitMemory | None = None  # building and initialising the model, before the first step
    fp8: Fp8Count | None = None


def plan_config(
    cfg: Config,
    device: Device,
    *,
    nproc: int | None = None,
    mfu: float = 0.4,
    price_per_device_hour: float | None = None,
    headroom: float = DEFAULT_HEADROOM,
) -> Plan:
    """Everything `liandan plan` prints, for a config on `nproc` devices (default: the fewest it admits)."""
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom = {headroom:g} must be in [0, 1)")
    nproc = default_nproc(cfg) if nproc is None else nproc
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be at least 1")
    try:
        layout = resolve_layout(cfg.parallel, nproc)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    t = cfg.train
    b = micro_batch_for(t.global_batch, t.micro_batch, layout)
    if b is None:
        raise ConfigError(
            f"train.global_batch = {t.global_batch} must split into {layout.dp_size} data-parallel ranks"
            f" of whole micro-batches of train.micro_batch = {t.micro_batch}"
        )
    args = plan_model_args(cfg)
    refusal = get_model_spec(cfg.model.family).tp_refusal(args, layout.tp)
    if refusal:
        raise ConfigError(refusal)
    dtype, attention = plan_dtype(cfg), plan_attention(cfg)
    p = cfg.parallel
    fp8 = plan_fp8(cfg, args)
    head = {"sequence_parallel": p.sequence_parallel, "loss_parallel": p.loss_parallel, "ce_chunks": t.ce_chunks,
            "fp8_params": fp8.params}  # fmt: skip
    memory = memory_per_device(
        args, layout, micro_batch=b, seq_len=t.seq_len, activation_checkpoint=t.activation_checkpoint,
        dtype=dtype, attention=attention, accumulation_steps=t.global_batch // layout.dp_size // b, **head,
    )  # fmt: skip
    smallest = smallest_fitting_layout(
        args, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=t.micro_batch,
        device_memory_gib=device.memory_gib, headroom=headroom, dtype=dtype, attention=attention,
        max_tp=1 if fp8.params else 8, **head,  # fp8 runs without tensor parallel
    )  # fmt: skip
    flops = run_flops(args, seq_len=t.seq_len, steps=t.steps, global_batch=t.global_batch)
    share = min(1.0, 6.0 * fp8.params / flops.per_token)
    peak = mixed_peak_flops(device.peak_flops(dtype), device.peak_flops_fp8(dtype), share)
    time = run_time_estimate(flops.total, nproc, peak, mfu, price_per_device_hour)
    variants = []
    for mode in CHECKPOINT_MODES:
        for sp in (False, True):
            if sp and layout.tp == 1:
                continue
            kw = {"tp": layout.tp, "sequence_parallel": sp, "checkpoint": mode, "bytes_per_value": BYTES[dtype]}
            paper, formula = activation_bytes_per_layer(t.seq_len, b, args.dim, args.n_heads, **kw)
            kernel, _ = activation_bytes_per_layer(
                t.seq_len, b, args.dim, args.n_heads, attention_scores=attention == "eager", **kw
            )
            parallel = "none" if layout.tp == 1 else f"tp={layout.tp}" + (" + sp" if sp else "")
            used = mode == t.activation_checkpoint and sp == p.sequence_parallel
            variants.append(ActivationVariant(mode, parallel, formula, paper, kernel, used))
    init = init_memory(args, layout, t.meta_init)
    fits = memory.fits(device.memory_gib, headroom) and init.device <= usable_bytes(device.memory_gib, headroom)
    return Plan(
        args, count_params(args), flops, nproc, device, headroom, memory, fits, smallest, time, tuple(variants), init,
        fp8,
    )  # fmt: skip
