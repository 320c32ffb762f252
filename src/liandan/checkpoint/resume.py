"""The one resume decision, taken by the trainer (every rank, before training) and by the supervisor
(before a restart, to count the steps a failure cost and to hand over its checkpoint verdict)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from liandan.checkpoint.verify import step_of


@dataclass(frozen=True)
class ResumePoint:
    source: Literal["memory", "checkpoint", "none"]
    step: int
    path: Path | None = None  # the checkpoint, when the source is one


def choose_resume(
    memory_step: int | None, newest_complete_step: int | None, newest_verified: Callable[[], Path | None]
) -> ResumePoint:
    """Where a run continues: the memory snapshot that every rank holds when it is at least as new as the
    newest complete checkpoint (then no checkpoint is read, let alone verified); else the newest checkpoint
    that verifies (`newest_verified` is called only then), or the snapshot if that one is newer still; else
    nothing: the run starts from step 0."""
    if memory_step is not None and memory_step >= (newest_complete_step or 0):
        return ResumePoint("memory", memory_step)
    path = newest_verified()
    durable = step_of(path) if path is not None else None
    if memory_step is not None and (durable is None or memory_step > durable):
        return ResumePoint("memory", memory_step)
    if path is not None and durable is not None:
        return ResumePoint("checkpoint", durable, path)
    return ResumePoint("none", 0)


def can_resume(complete: list[Path], memory_step: int | None) -> bool:
    """Whether a run has somewhere to continue from, judged before anything is verified or loaded (a run
    directory is claimed before its checkpoints are read): `choose_resume`, with the newest of the `complete`
    checkpoints standing in for the newest that verifies."""
    newest = complete[-1] if complete else None
    return choose_resume(memory_step, step_of(newest) if newest else None, lambda: newest).source != "none"
