"""What `liandan eval` is doing while it works, on stderr (stdout keeps the results): a progress bar over every
request it scores, with the time left, where stderr is a terminal; elsewhere (CI, Slurm, a pipe) a plain line
as each task's format begins and as each later stage (held-out loss, contamination) begins."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.markup import escape  # "task [format]" is not markup


class EvalProgress:
    def __init__(self, total: int, *, show: bool = True, name: str = "eval", unit: str = "requests scored"):
        """`total`: the requests to score (`runner.task_requests` summed over the tasks); `show` False
        keeps it silent (the ranks but the first). `name` heads the bar and each line, `unit` says what is
        counted (`liandan prefs` counts samples drawn)."""
        self.total, self.done, self.show = total, 0, show
        self.name, self.unit = name, unit
        self.started = time.perf_counter()
        self.bar: Any = None
        if show and sys.stderr.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            from liandan.run.console import make_console

            self.bar = Progress(
                TextColumn(f"[bold]{escape(name)}"),
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeRemainingColumn(),
                console=make_console(stderr=True),
                transient=True,
            )
            self.task = self.bar.add_task("", total=max(total, 1))
            self.bar.start()

    def begin(self, label: str) -> None:
        """A task's format starts (`label`: "task [format]")."""
        if self.bar is not None:
            self.bar.update(self.task, description=escape(label))
        elif self.show:
            self._say(f"{self.name} {label}: {self.done:,}/{self.total:,} {self.unit}{self._time_left()}")

    def advance(self, requests: int) -> None:
        self.done += requests
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done)

    def stage(self, label: str) -> None:
        """A stage that is not counted in requests begins."""
        if self.bar is not None:
            self.bar.update(self.task, description=escape(label))
        elif self.show:
            self._say(f"{self.name}: {label}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def _time_left(self) -> str:
        elapsed = time.perf_counter() - self.started
        if not self.done or self.done >= self.total:
            return f", {elapsed:.0f}s so far"
        left = elapsed * (self.total - self.done) / self.done
        return f", {elapsed:.0f}s so far, about {left:.0f}s left"

    @staticmethod
    def _say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
