"""The logger seam: the trainer reports step metrics and events through `MetricsLogger`, and anything that
wants them (files, the console, later the run store and the dashboard) implements these three methods."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Protocol

from liandan.run import RunDir, dumps_json, naming


class MetricsLogger(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_event(self, kind: str, **fields: Any) -> None: ...

    def close(self) -> None: ...


class JsonlLogger:
    """metrics.jsonl (one record per logged step) and events.jsonl in the run directory, flushed per line
    so a crash loses nothing already reported. Non-finite numbers are written as null (`dumps_json`)."""

    def __init__(self, run_dir: Path | RunDir):
        room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
        self._metrics = open(room.metrics, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        self._events = open(room.events, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        _append(self._metrics, dumps_json(record))

    def log_event(self, kind: str, **fields: Any) -> None:
        _append(self._events, dumps_json({"time": time.time(), "kind": kind, **fields}))

    def close(self) -> None:
        try:
            with naming(self._metrics.name):
                self._metrics.close()
        finally:
            with naming(self._events.name):
                self._events.close()


def _append(handle, line: str) -> None:
    with naming(handle.name):
        handle.write(line + "\n")
        handle.flush()


class ConsoleLogger:
    """A rich progress bar with the latest loss, throughput and MFU; a plain line every `print_every` steps
    so logs of non-interactive runs (CI, Slurm) still show progress."""

    def __init__(self, total_steps: int, print_every: int = 0, first_step: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from liandan.run.console import make_console

        self.console = make_console(stderr=True)
        self.print_every = print_every or max(1, total_steps // 10)
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=self.console,
            transient=not sys.stderr.isatty(),
        )
        self.task = self.progress.add_task("train", total=total_steps, completed=first_step, status="")
        self.progress.start()

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        status = format_metrics(metrics)
        if not status:  # a record of other keys (the evaluation's) beside the step's training record
            return
        self.progress.update(self.task, completed=step, status=status)
        if step % self.print_every == 0 and not self.console.is_terminal:
            self.console.print(f"step {step}: {status}", highlight=False)

    def log_event(self, kind: str, **fields: Any) -> None:
        if kind == "eval":
            self.progress.console.print(f"step {fields.get('step')}: validation loss {fields.get('loss'):.4f}")

    def close(self) -> None:
        self.progress.stop()


def format_metrics(m: dict[str, float]) -> str:
    parts = []
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "lr" in m:
        parts.append(f"lr {m['lr']:.2e}")
    if "grad_norm" in m:
        parts.append(f"gnorm {m['grad_norm']:.3f}")
    if "tokens_per_s" in m:
        parts.append(f"{m['tokens_per_s']:,.0f} tok/s")
    if "mfu" in m:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "rewards/accuracies" in m:  # a DPO step: the share of pairs preferred rightly, their mean reward margin
        parts.append(f"reward acc {m['rewards/accuracies']:.2f}  margin {m['rewards/margins']:.3f}")
    if "moe/load_max" in m:  # a MoE model's most loaded expert over the mean, of its worst block (1.00: balanced)
        parts.append(f"expert load {m['moe/load_max']:.2f}x")
    return "  ".join(parts)


class FanOut:
    """Several loggers as one."""

    def __init__(self, *loggers: MetricsLogger):
        self.loggers = loggers

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        for lg in self.loggers:
            lg.log_metrics(step, metrics)

    def log_event(self, kind: str, **fields: Any) -> None:
        for lg in self.loggers:
            lg.log_event(kind, **fields)

    def close(self) -> None:
        """Close every logger, even after one failed (its file on a full disk); then raise the first error."""
        errors = []
        for lg in self.loggers:
            try:
                lg.close()
            except OSError as err:
                errors.append(err)
        if errors:
            raise errors[0]


class NullLogger:
    """For ranks other than 0."""

    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def log_event(self, kind: str, **fields: Any) -> None:
        pass

    def close(self) -> None:
        pass


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl; a non-finite value reads as None (null), or as the string "nan"/"inf"
    in files written before null was the convention. A half-written last line is skipped."""
    return RunDir(Path(run_dir)).read_metrics()
