"""What each trainable parameter of a model part is, for optimizers that treat kinds of parameters apart
(Muon orthogonalises the hidden matrices only; muP scales learning rates by role and width).

Roles are found by module, not by name, so they survive the wrappers parallelism adds (FSDP2, activation
checkpointing, compiled blocks rename parameters but keep the modules):
- "embedding": the weight of an `nn.Embedding` (the head's too, when the two are tied);
- "head": the parameters of the module the family's spec names as its head (the output projection);
- "hidden": every other parameter of two or more dimensions (the blocks' matrices);
- "vector": the rest (norm weights, biases).

`width_mult` is the parameter's fan-in over its fan-in in the base model its parameterization was tuned at
(`[model] parameterization = "mup"`); 1.0 under the standard parameterization, where no scale changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torch import nn

Role = Literal["embedding", "head", "hidden", "vector"]


@dataclass(frozen=True)
class RoledParameter:
    name: str
    param: nn.Parameter
    role: Role
    width_mult: float = 1.0


def parameter_roles(part: nn.Module) -> list[RoledParameter]:
    """Every trainable parameter of `part` once (a tied weight under its first role), in registration order."""
    from liandan.model.spec import spec_for

    args = getattr(part, "args", None)
    try:
        head_name = spec_for(args).head if args is not None else None
    except (KeyError, ValueError, LookupError):
        head_name = None
    head = _submodule(part, head_name)
    owner: dict[int, Role] = {}
    for module in part.modules():
        if isinstance(module, nn.Embedding):
            owner.setdefault(id(module.weight), "embedding")
    if head is not None:
        for p in head.parameters():
            owner.setdefault(id(p), "head")
    widths = getattr(part, "width_mults", None)
    mults = widths() if callable(widths) else {}
    out, seen = [], set()
    for name, p in part.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        role = owner.get(id(p)) or ("hidden" if p.dim() >= 2 else "vector")
        out.append(RoledParameter(name, p, role, float(mults.get(id(p), 1.0))))
    return out


def _submodule(part: nn.Module, name: str | None) -> nn.Module | None:
    if not name:
        return None
    try:
        return part.get_submodule(name)
    except AttributeError:
        return None
