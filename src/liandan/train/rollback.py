"""The rollback service: the ring of recent training states in this process's memory, and going back to one of
them or to a durable checkpoint. The loss-spike guard keeps states and rolls back past a spike; the
silent-data-corruption check rolls back past a fault to the newest state it verified; neither knows the other.

A rollback is two moves: the train module's tensors are put back (model parts and optimizers, this rank's own
shards) and the run is rewound to the state's step (schedule, loader, callbacks' states, token count, metrics).
Callbacks that must carry something across a rewind (the guard's detector history, which describes the run,
not the state) register `around_restore` hooks.
"""

from __future__ import annotations

import os
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


# Of the host memory available at the start, the share the rings of a host's ranks may take together: the
# rest is for the data loader, the staging of checkpoint saves and memory snapshots, and everything else.
RING_SHARE = 0.5


def state_bytes(model_parts: list[Any], optimizer_state: Callable[[str], float] | None = None) -> int:
    """About what one state of the ring holds on this rank: its shards of the parameters and the optimizer's
    state of each, by the parameter's role (`optimizer_state(role)`: bytes per parameter, e.g. AdamW's two
    fp32 moments, 8, or Muon's one momentum of a hidden matrix, 4); the optimizer has no state yet when this
    is asked. Without `optimizer_state`, two moments of the parameter's own size."""
    from liandan.model.roles import parameter_roles

    total = 0
    for part in model_parts:
        for r in parameter_roles(part):
            local = r.param.to_local() if hasattr(r.param, "to_local") else r.param
            per = optimizer_state(r.role) if optimizer_state else 2 * local.element_size()
            total += int(local.numel() * (local.element_size() + per))
    return total


def available_host_memory() -> int | None:
    """Bytes of host memory available now (Linux's MemAvailable), or None where it cannot be told."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def ring_refusal(ring_size: int, each: int, available: int | None, ranks_on_host: int) -> str | None:
    """Why `guard.ring_size` states of `each` bytes per rank cannot be kept in host memory (one line), or None."""
    if not ring_size or available is None or each <= 0:
        return None
    budget = RING_SHARE * available / max(1, ranks_on_host)
    if ring_size * each <= budget:
        return None
    fit = int(budget // each)
    most = f"at most {fit} fit" if fit else "not even one fits: turn the guard off with guard.enabled = false"
    return (f"guard.ring_size = {ring_size} keeps that many copies of each rank's training state in host memory"
            f" (about {each / 1e6:,.1f} MB each, {ring_size * each / 1e9:,.1f} GB), more than half of the"
            f" {available / 1e9:,.1f} GB available to this host's {ranks_on_host} rank(s): {most}")  # fmt: skip


def ranks_on_this_host(world_size: int) -> int:
    """How many ranks share this host's memory: the launcher's LOCAL_WORLD_SIZE, else all of them."""
    try:
        return int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    except ValueError:
        return world_size
