"""Muon (Newton-Schulz orthogonalised momentum) for the hidden matrices, AdamW for the rest (embeddings, the
output head, norm weights, biases): two optimizers per model part, under one learning-rate schedule.

`[optim] lr` and `[optim.muon] weight_decay` serve both. Muon's learning rate per A x B matrix is scaled by
`adjust_lr`: "match_rms_adamw" (the default, Moonlight's 0.2 sqrt(max(A, B))) makes its update's RMS that of
AdamW's, so AdamW's tuned learning rate and weight decay carry over; "spectral" (sqrt(max(1, A/B)), Keller
Jordan's) keeps the update's spectral norm independent of width, what muP asks for; "none" does not scale.
Under muP (`model.parameterization = "mup"`) "match_rms_adamw" divides each matrix's rate by sqrt(width_mult)
so that its update's spectral norm stays flat across widths, as "spectral" does by construction.

The update is `torch.optim.Muon`'s, made by liandan's `ShardedMuon` (`sharded_muon.py`): on sharded matrices
(FSDP2, tensor parallelism) it orthogonalises the whole matrix on one rank, and on plain ones it orthogonalises
the matrices of one shape together in one batched product, where `torch.optim.Muon` goes one at a time (the
same update to a bf16 rounding step now and then, in less time: `sharded_muon.py`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from liandan.config import OptimSection
from liandan.model.roles import RoledParameter, parameter_roles
from liandan.train.optimizers import OptimizerPlugin
from liandan.train.optimizers.adamw import adamw_over
from liandan.train.optimizers.sharded_muon import EPS, ShardedMuon, newton_schulz_flops

# [optim.muon] adjust_lr -> torch.optim.Muon's adjust_lr_fn
ADJUST_LR_FN = {"match_rms_adamw": "match_rms_adamw", "spectral": "original", "none": "none"}


def muon_roles(roled: list[RoledParameter]) -> tuple[list[RoledParameter], list[RoledParameter]]:
    """(Muon's, AdamW's): Muon takes the hidden 2-D matrices; the embedding (the head too when tied), the
    head, norm weights and biases go to AdamW, and so do a MoE block's stacked 3-D expert weights (hidden, but
    torch.optim.Muon orthogonalises 2-D matrices only, not each expert's slice)."""
    muon = [r for r in roled if r.role == "hidden" and r.param.dim() == 2]
    taken = {id(r.param) for r in muon}
    return muon, [r for r in roled if id(r.param) not in taken]


def muon_over(roled: list[RoledParameter], section: OptimSection) -> torch.optim.Optimizer:
    """Muon over the 2-D matrices `roled` (plain tensors, DTensors or both)."""
    o = section.options
    coefficients = tuple(float(c) for c in o.ns_coefficients)
    adjust = ADJUST_LR_FN[o.adjust_lr]
    kwargs = {"lr": section.lr, "weight_decay": o.weight_decay, "momentum": o.momentum, "nesterov": o.nesterov,
              "ns_coefficients": coefficients, "eps": EPS, "ns_steps": o.ns_steps, "adjust_lr_fn": adjust}  # fmt: skip
    return ShardedMuon(_width_groups(roled, section) or [r.param for r in roled], **kwargs)


def _width_groups(roled: list[RoledParameter], section: OptimSection) -> list[dict] | None:
    """Param groups by muP width multiplier, or None when every multiplier is 1 (the standard
    parameterization). "match_rms_adamw" makes an update's spectral norm grow as sqrt(max(A, B)), so under muP
    each matrix's rate is divided by sqrt(width_mult) to keep it flat; "spectral" and "none" already keep it
    flat for matrices that grow with the width, and are left alone."""
    if section.options.adjust_lr != "match_rms_adamw" or all(r.width_mult == 1.0 for r in roled):
        return None
    groups: dict[float, dict] = {}
    for r in roled:
        lr = section.lr / math.sqrt(r.width_mult)
        groups.setdefault(r.width_mult, {"params": [], "lr": lr})["params"].append(r.param)
    return list(groups.values())


def build_muon(part: nn.Module, section: OptimSection, device: torch.device,
               mixed_tensor_kinds: bool = False) -> list[torch.optim.Optimizer]:  # fmt: skip
    """Muon over `part`'s hidden matrices and AdamW over the rest (either left out when it has nothing)."""
    muon, rest = muon_roles(parameter_roles(part))
    out: list[torch.optim.Optimizer] = []
    if muon:
        out.append(muon_over(muon, section))
    if rest:
        out.append(adamw_over(rest, section, device, mixed_tensor_kinds))
    return out


def _build(parts: list[nn.Module], section: OptimSection, device: torch.device, mixed: bool) -> list[list]:
    return [build_muon(part, section, device, mixed) for part in parts]


def _step_flops(roled: list[RoledParameter], section: OptimSection) -> float:
    """Newton-Schulz FLOPs of one step over one model part, each matrix orthogonalised once (on one rank)."""
    muon, _ = muon_roles(roled)
    return sum(newton_schulz_flops(*r.param.shape, section.options.ns_steps) for r in muon)


# One fp32 momentum buffer per hidden-matrix parameter; AdamW's two moments for the rest.
MUON = OptimizerPlugin("muon", _build, state_bytes_per_param=8.0, state_bytes_per_role={"hidden": 4.0},
                       step_flops=_step_flops)  # fmt: skip
