"""A run config's plan, everything `liandan plan` prints: the model, its FLOPs, memory per device in the
config's layout (`liandan.plan.memory`), the smallest layout that fits (`liandan.plan.layout_search`), and
the run's time and cost at an assumed MFU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.common.layout import Layout, resolve_layout
from liandan.common.peaks import mixed_peak_flops
from liandan.config import Config, ConfigError
from liandan.model.spec import ParamCounts, count_params, flops_per_token, model_args
from liandan.model.spec import get as get_model_spec
from liandan.plan.activations import BYTES, CHECKPOINT_MODES, activation_bytes_per_layer, activation_memory
from liandan.plan.devices import Device
from liandan.plan.fp8 import Fp8Count, plan_fp8
from liandan.plan.layout_rank import Ranked, rank_layouts
from liandan.plan.layout_search import LayoutFit, micro_batch_for, smallest_fitting_layout
from liandan.plan.layouts import Candidate, Evaluated, Workload, evaluate, network_for
from liandan.plan.memory import (
    DEFAULT_EP_IMBALANCE,
    DEFAULT_HEADROOM,
    InitMemory,
    MemoryEstimate,
    init_memory,
    memory_per_device,
    optimizer_state_bytes,
    usable_bytes,
)
from liandan.plan.optimizer_cost import OptimizerCost, optimizer_cost
from liandan.run.remote import is_url

# ---------------------------------------------------------------------------------------------------------
# FLOPs, time and cost


@dataclass(frozen=True)
class RunFlops:
    tokens: int  # steps x global batch x sequence length
    per_token: float  # PaLM: 6N + 12·L·H·Q·T
    total: float  # per_token x tokens
    six_nd: float  # 6 x parameters used in matmuls x tokens, without the attention term (of a MoE: the active)


def run_flops(args: Any, *, seq_len: int, steps: int, global_batch: int) -> RunFlops:
    tokens = steps * global_batch * seq_len
    per_token = flops_per_token(args, seq_len)
    return RunFlops(tokens, per_token, per_token * tokens, 6.0 * count_params(args).active_matmul * tokens)


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
# what the config says


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
    kind = getattr(cfg.model.options, "attention", "auto")
    if kind == "eager":
        return "eager"
    if kind == "sdpa" and cfg.train.mask == "document":
        return "dense-mask"
    return "flash"


def default_nproc(cfg: Config) -> int:
    """The fewest processes the config's [parallel] section admits: the product of its fixed sizes."""
    p = cfg.parallel
    return p.dp_replicate * p.tp * p.pp * p.cp * (p.dp_shard if p.dp_shard > 0 else 1)


def config_layout(cfg: Config, nproc: int) -> tuple[Layout, int, int]:
    """(the layout of one pipeline stage's ranks with context parallel folded into the FSDP shard group,
    dp_shard, data-parallel ranks) of the config on `nproc` devices. Pipeline and context parallel are planned
    whether or not the trainer runs them yet, so this resolves the sizes itself where resolve_layout refuses."""
    p = cfg.parallel
    if p.pp == 1 and p.cp == 1 and not p.cpu_offload:
        try:
            layout = resolve_layout(p, nproc)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        return layout, layout.dp_shard, layout.dp_size
    rest = p.dp_replicate * p.tp * p.pp * p.cp
    shard = p.dp_shard if p.dp_shard > 0 else nproc // rest if nproc % rest == 0 else 0
    if shard < 1 or rest * shard != nproc:
        raise ConfigError(
            f"parallel layout dp_replicate={p.dp_replicate} x dp_shard={p.dp_shard} x cp={p.cp} x tp={p.tp} x"
            f" pp={p.pp} does not make {nproc} processes"
        )
    try:
        return Layout(p.dp_replicate, shard * p.cp, p.tp, ep=p.ep), shard, p.dp_replicate * shard
    except ValueError as err:
        raise ConfigError(str(err)) from None


# ---------------------------------------------------------------------------------------------------------
# the plan


@dataclass(frozen=True)
class ActivationVariant:
    """One row of Korthikanti et al.'s table for this run's s, b, h, a and t."""

    checkpoint: str
    parallel: str  # none, tp=t, or tp=t + sp (sequence parallel)
    formula: str
    paper_bytes: float  # per layer, attention scores stored as the paper assumes
    kernel_bytes: float  # per layer, liandan's block as the planner counts it, with this run's attention kernel
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
    optimizer: OptimizerCost | None = None  # an optimizer whose state differs by role or that has step FLOPs
    staged: Evaluated | None = None  # the config's layout with pipeline, context parallel and offload terms
    ranking: tuple[Ranked, ...] = ()  # every layout of nproc devices, best first (liandan.plan.layout_rank)
    gpus_per_node: int = 8


def plan_config(
    cfg: Config,
    device: Device,
    *,
    nproc: int | None = None,
    mfu: float = 0.4,
    price_per_device_hour: float | None = None,
    headroom: float = DEFAULT_HEADROOM,
    ep_imbalance: float = DEFAULT_EP_IMBALANCE,
    gpus_per_node: int = 8,
    compute_efficiency: float = 0.6,
    rank: bool = True,
    max_cp: int = 8,
) -> Plan:
    """Everything `liandan plan` prints, for a config on `nproc` devices (default: the fewest it admits)."""
    if not 0 <= headroom < 1:
        raise ConfigError(f"--headroom = {headroom:g} must be in [0, 1)")
    nproc = default_nproc(cfg) if nproc is None else nproc
    if nproc < 1:
        raise ConfigError(f"--nproc = {nproc} must be at least 1")
    if max_cp < 1:
        raise ConfigError(f"--max-cp = {max_cp} must be at least 1")
    if not 0 < compute_efficiency <= 1:
        raise ConfigError(f"--compute-efficiency = {compute_efficiency:g} must be in (0, 1]")
    layout, dp_shard, dp_size = config_layout(cfg, nproc)
    t = cfg.train
    b = micro_batch_for(t.global_batch, t.micro_batch, Layout(1, dp_size, 1))
    if b is None:
        raise ConfigError(
            f"train.global_batch = {t.global_batch} must split into {dp_size} data-parallel ranks"
            f" of whole micro-batches of train.micro_batch = {t.micro_batch}"
        )
    args = plan_model_args(cfg)
    refusal = get_model_spec(cfg.model.family).tp_refusal(args, layout.tp)
    if refusal:
        raise ConfigError(refusal)
    dtype, attention = plan_dtype(cfg), plan_attention(cfg)
    p = cfg.parallel
    fp8 = plan_fp8(cfg, args)
    flops = run_flops(args, seq_len=t.seq_len, steps=t.steps, global_batch=t.global_batch)
    optimizer = optimizer_cost(cfg, args, flops.per_token * t.global_batch * t.seq_len)
    state_bytes = optimizer.state_bytes_per_param if optimizer is not None else optimizer_state_bytes(cfg)
    settings = {"sequence_parallel": p.sequence_parallel, "loss_parallel": p.loss_parallel, "ce_chunks": t.ce_chunks,
                "fp8_params": fp8.params, "optimizer_state_bytes_per_param": state_bytes,
                "ep_imbalance": ep_imbalance}  # fmt: skip
    memory = memory_per_device(
        args, layout, micro_batch=b, seq_len=t.seq_len // p.cp, activation_checkpoint=t.activation_checkpoint,
        dtype=dtype, attention=attention, accumulation_steps=t.global_batch // dp_size // b, **settings,
    )  # fmt: skip
    smallest = smallest_fitting_layout(
        args, seq_len=t.seq_len, global_batch=t.global_batch, micro_batch=t.micro_batch,
        device_memory_gib=device.memory_gib, headroom=headroom, dtype=dtype, attention=attention,
        max_tp=1 if fp8.params else 8, ep=layout.ep, **settings,  # fp8 runs without tensor parallel
    )  # fmt: skip
    share = min(1.0, 6.0 * fp8.params / flops.per_token)
    peak = mixed_peak_flops(device.peak_flops(dtype), device.peak_flops_fp8(dtype), share)
    # The optimizer's own FLOPs (Muon's Newton-Schulz) take device time too; each data-parallel replica does them.
    optimizer_flops = optimizer.step_flops * t.steps * layout.dp_replicate if optimizer is not None else 0.0
    time = run_time_estimate(flops.total + optimizer_flops, nproc, peak, mfu, price_per_device_hour)
    variants = []
    for mode in CHECKPOINT_MODES:
        for sp in (False, True):
            if sp and layout.tp == 1:
                continue
            kw = {"tp": layout.tp, "sequence_parallel": sp, "checkpoint": mode, "bytes_per_value": BYTES[dtype]}
            paper, formula = activation_bytes_per_layer(t.seq_len, b, args.dim, args.n_heads, **kw)
            kernel = activation_memory(args, micro_batch=b, seq_len=t.seq_len, tp=layout.tp, checkpoint=mode,
                                       dtype=dtype, attention=attention, sequence_parallel=sp).per_layer  # fmt: skip
            parallel = "none" if layout.tp == 1 else f"tp={layout.tp}" + (" + sp" if sp else "")
            used = mode == t.activation_checkpoint and sp == p.sequence_parallel
            variants.append(ActivationVariant(mode, parallel, formula, paper, kernel, used))
    init = init_memory(args, layout, t.meta_init)
    workload = Workload(
        args, t.seq_len, t.global_batch, peak, network_for(device.name, gpus_per_node), dtype, attention,
        p.sequence_parallel, p.loss_parallel, t.ce_chunks, state_bytes, ep_imbalance, compute_efficiency,
        tuple(p.pp_layers),
    )  # fmt: skip
    staged = None
    if p.pp > 1 or p.cp > 1 or p.cpu_offload:
        per_rank = t.global_batch // dp_size
        m = (p.pp_microbatches or p.pp * p.pp_stages_per_rank) if p.pp > 1 else per_rank // b
        if per_rank % m:
            raise ConfigError(
                f"parallel.pp_microbatches = {m} must divide the {per_rank} sequences of a data-parallel rank"
            )
        staged = evaluate(workload, Candidate(
            p.dp_replicate, dp_shard, p.tp, p.pp, p.cp, p.ep, p.pp_schedule, p.pp_stages_per_rank, m, per_rank // m,
            t.activation_checkpoint, p.cpu_offload,
        ))  # fmt: skip
        fits = staged.worst.total <= usable_bytes(device.memory_gib, headroom)
    else:
        fits = memory.fits(device.memory_gib, headroom)
    fits = fits and init.device <= usable_bytes(device.memory_gib, headroom)
    ranking = ()
    if rank:
        family = get_model_spec(cfg.model.family)
        ranking = tuple(rank_layouts(
            workload, nproc, device_memory_gib=device.memory_gib, headroom=headroom, dp_replicate=p.dp_replicate,
            ep=p.ep, schedule=p.pp_schedule, stages_per_rank=p.pp_stages_per_rank,
            tp_refusal=lambda tp: family.tp_refusal(args, tp), max_tp=1 if fp8.params else 2 * gpus_per_node,
            max_cp=max_cp,
        ))  # fmt: skip
    return Plan(
        args, count_params(args), flops, nproc, device, headroom, memory, fits, smallest, time, tuple(variants), init,
        fp8, optimizer, staged, ranking, gpus_per_node,
    )  # fmt: skip
