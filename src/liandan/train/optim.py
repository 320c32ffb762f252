"""AdamW with decay groups, and the learning-rate schedules (warmup then cosine, linear, WSD or constant)."""

from __future__ import annotations

import math

import torch
from torch import nn

from liandan.config import OptimSection, ScheduleSection
from liandan.spec.schedule import lr_multiplier


def parameter_groups(model: nn.Module, decay_norms_and_embeddings: bool = False) -> tuple[list, list]:
    """(decayed, not decayed). Matrices of linear layers decay; norm weights, biases and embedding tables
    do not, unless asked, because shrinking them towards zero changes no capacity but hurts the fit."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for _, param in model.named_parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))  # a tied head and embedding are one parameter
        is_matrix = param.dim() >= 2 and id(param) not in embedding_params
        (decay if is_matrix or decay_norms_and_embeddings else no_decay).append(param)
    return decay, no_decay


def build_optimizer(
    model: nn.Module, cfg: OptimSection, device: torch.device, mixed_tensor_kinds: bool = False
) -> torch.optim.AdamW:
    """`mixed_tensor_kinds`: the parameters mix DTensors of different meshes and plain tensors (tensor
    parallelism), which the multi-tensor kernels cannot take in one call; update them one by one. Plain
    tensors get the fused kernel (CUDA and CPU); sharded DTensors on the CPU take the foreach path."""
    decay, no_decay = parameter_groups(model, cfg.decay_norms_and_embeddings)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in decay + no_decay)
    if mixed_tensor_kinds:
        kwargs = {"foreach": False}
    elif device.type == "cuda" or not sharded:
        kwargs = {"fused": True}
    else:
        kwargs = {"foreach": True}
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, **kwargs
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, cfg: ScheduleSection
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, total_steps, cfg))


def clip_grad_norm(parameters, max_norm: float) -> float:
    """Global gradient norm over all parameters, clipped to `max_norm` (inf: measure only).

    Under FSDP and tensor parallelism gradients are DTensors on different meshes (2-D for sharded matrices,
    1-D for sharded norms) or plain tensors (norm weights replicated by tensor parallelism alone), which a
    single foreach norm cannot mix; each group is reduced on its own mesh and the squares are summed.
    """
    from torch.distributed.tensor import DTensor

    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    if not groups:
        return 0.0
    squares = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    total = math.sqrt(squares)
    if total > max_norm:
        coef = max_norm / (total + 1e-6)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total
