"""What the config's optimizer costs beyond AdamW's flat figure, for `liandan plan`: its state per parameter
where it keeps different amounts for parameters of different roles (Muon: one fp32 momentum buffer for each
hidden matrix, 4 bytes per parameter, and AdamW's 8 for the rest), and the FLOPs of its step beyond
element-wise work (Muon: Newton-Schulz on each hidden matrix). Both are counted on the family's model built on
the meta device (no memory), with the parameters' roles as the optimizer finds them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from liandan.config import Config
from liandan.model.roles import parameter_roles
from liandan.model.spec import get as get_model_spec


@dataclass(frozen=True)
class OptimizerCost:
    name: str
    state_bytes_per_param: float  # over the whole model, the roles' figures weighed by their parameters
    params_by_role: dict[str, int]
    state_bytes_by_role: dict[str, float]  # per parameter of each role
    step_flops: float  # per optimizer step, beyond element-wise work: the whole model's, each matrix once
    step_model_flops: float  # the model's forward and backward FLOPs of one step, for scale

    @property
    def step_share(self) -> float:
        return self.step_flops / self.step_model_flops if self.step_model_flops else 0.0


def optimizer_cost(cfg: Config, args: Any, model_flops_per_step: float) -> OptimizerCost | None:
    """The cost of `cfg`'s optimizer on the model of `args`, or None when its plug-in gives neither per-role
    state nor step FLOPs (AdamW: its flat 8 bytes per parameter say all)."""
    from liandan.train.optimizers import optimizer_plugin

    plugin = optimizer_plugin(cfg.optim.name)
    if not plugin.state_bytes_per_role and plugin.step_flops is None:
        return None
    with torch.device("meta"):
        model = get_model_spec(cfg.model.family).build(args)
    roled = parameter_roles(model)
    counts: dict[str, int] = {}
    for r in roled:
        # A MoE block's stacked (experts, out, in) weights are hidden but not matrices: an optimizer that
        # treats hidden matrices apart (Muon) gives them its default state, so they are counted apart.
        role = r.role if r.param.dim() <= 2 else f"{r.role} {r.param.dim()}-d"
        counts[role] = counts.get(role, 0) + r.param.numel()
    total = sum(counts.values())
    per_role = {role: plugin.state_bytes(role) for role in counts}
    average = sum(per_role[role] * n for role, n in counts.items()) / total if total else plugin.state_bytes_per_param
    flops = float(plugin.step_flops(roled, cfg.optim)) if plugin.step_flops is not None else 0.0
    return OptimizerCost(plugin.name, average, counts, per_role, flops, model_flops_per_step)
