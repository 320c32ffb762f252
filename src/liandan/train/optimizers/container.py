"""Several optimizers as one: the train module's optimizers, whichever optimizer plug-in made them and however
many model parts they serve. Steps, zeroes, schedules (one learning-rate schedule, a multiplier of every group's
own peak), clips (one global gradient norm over every part and group) and saves them as one."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from liandan.checkpoint.train_state import parts_parameters


class OptimizersContainer:
    def __init__(self, parts: list[torch.nn.Module], per_part: list[list[torch.optim.Optimizer]],
                 schedule: Callable[[int], float], grad_clip: float = 0.0):  # fmt: skip
        if len(per_part) != len(parts):
            raise ValueError(f"{len(per_part)} lists of optimizers for {len(parts)} model parts")
        self.parts = parts
        self.per_part = per_part
        self.optimizers = [o for opts in per_part for o in opts]
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in self.optimizers]
        self.grad_clip = grad_clip
        self.lr_scale = 1.0  # on top of the schedule; the loss-spike guard lowers it after a rollback
        # The process group over which the parts are split (pipeline stages): the gradient norm sums the
        # squares of every rank in it. None: this rank holds every part.
        self.norm_group: Any = None

    def __iter__(self) -> Iterator[torch.optim.Optimizer]:
        return iter(self.optimizers)

    def __len__(self) -> int:
        return len(self.optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def lr(self) -> float:
        """The learning rate of the first group as it stands now, `lr_scale` included (for logging)."""
        return self.schedulers[0].get_last_lr()[0] * self.lr_scale

    def step(self, factor: float = 1.0) -> None:
        """The update at the scheduled learning rate times `lr_scale` (and `factor`, for this step only), then
        the schedule moves on and the gradients are dropped."""
        for optimizer, scheduler in zip(self.optimizers, self.schedulers, strict=True):
            for group, scheduled in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=True):
                lr = scheduled * self.lr_scale * factor
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            optimizer.step()
        self._advance()

    def skip(self) -> None:
        """Throw this step's gradients away; the schedule moves on as if the update had been made, so the
        learning rate of every later step stays what the config says."""
        self._advance()

    def _advance(self) -> None:
        for scheduler in self.schedulers:
            scheduler.step()
        self.zero_grad()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, max_norm: float | None = None) -> float:
        """The global gradient norm over every parameter of every part, clipped to `max_norm` (by default the
        config's `optim.grad_clip`; 0 or inf: measure only)."""
        limit = self.grad_clip if max_norm is None else max_norm
        return clip_grad_norm(parts_parameters(self.parts), limit or float("inf"), self.norm_group)

    # -- what a checkpoint keeps besides the tensors -------------------------------------------------------
    def scheduler_state(self) -> Any:
        """The schedulers' state: one scheduler's own dict (as checkpoints held before there were several)."""
        states = [s.state_dict() for s in self.schedulers]
        return states[0] if len(states) == 1 else states

    def load_scheduler_state(self, state: Any) -> None:
        states = state if isinstance(state, list) else [state] * len(self.schedulers)
        if len(states) != len(self.schedulers) and all(one == states[0] for one in states):
            # One schedule over every optimizer: a checkpoint of another number of model parts (pipeline
            # stages per rank) holds as many copies of it as it had optimizers.
            states = [states[0]] * len(self.schedulers)
        if len(states) != len(self.schedulers):
            raise ValueError(f"{len(states)} scheduler states for {len(self.schedulers)} optimizers")
        for scheduler, one in zip(self.schedulers, states, strict=True):
            scheduler.load_state_dict(one)


def clip_grad_norm(parameters, max_norm: float, group: Any = None) -> float:
    """Global gradient norm over all parameters, clipped to `max_norm` (inf: measure only); with `group`,
    over the parameters of every rank of that process group (pipeline stages), the same on each.

    Under FSDP and tensor parallelism gradients are DTensors on different meshes (2-D for sharded matrices,
    1-D for sharded norms) or plain tensors (norm weights replicated by tensor parallelism alone), which a
    single foreach norm cannot mix; each group is reduced on its own mesh and the squares are summed.
    """
    groups: dict[object, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p.grad)
    if not groups and group is None:
        return 0.0
    squares = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        squares += float(norm) ** 2
    if group is not None:
        import torch.distributed as dist

        summed = torch.tensor(squares, dtype=torch.float64, device=_device_of(groups))
        dist.all_reduce(summed, group=group)
        squares = float(summed)
    total = math.sqrt(squares)
    if total > max_norm:
        coef = max_norm / (total + 1e-6)
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def _device_of(groups: dict[object, list[torch.Tensor]]) -> torch.device:
    """Where the gradients are (the device collectives run on); the CPU for a rank that holds none."""
    for grads in groups.values():
        return grads[0].device
    return torch.device("cpu")
