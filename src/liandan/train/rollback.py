"""The rollback service: the ring of recent training states in this process's memory, and going back to one of
them or to a durable checkpoint. The loss-spike guard keeps states and rolls back past a spike; the
silent-data-corruption check rolls back past a fault to the newest state it verified; neither knows the other.

A rollback is two moves: the train module's tensors are put back (model parts and optimizers, this rank's own
shards) and the run is rewound to the state's step (schedule, loader, callbacks' states, token count, metrics).
Callbacks that must carry something across a rewind (the guard's detector history, which describes the run,
not the state) register `around_restore` hooks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from liandan.checkpoint.ring import HeldState, StateRing, restore

# (before) -> after: called before a restore; what it returns is called after, with the restored step
AroundRestore = Callable[[], Callable[[int], None]]


class Rollback:
    def __init__(self, module: Any, checkpoints: Any, step: Callable[[], int],
                 resume_state: Callable[[], dict[str, Any]], rewind: Callable[[int, dict[str, Any]], None],
                 ring_size: int = 0):  # fmt: skip
        self.module = module
        self.checkpoints = checkpoints
        self._step, self._resume_state, self._rewind = step, resume_state, rewind
        self.ring = StateRing(ring_size)  # 0: nothing is kept (no loss-spike guard)
        # The step just taken is about to be undone: callbacks after the one that decided it should not save,
        # evaluate or stop on it (see Callback.on_step_end).
        self.pending = False
        # A verdict on the step just taken is still open (a loss over a threshold, not yet a spike): a state of
        # it must not be saved, since the next steps may undo it and a resume from it would not.
        self.unsettled = False
        self._around: list[AroundRestore] = []

    def around_restore(self, hook: AroundRestore) -> None:
        """Call `hook()` before every restore and what it returns, with the restored step, after it."""
        self._around.append(hook)

    # -- the ring -------------------------------------------------------------------------------------------
    def keep(self) -> HeldState:
        """Copy this rank's state at the current step into the ring (the oldest drops out)."""
        return self.ring.keep(self._step(), self.module.model_parts, self.module.optimizers, self._resume_state())

    @property
    def held_steps(self) -> list[int]:
        return self.ring.steps

    def newest_at_or_before(self, step: int) -> HeldState | None:
        return self.ring.newest_at_or_before(step)

    # -- going back -------------------------------------------------------------------------------------------
    def restore(self, held: HeldState) -> None:
        """Put `held` back and rewind the run to its step."""
        after = [hook() for hook in self._around]
        restore(held, self.module.model_parts, self.module.optimizers)
        self._rewind(held.step, held.state)
        for hook in after:
            hook(held.step)

    def load_checkpoint(self, path: Path) -> HeldState:
        """Load the checkpoint at `path`, rewind the run to its step, and keep that state in the ring (so that
        going back there again costs no read)."""
        after = [hook() for hook in self._around]
        meta = self.checkpoints.load(path, self.module.model_parts, self.module.optimizers)
        self._rewind(int(meta["step"]), meta)
        for hook in after:
            hook(int(meta["step"]))
        return self.keep()

    def to_verified(self, at_or_before: int) -> HeldState | None:
        """Go back to the newest state held at or before step `at_or_before`, replaying the same data (for a
        fault of the hardware, not of the data), and forget the states after it. None when none is held."""
        target = self.ring.newest_at_or_before(at_or_before)
        if target is None:
            return None
        self.restore(target)
        self.ring.drop_after(target.step)
        return target
