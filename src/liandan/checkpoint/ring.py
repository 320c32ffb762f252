"""A short ring of recent training states in this process's host memory, for rolling back without waiting
for a durable checkpoint: every rank copies its own part of the model and optimizer state (a shard under
FSDP or tensor parallelism), its random-number state and a small JSON state, and puts them back in place.
The layout cannot change within a process, so no resharding is needed; nothing here is durable."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from liandan.checkpoint.snapshots import python_rng, set_rng
from liandan.checkpoint.train_state import TrainState


@dataclass
class HeldState:
    step: int
    tensors: dict[str, torch.Tensor]  # host copies, by the names of `state_tensors`
    optimizer_groups: list[dict[str, Any]]
    rng: dict[str, Any]
    state: dict[str, Any]  # the trainer's resume state: schedule, loader, callbacks

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


class StateRing:
    """The newest `size` states this rank was asked to keep, oldest first."""

    def __init__(self, size: int):
        self.held: deque[HeldState] = deque(maxlen=size)

    def keep(self, step: int, model: Any, optimizer: Any, state: dict) -> HeldState:
        """Copy this rank's state at `step` (`model`, `optimizer`: see `TrainState.of`)."""
        kept = TrainState.of(model, optimizer)
        self.held = deque((h for h in self.held if h.step < step), maxlen=self.held.maxlen)  # a rewound run's
        # The state about to drop out lends its buffers: a fresh allocation of the same size every few steps
        # costs page faults on top of the copy.
        spare = self.held[0].tensors if len(self.held) == self.held.maxlen else {}
        tensors = {}
        with torch.no_grad():
            for name, t in kept.tensors():
                buffer = spare.get(name)
                if buffer is not None and buffer.shape == t.shape and buffer.dtype == t.dtype:
                    tensors[name] = buffer.copy_(t.detach())
                else:
                    tensors[name] = t.detach().to("cpu", copy=True)
        held = HeldState(step, tensors, kept.hyperparameters(), python_rng(), state)
        self.held.append(held)
        return held

    def newest_at_or_before(self, step: int) -> HeldState | None:
        return next((h for h in reversed(self.held) if h.step <= step), None)

    def drop_after(self, step: int) -> None:
        self.held = deque((h for h in self.held if h.step <= step), maxlen=self.held.maxlen)

    @property
    def steps(self) -> list[int]:
        return [h.step for h in self.held]


def restore(held: HeldState, model: Any, optimizer: Any) -> dict[str, Any]:
    """Put `held` back into this rank's model and optimizer, in place; returns its JSON state."""
    into = TrainState.of(model, optimizer)
    if not any(name.startswith("optim") for name in held.tensors):
        into.clear_optimizer_state()  # kept before the first update: AdamW had no state yet
    elif into.optimizer_state_empty():
        into.ensure_optimizer_state()  # overwritten below
    targets = dict(into.tensors())
    with torch.no_grad():
        for name, saved in held.tensors.items():
            target = targets.get(name)
            if target is not None and name not in ("rng.torch", "rng.cuda"):
                target.copy_(saved)
    set_rng(held.tensors["rng.torch"], held.tensors.get("rng.cuda"), held.rng)
    into.set_hyperparameters(held.optimizer_groups)
    return held.state
