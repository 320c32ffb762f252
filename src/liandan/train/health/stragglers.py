"""Stragglers: a callback that times each rank's phases of a step and names a rank that is persistently
slower than the others.

Each rank adds up the wall time it spends in each phase (`on_phase`: data, forward, backward, optimizer,
collective) over a window of `straggler_every` steps; at the window's end one all-gather of a few numbers
gives every rank every rank's mean per step. Only the phases in which a rank waits for nobody are judged:
loading data, and the forward pass (the compute) where it holds no collective (DDP, or one rank). A slow
rank's peers wait for it inside the collectives of backward and the optimizer step, so their time there
grows, not in forward: the straggler is the one whose own phase is slow while the others' is normal. A rank
whose time in a judged phase is `straggler_ratio` times the median of the other ranks' (and
`straggler_min_s` above it) is over the threshold; over it in `straggler_windows` windows in a row, it is a
straggler: a "straggler" event names rank, host, phase and its time against the median. Rank 0 keeps every
window's times of every rank in `rank-times.jsonl` (the dashboard's step-time heat map), one process too. With
`health.exclude_stragglers`, a supervisor of several nodes excludes the straggler's node when the run next
restarts.
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from liandan.common.layout import uses_fsdp
from liandan.config import Config, HealthSection
from liandan.run import append_jsonl
from liandan.train.callbacks import Callback
from liandan.train.health.ranks import gather_rows

if TYPE_CHECKING:
    from liandan.train.context import TrainContext

TIMED = ("data", "forward", "backward", "optimizer", "collective")
NAMES = {"data": "data", "forward": "compute", "backward": "backward and gradient sync",
         "optimizer": "optimizer and step collectives", "collective": "collectives"}  # fmt: skip


class StragglerCallback(Callback):
    order = 16  # after the heartbeats: their writes belong to the phase they start

    def __init__(self, cfg: HealthSection):
        self.cfg = cfg
        self.hosts: list[str] = []
        self.judged: tuple[str, ...] = ("data", "forward")
        self.seconds = dict.fromkeys(TIMED, 0.0)
        self.steps = 0
        self.current: tuple[str, float] | None = None
        self.streaks: dict[tuple[int, str], int] = {}

    def on_train_start(self, ctx: TrainContext) -> None:
        self.hosts = ctx.rank_hosts()
        # FSDP's all-gathers and tensor parallelism's collectives sit inside forward: peers wait there too.
        if uses_fsdp(ctx.layout) or ctx.layout.tp > 1:
            self.judged = ("data",)
            ctx.say(f"stragglers: layout {ctx.layout} has collectives inside forward: only data loading "
                        "is compared across ranks")  # fmt: skip

    def on_phase(self, ctx: TrainContext, step: int, phase: str, micro: int) -> None:
        now = time.perf_counter()
        if self.current is not None and self.current[0] in self.seconds:
            self.seconds[self.current[0]] += now - self.current[1]
        self.current = (phase, now)

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        if self.current is not None and self.current[0] in self.seconds:  # the update ends with the step
            self.on_phase(ctx, step, "step_end", 0)
        self.current = None
        self.steps += 1
        if step % self.cfg.straggler_every or ctx.rollback.pending:
            return
        mine = [self.seconds[p] / self.steps for p in TIMED]
        self.seconds, self.steps = dict.fromkeys(TIMED, 0.0), 0
        if ctx.dist.distributed:
            rows = [r.tolist() for r in gather_rows(torch.tensor(mine, dtype=torch.float64, device=ctx.device))]
        else:
            rows = [mine]
        if ctx.dist.is_main:
            self._record(ctx, step, rows)
        if ctx.dist.distributed:
            self._judge(ctx, step, rows)

    def _record(self, ctx: TrainContext, step: int, rows: list[list[float]]) -> None:
        """The window's times of every rank, for the dashboard's heat map: one short line per window."""
        record = {"step": step, "time": round(time.time(), 3), "window_steps": self.cfg.straggler_every,
                  "phases": list(TIMED), "hosts": self.hosts,
                  "seconds": [[round(v, 6) for v in row] for row in rows]}  # fmt: skip
        append_jsonl(ctx.room.rank_times, record)

    def _judge(self, ctx: TrainContext, step: int, rows: list[list[float]]) -> None:
        c = self.cfg
        for phase in self.judged:
            column = TIMED.index(phase)
            for rank, row in enumerate(rows):
                others = statistics.median(r[column] for i, r in enumerate(rows) if i != rank)
                mine = row[column]
                over = mine > c.straggler_ratio * others and mine - others > c.straggler_min_s
                key = (rank, phase)
                self.streaks[key] = self.streaks.get(key, 0) + 1 if over else 0
                if self.streaks[key] == c.straggler_windows:
                    self._report(ctx, step, rank, phase, mine, others, row)

    def _report(self, ctx: TrainContext, step: int, rank: int, phase: str, mine: float, median: float,
                row: list[float]) -> None:  # fmt: skip
        event = {"step": step, "rank": rank, "host": self.hosts[rank], "phase": NAMES[phase],
                 "seconds": round(mine, 6), "median_seconds": round(median, 6),
                 "ratio": round(mine / median, 2) if median > 0 else None, "windows": self.cfg.straggler_windows,
                 "window_steps": self.cfg.straggler_every,
                 "phases": {NAMES[p]: round(v, 6) for p, v in zip(TIMED, row, strict=True)}}  # fmt: skip
        if ctx.dist.is_main:
            ctx.files.log_event("straggler", **event)
        times = f"{1000 * mine:.1f} ms per step against the others' median {1000 * median:.1f} ms"
        ctx.say(f"stragglers: rank {rank} on {self.hosts[rank]} is slow in {NAMES[phase]}: {times}, "
                    f"{self.cfg.straggler_windows} windows of {self.cfg.straggler_every} steps in a row")  # fmt: skip


def _stragglers(cfg: Config) -> Callback | None:
    return StragglerCallback(cfg.health) if cfg.health.stragglers else None
