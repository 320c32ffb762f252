"""What a callback sees of a run: `TrainContext`, handed to every hook instead of the trainer.

It holds the run's settings and place (config, processes, layout, devices, data-parallel coordinates), where
the run has got to (step, tokens, the last step's loss and gradient norm), the components (train module,
loader, tokenizer, stores) and the services a callback may call: the run's records (`room`, `logger`,
`files`, `say`), heartbeats, checkpoints, the rollback service, and a few collectives. Callbacks change the run
only through these services; the trainer's own state is not reachable from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from liandan.checkpoint.manager import CheckpointManager
    from liandan.checkpoint.snapshots import MemorySnapshots
    from liandan.common.layout import Layout
    from liandan.config import Config
    from liandan.run import RunDir
    from liandan.track import MetricsLogger
    from liandan.train.components import Components, StepLoader
    from liandan.train.distributed import DistInfo
    from liandan.train.heartbeat import Heartbeat
    from liandan.train.rollback import Rollback
    from liandan.train.train_module import TrainModule


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    losses: list[float] = field(default_factory=list)
    val_loss: float | None = None
    tokens: int = 0
    seconds: float = 0.0
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepOutput:
    """What the last step did, for the callbacks after it."""

    loss: torch.Tensor  # this rank's mean loss of the step
    grad_norm: float
    lr: float
    skipped: bool  # the update was vetoed by a callback


@dataclass
class RunProgress:
    """Where the run has got to; the trainer moves it, callbacks read it."""

    step: int = 0  # steps completed
    tokens: int = 0  # of every kept step, earlier invocations' included
    last_step: StepOutput | None = None


class TrainContext:
    def __init__(self, parts: Components, progress: RunProgress, result: TrainResult, rollback: Rollback,
                 services: dict[str, Callable[..., Any]], peak_flops: float, peak_flops_dtype: float):  # fmt: skip
        self._parts, self._progress, self._services = parts, progress, services
        self.result = result  # what `train()` returns: callbacks add the losses and validation loss they log
        self.rollback = rollback
        self.peak_flops = peak_flops  # summed over ranks, for MFU
        self.peak_flops_dtype = peak_flops_dtype  # the same at the compute dtype's peak (fp8 aside)
        self._hosts: list[str] | None = None

    # -- the run's settings and place ---------------------------------------------------------------------
    @property
    def cfg(self) -> Config:
        return self._parts.cfg

    @property
    def dist(self) -> DistInfo:
        return self._parts.env.dist

    @property
    def layout(self) -> Layout:
        return self._parts.env.layout

    @property
    def mesh(self) -> Any:
        return self._parts.env.mesh

    @property
    def device(self) -> torch.device:
        return self._parts.env.device

    @property
    def dtype(self) -> torch.dtype:
        return self._parts.env.dtype

    @property
    def dp_rank(self) -> int:
        return self._parts.data.dp_rank

    @property
    def dp_size(self) -> int:
        return self._parts.data.dp_size

    @property
    def micro_batch(self) -> int:
        return self._parts.data.micro_batch

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.train.seq_len

    # -- where the run has got to ---------------------------------------------------------------------------
    @property
    def step(self) -> int:
        return self._progress.step

    @property
    def tokens(self) -> int:
        return self._progress.tokens

    @property
    def last_step(self) -> StepOutput | None:
        return self._progress.last_step

    # -- the components -------------------------------------------------------------------------------------
    @property
    def module(self) -> TrainModule:
        return self._parts.module

    @property
    def loader(self) -> StepLoader | Any:
        return self._parts.data.loader

    @property
    def tokenizer(self) -> Any:
        return self._parts.data.tokenizer

    @property
    def stores(self) -> list[Any]:
        return self._parts.data.stores

    # -- services ---------------------------------------------------------------------------------------------
    @property
    def room(self) -> RunDir:
        return self._parts.room

    @property
    def logger(self) -> MetricsLogger:
        """Metrics and events to every destination (files, console, run store, exporters); rank 0's."""
        return self._services["logger"]()

    @property
    def files(self) -> MetricsLogger:
        """Events to the run's own files and run store only (rank 0's)."""
        return self._parts.files

    def say(self, message: str) -> None:
        """A line on the console (rank 0)."""
        self._parts.say(message)

    @property
    def heartbeat(self) -> Heartbeat:
        return self._parts.heartbeat

    @property
    def checkpoints(self) -> CheckpointManager:
        return self._parts.checkpoints

    @property
    def snapshots(self) -> MemorySnapshots | None:
        return self._parts.snapshots

    def phase(self, name: str, micro: int = 0) -> None:
        """Where the current step has got to (heartbeats)."""
        self._services["phase"](name, micro)

    def notify(self, hook: str, *args: Any) -> None:
        """Call `hook` on every callback (an evaluation's result, say)."""
        self._services["notify"](hook, *args)

    def save_checkpoint(self) -> float:
        """Save the run at this step (in the background when asynchronous); the seconds training was blocked."""
        return self._services["save_checkpoint"]()

    def stop_if_unsaved(self, final: bool) -> None:
        self._services["stop_if_unsaved"](final)

    def stop_for_preemption(self, signum: int) -> None:
        self._services["stop_for_preemption"](signum)

    def resume_state(self) -> dict[str, Any]:
        """What a resume at this step needs besides the tensors (schedule, loader, callbacks' states)."""
        return self._services["resume_state"]()

    def validation_loss(self) -> float | None:
        """The mean loss over `train.eval_batches` validation batches, over all ranks; None, on every rank
        alike, when the stores hold no window out (`data.val_fraction = 0`, or too few windows for the ranks) or
        the loader, one passed from Python, has no `validation`."""
        validation = getattr(self.loader, "validation", None)
        if validation is None:
            return None
        batches = validation(self.cfg.train.eval_batches, self.micro_batch)
        if not batches:
            return None
        return self.mean_over_ranks(self.module.eval_batch(batches))

    def mean_over_ranks(self, value: torch.Tensor) -> float:
        # Tensor-parallel peers hold the same loss, so the mean over all ranks is the mean over data ranks.
        if self.dist.distributed:
            value = value.detach().clone()
            dist.all_reduce(value)
            value /= self.dist.world_size
        return float(value)

    def rank_hosts(self) -> list[str]:
        """The host of each rank, by global rank: one collective the first time any callback asks."""
        if self._hosts is None:
            if self.dist.distributed:
                gathered: list[Any] = [None] * self.dist.world_size
                dist.all_gather_object(gathered, self.heartbeat.host)
                self._hosts = [str(h) for h in gathered]
            else:
                self._hosts = [self.heartbeat.host]
        return self._hosts
