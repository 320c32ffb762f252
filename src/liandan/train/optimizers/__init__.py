"""Optimizers: each is a plug-in (`liandan.plugins`, kind "optimizer", chosen by `[optim] name`) that builds the
torch optimizers of a train module's model parts; `OptimizersContainer` steps, zeroes, schedules, clips and
checkpoints them as one. AdamW (`adamw.py`) and Muon (`muon.py`, with AdamW for what is not a hidden matrix)
are liandan's own."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from liandan.config import ConfigError, OptimSection
from liandan.plugins import PluginError, find

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class OptimizerPlugin:
    """One optimizer. `build(parts, section, device, mixed_tensor_kinds)` returns, for each model part, the torch
    optimizers of its trainable parameters (every parameter in exactly one); `section.options` is the plug-in's
    own config table. `mixed_tensor_kinds`: the parameters mix DTensors of different meshes and plain tensors
    (tensor parallelism), which multi-tensor kernels cannot take in one call. `state_bytes_per_param`: the
    optimizer state it keeps per parameter, for `liandan plan`; `state_bytes_per_role`, where parameters of
    some roles (`liandan.model.roles`: "embedding", "head", "hidden", "vector") keep another amount.
    `step_flops(roled, section)`: the FLOPs of one step beyond element-wise work (Muon's Newton-Schulz), from
    the parameters of one model part (meta tensors will do); None for none. `options`: the dataclass of its
    config table."""

    name: str
    build: Callable[[list[Any], OptimSection, Any, bool], list[list[Any]]]
    state_bytes_per_param: float
    options: type | None = None  # its `[optim.<name>]` table, when its registration does not name one
    state_bytes_per_role: dict[str, float] | None = None
    step_flops: Callable[[list[Any], OptimSection], float] | None = None

    def state_bytes(self, role: str) -> float:
        """Bytes of optimizer state per parameter of `role`."""
        return (self.state_bytes_per_role or {}).get(role, self.state_bytes_per_param)


def optimizer_plugin(name: str) -> OptimizerPlugin:
    try:
        return find("optimizer", name, what="optim.name").load()
    except PluginError as err:
        raise ConfigError(str(err)) from None


def build_optimizers(parts: list[torch.nn.Module], section: OptimSection, schedule: Callable[[int], float],
                     device: torch.device, mixed_tensor_kinds: bool = False) -> Any:  # fmt: skip
    """The optimizers `[optim]` names for `parts`, in one container with the learning-rate `schedule`."""
    from liandan.train.optimizers.container import OptimizersContainer

    per_part = optimizer_plugin(section.name).build(parts, section, device, mixed_tensor_kinds)
    return OptimizersContainer(parts, per_part, schedule, section.grad_clip)


def schedule(total_steps: int, section: Any) -> Callable[[int], float]:
    """The learning-rate multiplier of step `step` under `[schedule]` (warmup, then cosine, linear, WSD or
    constant), for every optimizer's groups alike."""
    from liandan.common.schedule import lr_multiplier

    return lambda step: lr_multiplier(step, total_steps, section)
