"""Layouts in full for the planner: FSDP2 x tensor x pipeline x context parallel (and the config's expert
parallel), with activation recomputation and CPU offload. For each, the memory of the busiest pipeline rank
and a predicted step time; `liandan.plan.layout_rank` ranks them.

Planning does not go through `liandan.common.layout.Layout`'s refusals: a `Candidate` describes a layout
whether or not the trainer runs it yet. A pipeline rank's share of the model is modelled as its layers,
plus the embedding on the rank of the first stage and the final norm and head on the rank of the last
(`liandan.plan.pipeline` for the schedules). Context parallelism divides each sequence over cp ranks, which
FSDP2 folds into its shard group (dp_shard x cp), as torchtitan does. CPU offload (FSDP2's
CPUOffloadPolicy) keeps parameters, gradients and optimizer state in host memory and runs the optimizer step
there.

The step time is a roofline: the busiest rank's FLOPs at `compute_efficiency` of the device's peak, plus the
communication that compute does not hide, stretched by the pipeline's bubble:

    step = (compute + recompute + tp + cp + ep) / (1 - bubble) + pp p2p + exposed FSDP + offload

- tp: per layer and micro-batch, sequence-parallel all-gathers and reduce-scatters (or all-reduces) of
  s·b·h values, 4 in the forward pass and 4 in the backward pass ((t - 1)/t of each leaves the device), 4
  more under full recomputation; not overlapped.
- cp: ring attention passes each rank's K and V chunk cp - 1 times in the forward pass, and K, V and their
  gradients in the backward pass; only what exceeds the attention's own compute is counted.
- ep: the all-to-alls of `liandan.plan.memory.ExpertParallelMemory`, not overlapped.
- pp: the activations and their gradients between stages; the fill and drain hops are exposed.
- FSDP: all-gathers in the compute dtype (forward, and again backward where parameters are resharded after
  the forward) and reduce-scatters in fp32, overlapped with compute except one layer's worth. Under PP,
  torchtitan's policy: no resharding after the forward and one reduction per step.
- offload: the host-device copies of the shards join the FSDP traffic (PCIe instead of the network); the
  optimizer step on the CPU is exposed.

A group of ranks uses NVLink when it lies within one node, the network otherwise; dims are ordered pp,
dp_replicate, dp_shard, cp, tp from outermost, so tp is contiguous, cp strides by tp, FSDP by cp·tp.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from liandan.common.layout import Layout
from liandan.config import ConfigError
from liandan.model.spec import count_params, flops_per_token
from liandan.plan.activations import BYTES, activation_memory
from liandan.plan.memory import (
    ADAMW_STATE_BYTES_PER_PARAM,
    DEFAULT_EP_IMBALANCE,
    expert_parallel_memory,
    memory_per_device,
    param_split,
)
from liandan.plan.pipeline import bubble_share, in_flight, rank_stages, split_layers, virtual_stages

GB = 1e9

# (intra-node, inter-node) bandwidth in GB/s one device sees in NCCL's collectives: NVLink's bus bandwidth
# and one 400 Gb/s (H100, H200, B200) or 200 Gb/s (A100) network port per GPU, at about 80% of the line rate.
LINKS_GBPS: dict[str, tuple[float, float]] = {"H100": (360, 40), "H200": (360, 40), "B200": (720, 40),
                                              "A100": (240, 20), "H800": (160, 40)}  # fmt: skip
DEFAULT_LINKS_GBPS = (200.0, 20.0)
PCIE_GBPS = 25.0  # host-device copies of pinned memory, PCIe Gen4/5 x16 as measured, shared with the NIC
HOST_OPTIMIZER_GBPS = 10.0  # bytes an Adam step on the CPU streams per second per device (8 share a host)
ADAM_BYTES_TOUCHED = 28.0  # per parameter: read fp32 p, g, m, v; write p, m, v


@dataclass(frozen=True)
class Network:
    gpus_per_node: int = 8
    intra_gbps: float = 360.0
    inter_gbps: float = 40.0
    pcie_gbps: float = PCIE_GBPS
    host_optimizer_gbps: float = HOST_OPTIMIZER_GBPS

    def bandwidth(self, span: int) -> float:
        """Bytes per second for a group whose ranks span `span` consecutive ranks."""
        return (self.intra_gbps if span <= self.gpus_per_node else self.inter_gbps) * GB


def network_for(device_name: str, gpus_per_node: int = 8) -> Network:
    if gpus_per_node < 1:
        raise ConfigError(f"--gpus-per-node = {gpus_per_node} must be at least 1")
    family = next((k for k in LINKS_GBPS if device_name.upper().startswith(k)), None)
    intra, inter = LINKS_GBPS[family] if family else DEFAULT_LINKS_GBPS
    return Network(gpus_per_node, intra, inter)


@dataclass(frozen=True)
class Candidate:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int = 1
    cp: int = 1
    ep: int = 1
    schedule: str = "1f1b"
    stages_per_rank: int = 1
    microbatches: int = 1  # per optimizer step on each data-parallel rank (under PP, the schedule's)
    micro_batch: int = 1  # sequences per micro-batch
    checkpoint: str = "none"
    offload: bool = False

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def v(self) -> int:
        return virtual_stages(self.schedule, self.stages_per_rank) if self.pp > 1 else 1

    @property
    def fsdp_shard(self) -> int:
        return self.dp_shard * self.cp

    def stage_layout(self) -> Layout:
        """One pipeline stage's ranks as a Layout (pp = 1), context parallel folded into the FSDP shard group."""
        return Layout(self.dp_replicate, self.fsdp_shard, self.tp, ep=self.ep)

    def dims(self) -> str:
        parts = [f"dp_shard={self.dp_shard}"] + [f"dp_replicate={self.dp_replicate}"] * (self.dp_replicate > 1)
        parts += [f"{k}={getattr(self, k)}" for k in ("tp", "pp", "cp", "ep") if getattr(self, k) > 1]
        return " ".join(parts)

    def __str__(self) -> str:
        pipe = f", {self.schedule} v={self.v} m={self.microbatches}" if self.pp > 1 else ""
        ac = "" if self.checkpoint == "none" else f", {self.checkpoint} AC"
        return f"{self.dims()}{pipe}, micro-batch {self.micro_batch}{ac}" + (", offload" if self.offload else "")

    def overrides(self) -> list[str]:
        """The config overrides that run this layout."""
        out = [f"--parallel.dp_replicate={self.dp_replicate}", f"--parallel.dp_shard={self.dp_shard}",
               f"--parallel.tp={self.tp}", f"--parallel.pp={self.pp}", f"--parallel.cp={self.cp}",
               f"--parallel.ep={self.ep}", f"--parallel.cpu_offload={str(self.offload).lower()}",
               f"--train.activation_checkpoint={self.checkpoint}"]  # fmt: skip
        if self.pp > 1:
            out += [f"--parallel.pp_schedule={self.schedule}", f"--parallel.pp_microbatches={self.microbatches}",
                    f"--parallel.pp_stages_per_rank={self.v}", "--train.micro_batch=0"]  # fmt: skip
        else:
            out.append(f"--train.micro_batch={self.micro_batch}")
        return out


@dataclass(frozen=True)
class RankMemory:
    """Bytes one device of a pipeline rank holds at its peak."""

    rank: int
    layers: int
    embedding: bool
    head: bool
    params: float  # fp32 parameters, gradients and optimizer state on the device (0 under offload)
    grads: float
    optimizer: float
    transient: float  # gathered parameters and unsharded gradients
    activations: float
    buffers: float  # pipeline send/receive buffers, all-to-all buffers
    in_flight: float
    host: float = 0.0  # model states kept in host memory under offload
    step_temporary: float = 0.0  # the optimizer step's own temporaries, alive once the activations are freed

    @property
    def total(self) -> float:
        states = self.params + self.grads + self.optimizer
        return states + self.transient + self.buffers + max(self.activations, self.step_temporary)


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank, by term (module docstring)."""

    compute: float
    recompute: float
    bubble: float
    tp: float
    cp: float
    ep: float
    pp: float
    fsdp: float
    offload: float
    bubble_share: float
    crossing: tuple[str, ...]  # the dims whose groups leave the node

    @property
    def total(self) -> float:
        return (
            self.compute
            + self.recompute
            + self.bubble
            + self.tp
            + self.cp
            + self.ep
            + self.pp
            + self.fsdp
            + self.offload
        )

    def terms(self) -> dict[str, float]:
        return {
            k: getattr(self, k) for k in ("compute", "recompute", "bubble", "tp", "cp", "ep", "pp", "fsdp", "offload")
        }


@dataclass(frozen=True)
class Evaluated:
    candidate: Candidate
    ranks: tuple[RankMemory, ...]
    time: StepTime
    stage_layers: tuple[int, ...]

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)


@dataclass(frozen=True)
class Workload:
    """What every layout of one run shares: the model, the batch, the precision and the device."""

    args: Any
    seq_len: int
    global_batch: int
    peak_flops: float
    network: Network
    dtype: str = "bf16"
    attention: str = "flash"
    sequence_parallel: bool = True
    loss_parallel: bool = True
    ce_chunks: int = 1
    optimizer_state_bytes_per_param: float = ADAMW_STATE_BYTES_PER_PARAM
    ep_imbalance: float = DEFAULT_EP_IMBALANCE
    compute_efficiency: float = 0.6
    pp_layers: tuple[int, ...] = ()
    # Bytes per parameter the optimizer step allocates on top of its state: 0 for the fused AdamW kernel the
    # trainer uses on GPUs; 4 for the multi-tensor (foreach) AdamW it uses for FSDP2's sharded parameters on
    # the CPU, whose step computes the square root of the second moment into a new tensor.
    step_temporary_bytes_per_param: float = 0.0


def _head_dim(args: Any) -> int:
    """What a family without `head_dim` (the shape every family has: n_layers, dim, n_heads, vocab_size) means."""
    return getattr(args, "head_dim", 0) or args.dim // args.n_heads


def _tied(args: Any) -> bool:
    return bool(getattr(args, "tie_embeddings", False))


def _stage_args(args: Any, n_layers: int) -> Any:
    """The model's args with `n_layers` layers: what one pipeline rank's activation formulas read."""
    if dataclasses.is_dataclass(args):
        return dataclasses.replace(args, n_layers=n_layers)
    clone = type(args).__new__(type(args))
    clone.__dict__.update(args.__dict__, n_layers=n_layers)
    return clone


def stage_layers(w: Workload, c: Candidate) -> list[int]:
    """Decoder layers in each of the pp·v stages: the config's pp_layers, or balanced by FLOPs with the
    embedding's and the head's parameters counted on the first and last stages."""
    stages = c.pp * c.v
    if w.pp_layers:
        if len(w.pp_layers) != stages or sum(w.pp_layers) != w.args.n_layers:
            raise ConfigError(f"parallel.pp_layers = {list(w.pp_layers)} must give {stages} stages summing to"
                              f" {w.args.n_layers} layers")  # fmt: skip
        return list(w.pp_layers)
    split = param_split(w.args, 1)
    block = (split.blocks if split.blocks >= 0 else split.n_layers * split.block) / w.args.n_layers
    table = w.args.vocab_size * w.args.dim
    return split_layers(w.args.n_layers, stages, table / block / 2, table / block)


def evaluate(w: Workload, c: Candidate) -> Evaluated:
    """Memory on every pipeline rank and the predicted step time of `c`."""
    if c.pp == 1:
        return _evaluate_unpipelined(w, c)
    args, cb = w.args, BYTES[w.dtype]
    layers = stage_layers(w, c)
    held = rank_stages(c.schedule, c.pp, c.stages_per_rank)
    last = c.pp * c.v - 1
    split = param_split(args, c.tp, c.ep)
    block = (split.blocks if split.blocks >= 0 else split.n_layers * split.block) / args.n_layers
    table = -(-args.vocab_size * args.dim // c.tp)
    head = split.root - (0 if _tied(args) else table)  # the head's table (or a tied copy) and the norm
    s = w.seq_len // c.cp
    acts = activation_memory(
        _stage_args(args, 1), micro_batch=c.micro_batch, seq_len=s, tp=c.tp, checkpoint=c.checkpoint,
        dtype=w.dtype, attention=w.attention, sequence_parallel=w.sequence_parallel and c.tp > 1,
        loss_parallel=w.loss_parallel and c.tp > 1, ce_chunks=w.ce_chunks,
        autocast=w.dtype == "bf16" and not (c.fsdp_shard > 1 or (c.dp_replicate > 1 and c.tp > 1)),
    )  # fmt: skip
    boundary = s * c.micro_batch * args.dim * cb / (c.tp if w.sequence_parallel and c.tp > 1 else 1)
    shard = c.fsdp_shard
    fsdp = shard > 1 or (c.dp_replicate > 1 and c.tp > 1)
    ranks = []
    for r, stages in enumerate(held):
        n = sum(layers[i] for i in stages)
        first, final = 0 in stages, last in stages
        params = n * block + (table if first else 0) + (head if final else 0)
        per_device = params / shard if fsdp else params
        k = w.optimizer_state_bytes_per_param
        states = (4 * per_device, 4 * per_device, k * per_device)
        # torchtitan's PP policy: parameters stay gathered from the first forward to the last backward, and
        # gradients accumulate unsharded (fp32 for the reduction) until the step's one reduce-scatter.
        if fsdp:
            transient = (cb + 4) * params
        else:  # autocast's bf16 weight copies; DDP's flat fp32 gradient buckets
            transient = (2 * params if cb == 2 else 0.0) + (4 * params if c.dp_replicate > 1 else 0.0)
        flight = in_flight(c.schedule, c.pp, c.microbatches, r, c.stages_per_rank)
        logits = acts.head * (c.microbatches if c.schedule in ("gpipe", "looped-bfs") else 1) if final else 0.0
        layer_acts = flight * n * (acts.per_layer + acts.masks / max(1, args.n_layers))
        activations = layer_acts + max(logits, acts.block_backward)
        buffers = 2 * boundary * c.v
        if c.ep > 1:
            ep_mem = expert_parallel_memory(
                _stage_args(args, n), c.stage_layout(), micro_batch=c.micro_batch, seq_len=s, dtype=w.dtype,
                checkpoint=c.checkpoint, accumulation_steps=1, imbalance=w.ep_imbalance,
            )  # fmt: skip
            buffers += ep_mem.buffers + flight * ep_mem.imbalance_headroom
        host, temporary = 0.0, w.step_temporary_bytes_per_param * per_device
        if c.offload:
            host, states, temporary = sum(states), (0.0, 0.0, 0.0), 0.0
        ranks.append(RankMemory(r, n, first, final, *states, transient, activations, buffers, flight, host,
                                temporary))  # fmt: skip
    time = _step_time(w, c, ranks, boundary)
    return Evaluated(c, tuple(ranks), time, tuple(layers))


def _evaluate_unpipelined(w: Workload, c: Candidate) -> Evaluated:
    args = w.args
    est = memory_per_device(
        args, c.stage_layout(), micro_batch=c.micro_batch, seq_len=w.seq_len // c.cp, activation_checkpoint=c.checkpoint,
        dtype=w.dtype, attention=w.attention, sequence_parallel=w.sequence_parallel and c.tp > 1,
        loss_parallel=w.loss_parallel and c.tp > 1, ce_chunks=w.ce_chunks, accumulation_steps=c.microbatches,
        optimizer_state_bytes_per_param=w.optimizer_state_bytes_per_param, ep_imbalance=w.ep_imbalance,
    )  # fmt: skip
    s = est.states
    buffers = est.expert_parallel.total if est.expert_parallel is not None else 0.0
    if c.offload:
        # Only the gathered blocks, activations and the gradients in flight to the host stay on the device.
        activations = est.activations.total + est.early_grads
        rank = RankMemory(0, args.n_layers, True, True, 0.0, 0.0, 0.0, est.transient, activations, buffers, 1.0,
                          s.total)  # fmt: skip
    else:
        # memory_per_device's peak: the activations and the gradients alive with them, whichever is larger
        activations = est.total - s.params - s.optimizer - est.transient - buffers - s.grads
        temporary = w.step_temporary_bytes_per_param * est.params_per_device
        rank = RankMemory(0, args.n_layers, True, True, s.params, s.grads, s.optimizer, est.transient,
                          activations, buffers, 1.0, step_temporary=temporary)  # fmt: skip
    boundary = 0.0
    return Evaluated(c, (rank,), _step_time(w, c, [rank], boundary), (args.n_layers,))


def _step_time(w: Workload, c: Candidate, ranks: list[RankMemory], boundary: float) -> StepTime:
    args, net, cb = w.args, w.network, BYTES[w.dtype]
    s_full = w.seq_len
    s = s_full // c.cp
    per_token = flops_per_token(args, s_full)
    head_flops = 6.0 * args.vocab_size * args.dim
    layer_flops = (per_token - head_flops) / args.n_layers
    attention_flops = 12.0 * args.n_heads * _head_dim(args) * s_full
    tokens = w.global_batch * s_full / (c.dp_size * c.cp)  # per rank and step
    peak = w.peak_flops * w.compute_efficiency
    split = param_split(args, c.tp, c.ep)
    block = (split.blocks if split.blocks >= 0 else split.n_layers * split.block) / args.n_layers

    def rank_seconds(r: RankMemory) -> tuple[float, float]:
        flops = (r.layers * layer_flops + (head_flops if r.head else 0.0)) * tokens / c.tp
        extra = {"full": r.layers * layer_flops / 3, "selective": r.layers * attention_flops / 3}.get(c.checkpoint, 0.0)
        return flops / peak, extra * tokens / c.tp / peak

    busiest = max(ranks, key=lambda r: sum(rank_seconds(r)))
    compute, recompute = rank_seconds(busiest)
    n = busiest.layers
    crossing = []
    tp_time = cp_time = ep_time = 0.0
    if c.tp > 1:
        if c.tp > net.gpus_per_node:
            crossing.append("tp")
        hops = 8 + (4 if c.checkpoint == "full" else 0)
        tp_bytes = n * tokens * args.dim * cb * (c.tp - 1) / c.tp * hops
        tp_time = tp_bytes / net.bandwidth(c.tp)
    if c.cp > 1:
        if c.cp * c.tp > net.gpus_per_node:
            crossing.append("cp")
        kv = (
            2 * tokens * getattr(args, "n_kv_heads", args.n_heads) * _head_dim(args) * cb / c.tp
        )  # this rank's K and V chunk for the step
        passes = 3 + (1 if c.checkpoint == "full" else 0)
        ring = n * kv * (c.cp - 1) * passes / net.bandwidth(c.cp * c.tp)
        own_attention = n * attention_flops / c.cp * tokens / c.tp / peak
        cp_time = max(0.0, ring - own_attention)
    if c.ep > 1:
        span = c.ep * c.cp * c.tp
        if span > net.gpus_per_node:
            crossing.append("ep")
        ep_mem = expert_parallel_memory(
            _stage_args(args, n), c.stage_layout(), micro_batch=c.micro_batch, seq_len=s, dtype=w.dtype,
            checkpoint=c.checkpoint, accumulation_steps=c.microbatches, imbalance=w.ep_imbalance,
        )  # fmt: skip
        ep_time = ep_mem.all_to_all_bytes_per_step / net.bandwidth(span)
    share = bubble_share(c.schedule, c.pp, c.microbatches, c.stages_per_rank)
    overlapped = compute + recompute + tp_time + cp_time + ep_time
    bubble = overlapped * share / (1 - share) if share else 0.0
    pp_time = 0.0
    if c.pp > 1:
        stride = c.world_size // c.pp
        if stride >= net.gpus_per_node:
            crossing.append("pp")
        hop = boundary / net.bandwidth(stride + 1)
        pp_time = 2 * (c.pp * c.v - 1) * hop
    table = -(-args.vocab_size * args.dim // c.tp)
    head = split.root - (0 if _tied(args) else table)
    params = n * block + (table if busiest.embedding else 0.0) + (head if busiest.head else 0.0)
    fsdp_time = offload_time = 0.0
    d = c.fsdp_shard
    gathers = 1 if c.pp > 1 else 2 * c.microbatches
    reductions = 1 if c.pp > 1 else c.microbatches
    if d > 1:
        if d * c.tp > net.gpus_per_node:
            crossing.append("fsdp")
        moved = params * (gathers * cb + reductions * 4) * (d - 1) / d
        fsdp_time = moved / net.bandwidth(d * c.tp)
    if c.dp_replicate > 1:
        fsdp_time += 2 * 4 * params / d * (c.dp_replicate - 1) / c.dp_replicate / net.bandwidth(net.gpus_per_node + 1)
    if c.offload:
        fsdp_time += params / max(d, 1) * 4 * (gathers + reductions) / (net.pcie_gbps * GB)
        offload_time = params / max(d, 1) * ADAM_BYTES_TOUCHED / (net.host_optimizer_gbps * GB)
    exposed_fsdp = max(fsdp_time - overlapped, fsdp_time / (n + 1)) if fsdp_time else 0.0
    return StepTime(compute, recompute, bubble, tp_time, cp_time, ep_time, pp_time, exposed_fsdp, offload_time,
                    share, tuple(crossing))  # fmt: skip


def model_flops_per_step(w: Workload) -> float:
    return flops_per_token(w.args, w.seq_len) * w.global_batch * w.seq_len


def params_total(args: Any) -> int:
    return count_params(args).total
