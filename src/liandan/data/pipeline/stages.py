"""The pipeline as a list of stages over one small protocol.

A `Stage` has a name, the files it reads (`inputs`) and writes (`outputs`), and `run`, which writes those
outputs and returns a small JSON-able result: its statistics. A stage runs once, or (`per_task`) once per
input file, the tasks in parallel on the executor. When a stage or task has finished, its result is written
to its done marker (`PipelineLayout.done`), last, so a marker's presence means every output is whole.

Resume follows from the markers:
- a stage or task with a marker is skipped, its result read back from the marker;
- one without a marker is redone from a clean state: its outputs (and the temporaries of a writer killed
  midway) are removed first;
- once any stage or task is redone, every later stage is redone too: its input may have changed.

Faults for the recovery tests fire at point `<stage>` (task index, 0 for a whole stage): after the outputs
are written, before the marker.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from liandan.data.pipeline.layout import PipelineLayout, Task
from liandan.faults import maybe_inject
from liandan.run import atomic_write
from liandan.run.files import temporary

if TYPE_CHECKING:
    from liandan.data.pipeline.executor import Executor
    from liandan.data.pipeline.pipeline_config import PipelineConfig


def _silent(message: str) -> None:
    pass


@dataclass
class StageContext:
    """What a stage sees: the config, the layout, the tasks, and the results of the stages before it (a list in
    task order for a per-task stage)."""

    cfg: PipelineConfig
    layout: PipelineLayout
    tasks: list[Task]
    results: dict[str, Any] = field(default_factory=dict)
    say: Callable[[str], None] = print

    def for_workers(self) -> StageContext:
        return dataclasses.replace(self, say=_silent)  # `say` may be a lambda, which does not pickle


class Stage:
    """Base of the pipeline's stages. Subclasses set `name`, `about` and `per_task`, and implement `run` and
    `outputs` (and `inputs`, for the plan)."""

    name: ClassVar[str] = "stage"
    about: ClassVar[str] = ""
    per_task: ClassVar[bool] = False

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return []

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        """Every file or folder the stage (or task) writes: removed before it is redone."""
        raise NotImplementedError

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<stage {self.name}>"


# -- done markers ------------------------------------------------------------------------------------------------
def _marker_task(task: Task | None) -> dict[str, Any] | None:
    return dataclasses.asdict(task) if task is not None else None


def finished(layout: PipelineLayout, stage: Stage, task: Task | None = None) -> dict[str, Any] | None:
    """The result in the stage's (or task's) done marker, or None when it has not finished. A marker left by
    another task under the same name (the input files changed) does not count."""
    path = layout.done(stage.name, task)
    try:
        marker = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    if marker.get("stage") != stage.name or marker.get("task") != _marker_task(task):
        return None
    return marker["result"]


def _clear(path: Path) -> None:
    for target in (Path(path), temporary(Path(path))):
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        else:
            with contextlib.suppress(FileNotFoundError):
                target.unlink()


def run_one(stage: Stage, ctx: StageContext, task: Task | None) -> dict[str, Any]:
    """Run a stage (or one of its tasks) from a clean state and mark it done. Top-level, so executors can ship
    it to worker processes and Ray."""
    for path in stage.outputs(ctx, task):
        _clear(path)
    result = stage.run(ctx, task)
    maybe_inject(stage.name, task.index if task is not None else 0)
    marker = {"stage": stage.name, "task": _marker_task(task), "result": result}
    path = ctx.layout.done(stage.name, task)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, (json.dumps(marker, indent=2, ensure_ascii=False) + "\n").encode(), durable=False)
    return result


def _forget(layout: PipelineLayout, stage: Stage, tasks: Sequence[Task]) -> None:
    for task in tasks if stage.per_task else [None]:
        layout.done(stage.name, task).unlink(missing_ok=True)


def run_stages(stages: Sequence[Stage], ctx: StageContext, executor: Executor) -> dict[str, Any]:
    """Run the stages in order, skipping what has finished; returns every stage's result by name."""
    redone = False
    for stage in stages:
        if redone:
            _forget(ctx.layout, stage, ctx.tasks)
        if stage.per_task:
            results = [finished(ctx.layout, stage, t) for t in ctx.tasks]
            pending = [t for t, r in zip(ctx.tasks, results) if r is None]
            if pending:
                worker_ctx = ctx.for_workers()
                ran = executor.map(run_one, [(stage, worker_ctx, t) for t in pending], stage.name)
                for task, result in zip(pending, ran):
                    results[task.index] = result
                redone = True
            ctx.results[stage.name] = results
        else:
            result = finished(ctx.layout, stage)
            if result is None:
                result = run_one(stage, ctx, None)
                redone = True
            ctx.results[stage.name] = result
    return ctx.results


# -- the plan -----------------------------------------------------------------------------------------------------
def describe(stages: Sequence[Stage], ctx: StageContext, shown: int = 3) -> list[str]:
    """The stage list as `liandan data run --dry-run` prints it: each stage, how it runs, how much of it has
    finished, what it does, and the files it reads and writes."""
    layout = ctx.layout
    lines = [f"{len(ctx.tasks)} input file(s) from {len(ctx.cfg.inputs)} source(s) -> {layout.root}"]

    def listing(paths: list[Path]) -> str:
        names = list(dict.fromkeys(layout.relative(p) for p in paths))
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        return ", ".join(names[:shown]) + more

    stale = False
    for number, stage in enumerate(stages, 1):
        units: list[Task | None] = list(ctx.tasks) if stage.per_task else [None]
        done = 0 if stale else sum(finished(layout, stage, t) is not None for t in units)
        stale = stale or done < len(units)
        runs = f"per input file ({len(units)} tasks)" if stage.per_task else "once"
        state = "done" if done == len(units) else (f"{done} of {len(units)} done" if done else "to run")
        lines.append(f"{number}. {stage.name:<10} {runs:<26} {state:<14} {stage.about}")
        reads = [p for t in units for p in stage.inputs(ctx, t)]
        writes = [p for t in units for p in stage.outputs(ctx, t)]
        if reads:
            lines.append(f"   {'reads':<10} {listing(reads)}")
        lines.append(f"   {'writes':<10} {listing(writes)}")
    return lines
