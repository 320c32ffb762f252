"""AdamW with decay groups: matrices decay; norm weights, biases and embedding tables do not."""

from __future__ import annotations

import torch
from torch import nn

from liandan.config import OptimSection
from liandan.train.optimizers import OptimizerPlugin


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


def build_adamw(model: nn.Module, section: OptimSection, device: torch.device,
                mixed_tensor_kinds: bool = False) -> torch.optim.AdamW:  # fmt: skip
    """`mixed_tensor_kinds`: the parameters mix DTensors of different meshes and plain tensors (tensor
    parallelism), which the multi-tensor kernels cannot take in one call; update them one by one. Plain
    tensors get the fused kernel (CUDA and CPU); sharded DTensors on the CPU take the foreach path."""
    o = section.options
    decay, no_decay = parameter_groups(model, o.decay_norms_and_embeddings)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(p, DTensor) for p in decay + no_decay)
    if mixed_tensor_kinds:
        kwargs = {"foreach": False}
    elif device.type == "cuda" or not sharded:
        kwargs = {"fused": True}
    else:
        kwargs = {"foreach": True}
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=section.lr, betas=(o.beta1, o.beta2), eps=o.eps, **kwargs
    )


def _build(parts: list[nn.Module], section: OptimSection, device: torch.device, mixed: bool) -> list[list]:
    return [[build_adamw(part, section, device, mixed)] for part in parts]


# Two fp32 moments per parameter.
ADAMW = OptimizerPlugin("adamw", _build, state_bytes_per_param=8.0)
