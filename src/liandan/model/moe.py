"""Mixture-of-experts feed-forward: a router choosing `top_k` of `experts` fine-grained experts per token
(token choice), optional shared experts every token goes through (DeepSeek, Qwen2-MoE), and the balancing
terms open MoE models train with.

- Scores: softmax over the experts (Mixtral, Qwen3-MoE) or a sigmoid per expert (DeepSeek-V3); the chosen
  experts' scores are the weights of their outputs, renormalised to sum to one when `route_norm`.
- Balancing without an auxiliary loss (DeepSeek-V3): a per-expert bias added to the scores for choosing only,
  nudged after each step towards the experts that got fewer tokens (`update_bias`); it never enters the
  gradient or the output weights. Optionally the global load-balancing loss (Switch/GShard:
  E * sum_e f_e * P_e) and the router z-loss (ST-MoE: mean log(sum exp(logits))^2), whose gradients are added
  to the training loss while its value stays the language-model loss (`Transformer.forward`).
- Dropless by default: every chosen (token, expert) pair is computed, the tokens sorted by expert and each
  expert's rows multiplied as one group (`grouped_matmul`: `torch._grouped_mm` on the CPU and on recent GPUs,
  one matmul per expert elsewhere). With `capacity_factor` > 0 an expert takes at most
  ceil(factor * tokens * top_k / experts) rows, the first in token order; the rest are dropped (their
  weight's share of the output is lost, the residual carries the token on) and counted.

The experts' weights are stacked, one 3-D tensor per projection ((experts, out, in), each expert's slice laid
out as an `nn.Linear` weight), so an expert-parallel layout shards them on their first dimension.
What each router saw in a step is kept in its `load` and `dropped` buffers (not saved in checkpoints) until
`routing_stats` reads and clears them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

SCORE_FUNCTIONS = ("softmax", "sigmoid")


@dataclass(frozen=True)
class MoEConfig:
    experts: int
    top_k: int
    ffn_dim: int  # each routed expert's hidden size
    shared_experts: int = 0  # shared experts of ffn_dim each, run as one feed-forward of shared * ffn_dim
    score: str = "softmax"
    route_norm: bool = True
    route_scale: float = 1.0
    bias_balance: bool = True  # auxiliary-loss-free balancing by a per-expert bias on the choice
    aux_loss: float = 0.0  # weight of the global load-balancing loss
    z_loss: float = 0.0  # weight of the router z-loss
    capacity_factor: float = 0.0  # 0: dropless

    def __post_init__(self) -> None:
        if self.score not in SCORE_FUNCTIONS:
            raise ValueError(f"model.moe_score = {self.score!r} is not one of {', '.join(SCORE_FUNCTIONS)}")
        if not 1 <= self.top_k <= self.experts:
            raise ValueError(f"model.moe_top_k = {self.top_k} must be between 1 and model.moe_experts = {self.experts}")


class Router(nn.Module):
    """Token-choice top-k routing. `expert_bias` is a buffer (saved in checkpoints, never trained by
    gradients); `load` counts the (token, expert) pairs each expert was chosen for since it was last read,
    `dropped` the pairs a capacity limit dropped."""

    def __init__(self, dim: int, cfg: MoEConfig):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(dim, cfg.experts, bias=False)
        self.register_buffer("expert_bias", torch.zeros(cfg.experts, dtype=torch.float32))
        self.register_buffer("load", torch.zeros(cfg.experts, dtype=torch.float32), persistent=False)
        self.register_buffer("dropped", torch.zeros((), dtype=torch.float32), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> (expert indices (N, k), their output weights (N, k) fp32, the auxiliary loss (fp32
        scalar, weighted, 0 when none is configured))."""
        cfg = self.cfg
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if cfg.score == "softmax" else logits.sigmoid()
        choice = scores + self.expert_bias if cfg.bias_balance else scores
        indices = choice.topk(cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(-1, indices)
        if cfg.route_norm and cfg.top_k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if cfg.score == "sigmoid" else 0.0))
        if cfg.route_scale != 1.0:
            weights = weights * cfg.route_scale
        aux = logits.new_zeros(())
        counts = torch.bincount(indices.flatten(), minlength=cfg.experts).float()
        if self.training and cfg.aux_loss:
            # f_e: the share of the pairs routed to e (no gradient); P_e: the mean of e's normalised score.
            share = counts / indices.numel()
            probs = scores if cfg.score == "softmax" else scores / scores.sum(-1, keepdim=True)
            aux = aux + cfg.aux_loss * cfg.experts * (share * probs.mean(0)).sum()
        if self.training and cfg.z_loss:
            aux = aux + cfg.z_loss * logits.logsumexp(-1).square().mean()
        if _counting(self):
            with torch.no_grad():
                self.load += counts
        return indices, weights, aux

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor, rate: float) -> None:
        """DeepSeek-V3's update: each expert's bias moves by `rate` towards balance, up for the experts that
        got fewer pairs than the mean over the step (`load`, summed over every data-parallel rank), down for
        those that got more."""
        self.expert_bias += rate * torch.sign(load.mean() - load)


def _counting(module: nn.Module) -> bool:
    """Whether this forward's routing is counted: a training forward (with gradients: not a replay or a probe
    without them), and not when activation checkpointing recomputes the forward during the backward (the
    pairs were counted the first time)."""
    if not module.training or not torch.is_grad_enabled():
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is None or task() == -1


class GroupedExperts(nn.Module):
    """`experts` SwiGLU feed-forwards with their weights stacked: w1 and w3 (experts, hidden, dim), w2
    (experts, dim, hidden)."""

    def __init__(self, dim: int, hidden: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, D): rows sorted by expert, `counts[e]` of them for expert e. Under expert parallelism the
        weights are DTensors sharded on the experts' dimension and `x` holds the rows of this rank's experts
        (`liandan.train.expert_parallel`): the local shards serve them."""
        w1, w2, w3 = (_local(w) for w in (self.w1, self.w2, self.w3))
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            # autocast does not cast for the grouped kernel as it does for a linear layer: without this, fp32
            # master weights would send every autocast run (one device, no FSDP) to the per-expert loop
            dtype = torch.get_autocast_dtype(kind)
            x, w1, w2, w3 = (t.to(dtype) for t in (x, w1, w2, w3))
        h = F.silu(grouped_matmul(x, w1, counts)) * grouped_matmul(x, w3, counts)
        return grouped_matmul(h, w2, counts)

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.w1, 0.0, std)
        nn.init.normal_(self.w3, 0.0, std)
        nn.init.normal_(self.w2, 0.0, out_std)


def _local(weight: torch.Tensor) -> torch.Tensor:
    # A DTensor's local shard, found by its method: importing DTensor here would load torch.distributed for
    # every reader of a model's shape (`liandan plan`, `ckpt info`).
    to_local = getattr(weight, "to_local", None)
    return to_local() if to_local is not None else weight


def grouped_matmul(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by group, `counts[g]` rows for group g, each multiplied by weight[g].T (weight:
    (groups, out, in)). One grouped kernel where the device has one for these dtypes; otherwise one matmul per
    non-empty group, which gives the same result."""
    if _grouped_mm_usable(x, weight):
        offsets = torch.cumsum(counts.to(device=x.device, dtype=torch.int32), 0, dtype=torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for group, count in enumerate(counts.tolist()):
        if count:
            out[start : start + count] = x[start : start + count] @ weight[group].t()
            start += count
    return out


def _grouped_mm_usable(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm runs on the CPU in fp32 and bf16 (forward and backward equal to the loop, and faster:
    benchmarks/moe_grouped.py; bf16 only under torch.compile) and on CUDA devices of compute capability 9.0
    and up in bf16; rows must be 16-byte aligned on both. The per-group loop serves everywhere else."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != weight.dtype:
        return False
    if any(n * x.element_size() % 16 for n in (x.shape[-1], weight.shape[1])):
        return False
    if x.device.type == "cpu":
        # Compiled, the kernel's shape function takes bf16 only (torch 2.13); fp32 compiles the loop.
        return x.dtype == torch.bfloat16 or (x.dtype == torch.float32 and not torch.compiler.is_compiling())
    if x.device.type != "cuda" or x.dtype != torch.bfloat16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


class MoE(nn.Module):
    """The feed-forward of a mixture-of-experts block: routed experts, and shared experts when configured."""

    def __init__(self, dim: int, cfg: MoEConfig, shared: nn.Module | None = None):
        super().__init__()
        self.cfg = cfg
        self.router = Router(dim, cfg)
        self.experts = GroupedExperts(dim, cfg.ffn_dim, cfg.experts)
        self.shared_experts = shared
        self.aux_loss: torch.Tensor | None = None  # this forward's weighted auxiliary loss, for the model's loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        indices, weights, self.aux_loss = self.router(flat)
        routed = self._routed(flat, indices, weights)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(flat)
        return routed.reshape(shape)

    def _routed(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        pairs = indices.flatten()
        # Stable, so that within an expert the rows keep token order (capacity keeps the first ones).
        order = torch.argsort(pairs, stable=True)
        counts = torch.bincount(pairs, minlength=cfg.experts)
        if cfg.capacity_factor > 0:
            order, counts = self._within_capacity(order, counts, x.shape[0])
        token = order // cfg.top_k
        rows = self.experts(x[token], counts)
        scaled = rows.float() * weights.flatten()[order, None]
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, scaled).type_as(x)

    def _within_capacity(
        self, order: torch.Tensor, counts: torch.Tensor, tokens: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        capacity = math.ceil(cfg.capacity_factor * tokens * cfg.top_k / cfg.experts)
        starts = torch.cumsum(counts, 0) - counts
        expert = torch.repeat_interleave(torch.arange(cfg.experts, device=counts.device), counts)
        rank_in_expert = torch.arange(order.numel(), device=order.device) - starts[expert]
        kept = rank_in_expert < capacity
        if _counting(self):
            with torch.no_grad():
                self.router.dropped += (~kept).sum()
        return order[kept], counts.clamp(max=capacity)

    def reset_parameters(self, std: float, out_std: float) -> None:
        nn.init.normal_(self.router.gate.weight, 0.0, std)
        self.experts.reset_parameters(std, out_std)
        self.router.expert_bias.zero_()


# ---------------------------------------------------------------------------------------------------------
# what a train module does with the routers after each step


@dataclass(frozen=True)
class RoutingStats:
    """One step's routing over every rank: per MoE layer (by its block index), the share of the step's
    (token, expert) pairs each expert got, the share of pairs dropped, and the biases after the update."""

    layers: list[int]
    load: torch.Tensor  # (layers, experts) fp32, rows sum to 1 (of the pairs chosen)
    dropped: torch.Tensor  # (layers,) fp32
    bias: torch.Tensor  # (layers, experts) fp32
    top_k: int = 1  # experts chosen per token

    def summary(self) -> dict[str, float]:
        """Per layer: max/mean and min/mean of the load (1.0 is balanced), its entropy over log(experts) (1.0
        is uniform), the share dropped; keys `moe/<layer>/<what>`."""
        experts = self.load.shape[1]
        mean = 1.0 / experts
        out: dict[str, float] = {}
        for row, layer in enumerate(self.layers):
            load = self.load[row]
            entropy = -(load * load.clamp_min(1e-12).log()).sum() / math.log(experts) if experts > 1 else 1.0
            out[f"moe/{layer}/load_max"] = float(load.max()) / mean
            out[f"moe/{layer}/load_min"] = float(load.min()) / mean
            out[f"moe/{layer}/entropy"] = float(entropy)
            out[f"moe/{layer}/dropped"] = float(self.dropped[row])
        return out

    def expert_loads(self) -> dict[str, float]:
        """Each expert's load over the mean (1.0 is balanced), keys `moe/<layer>/expert/<expert>`: the rows of
        the dashboard's expert-load heat map."""
        experts = self.load.shape[1]
        return {
            f"moe/{layer}/expert/{e}": float(value) * experts
            for row, layer in enumerate(self.layers)
            for e, value in enumerate(self.load[row].tolist())
        }


def moe_layers(model: nn.Module) -> dict[int, MoE]:
    """The MoE feed-forwards of a model, by their block's index (found by module, so wrappers do not hide
    them; the index is the block's key in the model's block container)."""
    found: dict[int, MoE] = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE):
            index = next((p for p in reversed(name.split(".")[:-1]) if p.isdigit()), None)
            found[int(index) if index is not None else len(found)] = module
    return dict(sorted(found.items()))


@torch.no_grad()
def routing_step(model: nn.Module | Sequence[nn.Module], bias_rate: float, group=None,
                 every_layer: Mapping[int, MoEConfig] | None = None, stage_group=None,
                 across_ranks: bool = True) -> RoutingStats | None:  # fmt: skip
    """After a step's optimizer update: the step's loads summed over the ranks of `group` (every rank of the
    default group when None and distributed), the biases updated from them (the same update on every rank,
    which keeps the replicated biases equal), the counters cleared. None for a model without MoE layers.
    `across_ranks`: False for a model that runs whole in one process among others (built without a mesh).

    `model` may be the pipeline stages a rank holds, with `every_layer` the MoE layers of the whole model
    (by block index) and `stage_group` the ranks holding the other stages: each rank then counts and updates
    its own layers (the others' rows stay zero in the sums) and every rank returns the whole model's stats."""
    import torch.distributed as dist

    parts = [model] if isinstance(model, nn.Module) else list(model)
    layers = {index: moe for part in parts for index, moe in moe_layers(part).items()}
    configs = every_layer if every_layer is not None else {index: moe.cfg for index, moe in layers.items()}
    if not configs:
        return None
    rows = {index: row for row, index in enumerate(sorted(configs))}
    experts = next(iter(configs.values())).experts
    # on the counters' device, or where a stage without MoE layers keeps its weights (NCCL needs the device)
    device = next((moe.router.load.device for moe in layers.values()), None) or next(parts[0].parameters()).device
    counts = torch.zeros(len(rows), experts + 1, dtype=torch.float32, device=device)
    for index, moe in layers.items():
        counts[rows[index]] = torch.cat([moe.router.load, moe.router.dropped.reshape(1)])
    if across_ranks and dist.is_available() and dist.is_initialized():
        dist.all_reduce(counts, group=group)
    load, dropped = counts[:, :-1], counts[:, -1]
    pairs = load.sum(-1)  # every pair chosen, dropped ones included
    bias = torch.zeros(len(rows), experts, dtype=torch.float32, device=counts.device)
    for index, moe in layers.items():
        router = moe.router
        if router.cfg.bias_balance and router.training:
            router.update_bias(load[rows[index]], bias_rate)
        router.load.zero_()
        router.dropped.zero_()
        bias[rows[index]] = router.expert_bias.float()
    if every_layer is not None:
        dist.all_reduce(bias, group=stage_group)  # each layer's biases from the one rank holding it
    share = load / load.sum(-1, keepdim=True).clamp_min(1.0)
    return RoutingStats(
        layers=list(rows),
        load=share.cpu(),
        dropped=(dropped / pairs.clamp_min(1.0)).cpu(),
        bias=bias.cpu(),
        top_k=next(iter(configs.values())).top_k,
    )


class _CarryAuxLoss(torch.autograd.Function):
    """The hidden state unchanged forward; backward, its gradient unchanged and the auxiliary loss's backward
    started at 1 / `divisor` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, aux: torch.Tensor, divisor: float) -> torch.Tensor:
        ctx.divisor = divisor
        ctx.aux_meta = (aux.shape, aux.dtype, aux.device)
        # A copy, not the input itself (which autograd would make a view of it): the zero-bubble schedules
        # detach a stage's output in place after its input's backward, which a view refuses.
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shape, dtype, device = ctx.aux_meta
        # As the head's stage divides its loss: 1 / divisor in the loss's dtype, the gradient dense training
        # gives each auxiliary loss when it divides the micro-batch's loss by the same number.
        return grad, torch.ones(shape, dtype=dtype, device=device) / ctx.divisor, None


def carry_aux_loss(hidden: torch.Tensor, aux: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """`hidden`, through which the backward pass also reaches `aux` (the auxiliary losses of a pipeline stage
    without the head, whose gradients cannot join the loss's), as if `aux / divisor` had been added to the
    loss. Its value is not added anywhere: the loss stays the language-model loss."""
    return _CarryAuxLoss.apply(hidden, aux, divisor)


def model_aux_loss(model: nn.Module) -> torch.Tensor | None:
    """The sum of the MoE layers' auxiliary losses from the last forward, or None when there are none."""
    losses = [m.aux_loss for m in moe_layers(model).values() if m.aux_loss is not None]
    return torch.stack(losses).sum() if losses else None
