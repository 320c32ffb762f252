"""The train module protocol: what one step does to the model parts, behind one interface the trainer, the
checkpoints, the loss-spike guard, the silent-data-corruption checks and evaluation all work on.

A train module owns its model parts (`model_parts`: one model, the stages of a pipeline, a policy and a frozen
reference) and their optimizers (`optimizers`, one container however many there are). The trainer hands it the
micro-batches of each step and never looks inside: dense causal-LM pretraining (`causal_lm.py`) is one
implementation, and a new kind of training (SFT, DPO, a pipeline schedule) is another, passed to the trainer
from Python (`build_components(cfg, module=...)`) or built from the config.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from liandan.data.tokens.loader import Batch
from liandan.train.optimizers.container import OptimizersContainer

PhaseHook = Callable[..., None]  # (phase, micro=0): where a step has got to, for heartbeats


class TrainModule(ABC):
    model_parts: list[torch.nn.Module]
    optimizers: OptimizersContainer

    # What the trainer records about the module; a module that cannot say leaves the defaults.
    spec: Any = None  # the model family's spec (liandan.model.spec.ModelSpec): checkpoint metadata, export
    args: Any = None  # the family's args (a dataclass): checkpoint metadata, init_from and resume checks
    params: Any = None  # liandan.model.spec.ParamCounts
    flops_per_token: float = 0.0  # training FLOPs per token, for MFU (0: MFU is not reported)
    fp8_share: float = 0.0  # of those FLOPs, the share run in fp8
    attention: str = "built in"  # the attention kernel, for the start-up line
    autocast: bool = False  # forward passes run under torch.autocast (evaluation copies it)
    init_peak: Any = None  # liandan.train.hardware.PeakMemory of building the model, when measured
    allreduce_audit: Any = None  # the audited DDP all-reduce hook, when the sdc check reads it
    routing: Any = None  # liandan.model.moe.RoutingStats of the last step, for a model with routed experts

    # -- a step ---------------------------------------------------------------------------------------------
    @abstractmethod
    def train_batch(self, batches: list[Batch], phase: PhaseHook, step: int) -> torch.Tensor:
        """Forward and backward over the micro-batches of step `step` (counted from 1), gradients synchronised
        over data-parallel ranks at the end; returns this rank's mean loss of the step, detached."""

    @abstractmethod
    def eval_batch(self, batches: list[Batch]) -> torch.Tensor:
        """Mean loss over `batches` in eval mode, without gradients (this rank's; the caller averages)."""

    def replay_loss(self, batches: list[Batch], step: int) -> torch.Tensor:
        """The mean loss `train_batch` would give on `batches` at step `step`, by forward passes alone in the
        same arithmetic, leaving gradients and weights alone (the sdc check's replays on a neighbour)."""
        raise NotImplementedError(f"{type(self).__name__} cannot replay a step")

    def clip_grad_norm(self) -> float:
        """The global gradient norm over every part, clipped to `optim.grad_clip`."""
        return self.optimizers.clip_grad_norm()

    def optim_step(self, factor: float = 1.0) -> None:
        """The update (at the scheduled learning rate times `lr_scale`, times `factor` for this step only)."""
        self.optimizers.step(factor)

    def skip_step(self) -> None:
        """No update this step; the schedule moves on as if there had been one."""
        self.optimizers.skip()

    def zero_grad(self) -> None:
        self.optimizers.zero_grad()

    @property
    def lr(self) -> float:
        return self.optimizers.lr

    @property
    def lr_scale(self) -> float:
        """A factor on the scheduled learning rate (the loss-spike guard lowers it after a rollback)."""
        return self.optimizers.lr_scale

    @lr_scale.setter
    def lr_scale(self, value: float) -> None:
        self.optimizers.lr_scale = value

    def train(self, mode: bool = True) -> None:
        for part in self.model_parts:
            part.train(mode)

    def autocasting(self) -> contextlib.AbstractContextManager:
        """The autocast context forward passes run in (a null context without autocast)."""
        return contextlib.nullcontext()

    # -- what a checkpoint holds besides the tensors of the parts and optimizers ----------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: the learning-rate schedule, and whatever else an implementation keeps."""
        return {"scheduler": self.optimizers.scheduler_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizers.load_scheduler_state(state["scheduler"])

    def whole_model(self) -> torch.nn.Module | None:
        """The one model part when the module has one and its family is known: what layer statistics, probes
        and evaluation need; None otherwise (they are then left out, said once by whoever leaves them out)."""
        return self.model_parts[0] if len(self.model_parts) == 1 and self.spec is not None else None

    @property
    def model(self) -> torch.nn.Module:
        """The one model part, for what needs a whole model (evaluation, layer statistics); a ValueError for a
        module of several parts, which such code must handle part by part."""
        if len(self.model_parts) != 1:
            raise ValueError(f"{type(self).__name__} has {len(self.model_parts)} model parts, not one model")
        return self.model_parts[0]
