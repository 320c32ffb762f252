"""AdamW with decay groups: matrices decay; norm weights, biases and embedding tables do not. Hidden matrices
take their learning rate divided by their width multiplier (1 under the standard parameterization; the fan-in
over the base model's under muP, where Adam's best rate for them shrinks as 1/width); the embedding and the
head take theirs times `embedding_lr_scale` and `head_lr_scale`."""

from __future__ import annotations

import torch
from torch import nn

from liandan.config import OptimSection
from liandan.model.roles import RoledParameter, parameter_roles
from liandan.train.optimizers import OptimizerPlugin


def parameter_groups(model: nn.Module, decay_norms_and_embeddings: bool = False) -> tuple[list, list]:
    """(decayed, not decayed). Matrices of linear layers decay; norm weights, biases and embedding tables
    do not, unless asked, because shrinking them towards zero changes no capacity but hurts the fit."""
    decay, no_decay = [], []
    for r in parameter_roles(model):
        (decay if _decays(r, decay_norms_and_embeddings) else no_decay).append(r.param)
    return decay, no_decay


def _decays(r: RoledParameter, decay_norms_and_embeddings: bool) -> bool:
    return r.role in ("hidden", "head") or decay_norms_and_embeddings


def adamw_groups(roled: list[RoledParameter], section: OptimSection) -> list[dict]:
    """Torch param groups for `roled`: one per (decay, learning-rate scale), each with its own peak `lr`
    (the schedule multiplies every group's own). The scale is 1 / width multiplier for hidden matrices, the
    options' `embedding_lr_scale` and `head_lr_scale` for the embedding and the head, 1 otherwise."""
    o = section.options
    groups: dict[tuple[bool, float], dict] = {}
    for r in roled:
        decays = _decays(r, o.decay_norms_and_embeddings)
        # a tied head is the embedding (role "embedding") and takes its scale
        by_role = {"hidden": 1.0 / r.width_mult, "embedding": o.embedding_lr_scale, "head": o.head_lr_scale}
        scale = by_role.get(r.role, 1.0)
        group = groups.setdefault((decays, scale), {"params": [], "weight_decay": o.weight_decay if decays else 0.0,
                                                    "lr": section.lr * scale})  # fmt: skip
        group["params"].append(r.param)
    # Decayed groups first, the order checkpoints written before there were scales hold them in.
    return [groups[key] for key in sorted(groups, key=lambda k: (not k[0], k[1]))]


def adamw_over(roled: list[RoledParameter], section: OptimSection, device: torch.device,
               mixed_tensor_kinds: bool = False) -> torch.optim.AdamW:  # fmt: skip
    """AdamW over the parameters `roled` (of one model part, or the share of them another optimizer leaves
    to AdamW). `mixed_tensor_kinds`: the parameters mix DTensors of different meshes and plain tensors (tensor
    parallelism), which the multi-tensor kernels cannot take in one call; update them one by one. Plain
    tensors get the fused kernel (CUDA and CPU); sharded DTensors on the CPU take the foreach path."""
    from torch.distributed.tensor import DTensor

    o = section.options
    sharded = any(isinstance(r.param, DTensor) for r in roled)
    if mixed_tensor_kinds:
        kwargs = {"foreach": False}
    elif device.type == "cuda" or not sharded:
        kwargs = {"fused": True}
    else:
        kwargs = {"foreach": True}
    return torch.optim.AdamW(adamw_groups(roled, section), lr=section.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                             **kwargs)  # fmt: skip


def build_adamw(model: nn.Module, section: OptimSection, device: torch.device,
                mixed_tensor_kinds: bool = False) -> torch.optim.AdamW:  # fmt: skip
    """AdamW over every trainable parameter of `model`."""
    return adamw_over(parameter_roles(model), section, device, mixed_tensor_kinds)


def _build(parts: list[nn.Module], section: OptimSection, device: torch.device, mixed: bool) -> list[list]:
    return [[build_adamw(part, section, device, mixed)] for part in parts]


# Two fp32 moments per parameter.
ADAMW = OptimizerPlugin("adamw", _build, state_bytes_per_param=8.0)
