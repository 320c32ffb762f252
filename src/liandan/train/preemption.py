"""Stopping for preemption: SIGTERM (what Slurm and Kubernetes send), SIGINT (Ctrl-C) or the supervisor's
request (SIGUSR2) makes a worker save a checkpoint and exit with 128 + the signal's number, rather than die
mid-write. It has a grace period to do so: the supervisor's `resilience.preempt_grace_s`, handed over in
$LIANDAN_PREEMPT_GRACE_S, counted from the moment the signal arrives (a worker without a supervisor takes
its own config's).

The ranks get the signal at different moments, in different parts of a step, so they agree on the step to
stop at: after every step they all-reduce (MAX) the signal each has seen, on a small gloo group of their
own (CPU only: no device synchronisation), and all of them stop at the first step where any rank has one.
Before the first step there is nothing to save and a signal ends the worker at once; during the teardown
after the last step it is ignored, as the run is finishing anyway. A second SIGTERM or SIGINT means stop
now: the worker dies of it at once (checkpoints are written to a temporary directory and renamed when
complete, so a save cut short leaves nothing that a resume would read).

Finishing the step in progress may not fit in the grace period (long steps, slow saves). So, when there is
an earlier state to fall back on, the ranks also agree at every phase boundary of a step before its update
(each forward and backward of a micro-batch, the optimizer) whether a signal has come, and plan the stop
from their measurements: the median of their recent step times less what the current step has taken, plus
the newest save's time. When finishing and saving does not fit in what is left of the grace period, they
abandon the step there (its update not applied) and fall back on the end of the step before it, which is
exact: the checkpoint of that step if one was saved (nothing else to do), else the newest memory snapshot
(`checkpoint.memory_every`; with 1 that is the step before), read back from host memory and saved as the
checkpoint. When nothing fits, a
line and a `preemption_plan` event say so, and the cheapest plan is tried all the same: the estimate may be
pessimistic, and the supervisor ends the workers at the deadline anyway.
"""

from __future__ import annotations

import math
import os
import signal
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from liandan.config import Config
from liandan.run.worker_env import EXTERNAL_SIGNALS, PREEMPT_REQUEST, WorkerEnv
from liandan.train.callbacks import Callback

if TYPE_CHECKING:
    from liandan.train.context import TrainContext, TrainResult

REQUEST = PREEMPT_REQUEST  # the supervisor's request: it forwards the SIGTERM or SIGINT that it received
EXTERNAL = EXTERNAL_SIGNALS
EXIT_RESERVE = (0.1, 1.0)  # of the grace period, this share (at most this many seconds) is left for exiting
MID_STEP = ("forward", "backward", "optimizer")  # the phase boundaries where a step may be abandoned
_installed: PreemptionGuard | None = None  # the guard of this process, while one is installed


class Preempted(BaseException):
    """The run stopped for a signal; `exit_code` is the conventional 128 + signal number. Like
    KeyboardInterrupt it is no Exception, so that no `except Exception` on its way up swallows it."""

    def __init__(self, signum: int, step: int | None = None, checkpoint: str | None = None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        where = f" at step {step}" if step is not None else " before the first step"
        saved = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {signal.Signals(signum).name}{where}{saved}")


class PreemptionGuard:
    """Turns SIGTERM, SIGINT and SIGUSR2 into a request to stop at the end of a step (see the module doc).
    Install it in the main thread of a worker; `close` puts the previous handlers back."""

    def __init__(self):
        self.signum: int | None = None  # the first signal seen (SIGTERM for the supervisor's request)
        self.external = 0  # SIGTERMs and SIGINTs seen: a second one stops at once
        self.phase = "startup"  # startup (a signal ends the worker now), loop (stop after a step), teardown
        self.group = None
        self.grace_s = math.inf  # set by the callback from the supervisor's contract or the config
        self.signalled_at: float | None = None  # wall-clock time of the first signal
        self._previous: dict[int, object] = {}

    def install(self) -> PreemptionGuard:
        """Catch the signals from now on (before the trainer is built: a signal during start-up ends the worker
        at once); every trainer built while it is installed attaches its callback ("preemption")."""
        global _installed
        if threading.current_thread() is threading.main_thread():
            for signum in (*EXTERNAL, REQUEST):
                self._previous[signum] = signal.signal(signum, self._handle)
        _installed = self
        return self

    def close(self) -> None:
        global _installed
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
        if _installed is self:
            _installed = None

    def _handle(self, signum: int, frame) -> None:
        if signum in EXTERNAL:
            self.external += 1
            if self.external > 1:  # stop now: die of the signal, as if no handler had been there
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
        if self.signum is None:
            self.signum = signal.SIGTERM if signum == REQUEST else signum
            self.signalled_at = time.time()
        if self.phase == "startup":
            raise Preempted(self.signum)

    def start_loop(self, distributed: bool) -> None:
        """Enter the training loop: from here a signal stops the run after the step it arrives in. Collective
        when `distributed` (every rank makes the group for agreeing on that step)."""
        if distributed and self.group is None:
            self.group = dist.new_group(backend="gloo")
        self.phase = "loop"  # a signal that came meanwhile stops the run after the first step

    def deadline(self) -> float:
        """Wall-clock time by which this worker means to have saved (inf before any signal)."""
        if self.signalled_at is None:
            return math.inf
        share, most = EXIT_RESERVE
        return self.signalled_at + self.grace_s - min(most, share * self.grace_s)

    def agree_on_plan(self, finish_s: float, fallback_s: float, fallback_step: int) -> Plan:
        """What every rank knows once they have pooled what each has seen and measured: the first signal, the
        earliest deadline, the latest clock, the largest estimates and the step all can fall back to (-1:
        none). The same on every rank. Collective."""
        mine = [self.signum or 0, -self.deadline(), time.time(), finish_s, fallback_s, -fallback_step]
        pooled = torch.tensor([v if math.isfinite(v) else math.copysign(1e300, v) for v in mine], dtype=torch.float64)
        if self.group is not None:
            dist.all_reduce(pooled, op=dist.ReduceOp.MAX, group=self.group)
        signum, deadline, now, finish, fallback, step = pooled.tolist()
        return Plan(int(signum), -deadline - now, finish, fallback, int(-step))

    def end_loop(self) -> None:
        self.phase = "teardown"


@dataclass(frozen=True)
class Plan:
    """A preemption's plan, from the pooled view of all ranks (`agree_on_plan`)."""

    signum: int  # 0: no signal yet
    left_s: float  # of the grace period
    finish_s: float  # the rest of the step in progress and a save
    fallback_s: float  # a save of the end of `fallback_step` (restored first from memory when not saved)
    fallback_step: int  # -1: nothing to fall back on

    @property
    def choice(self) -> str:
        """finish (the step and save it), fall back (abandon the step), or either one when nothing fits."""
        if self.finish_s <= self.left_s or self.fallback_step < 0:
            return "finish"
        if self.fallback_s <= self.left_s or self.fallback_s < self.finish_s:
            return "fall back"
        return "finish"

    @property
    def fits(self) -> bool:
        return min(self.finish_s, self.fallback_s if self.fallback_step >= 0 else math.inf) <= self.left_s


class StepAbandoned(BaseException):
    """Raised at a phase boundary on every rank alike: the step in progress is given up for a preemption.
    No Exception, so that nothing on its way up swallows it."""

    def __init__(self, signum: int, fallback_step: int):
        super().__init__(f"step abandoned for {signal.Signals(signum).name}, back to step {fallback_step}")
        self.signum, self.fallback_step = signum, fallback_step


class PreemptionCallback(Callback):
    """The guard in the loop: after every step but the last the ranks agree whether to stop; on a signal,
    the step is saved (unless its regular checkpoint just was) and the run ends with `Preempted`. Where there
    is an earlier state to fall back on, they also agree at the phase boundaries before the update, and
    abandon the step when finishing it would not fit in the grace period (see the module's doc)."""

    order = 95  # after the step's own checkpoint

    def __init__(self, guard: PreemptionGuard):
        self.guard = guard
        self.step_seconds: deque[float] = deque(maxlen=5)
        self.step_started = 0.0
        self.planned = False  # this preemption's plan is made: no more agreeing in the middle of steps

    def on_train_start(self, ctx: TrainContext) -> None:
        grace = WorkerEnv.from_env().preempt_grace_s
        self.guard.grace_s = ctx.cfg.resilience.preempt_grace_s if grace is None else grace
        self.guard.start_loop(ctx.dist.distributed)

    def before_step(self, ctx: TrainContext, step: int) -> None:
        self.step_started = time.perf_counter()

    def on_phase(self, ctx: TrainContext, step: int, phase: str, micro: int) -> None:
        if phase not in MID_STEP or self.planned or step >= ctx.cfg.train.steps:
            return
        c = ctx.cfg.checkpoint
        if not c.enabled or (not ctx.snapshots and c.every != 1):
            return  # nothing saved, or never anything to fall back on: finishing the step is the only plan
        fallback_step, fallback_s = self._fallback(ctx, step)
        elapsed = time.perf_counter() - self.step_started
        typical = statistics.median(self.step_seconds) if self.step_seconds else 0.0
        plan = self.guard.agree_on_plan(max(0.0, typical - elapsed) + self._save_s(ctx), fallback_s, fallback_step)
        if not plan.signum:
            return
        self.planned = True
        self._record(ctx, step + 1, plan, f"finishing step {step + 1} and saving it")
        if plan.choice == "fall back":
            raise StepAbandoned(plan.signum, plan.fallback_step)

    def after_step(self, ctx: TrainContext, step: int, metrics: dict[str, float]) -> None:
        self.step_seconds.append(time.perf_counter() - self.step_started)
        if step >= ctx.cfg.train.steps or ctx.rollback.pending:  # stop after the step that replaces it
            return
        # this step's checkpoint was just asked for (by the step or the time interval); with saving off, none is
        saved = ctx.checkpoints.requested_step == step or not ctx.cfg.checkpoint.enabled
        plan = self.guard.agree_on_plan(0.0 if saved else self._save_s(ctx), math.inf, -1)
        if not plan.signum:
            return
        if not self.planned:
            self._record(ctx, step, plan, f"saving step {step}" if not saved else "stopping")
        if not saved:
            ctx.phase("checkpoint")
            ctx.save_checkpoint()
        ctx.stop_for_preemption(plan.signum)

    def on_train_end(self, ctx: TrainContext, result: TrainResult) -> None:
        self.guard.end_loop()

    @staticmethod
    def _save_s(ctx: TrainContext) -> float:
        """The newest save's time; before any, the newest snapshot's (a lower bound); else nothing known."""
        measured = ctx.checkpoints.save_seconds()
        if measured is None and ctx.snapshots is not None:
            measured = ctx.snapshots.save_seconds
        return measured or 0.0

    def _fallback(self, ctx: TrainContext, step: int) -> tuple[int, float]:
        """(the newest completed step whose end this rank can save, the seconds that takes) or (-1, inf): the
        checkpoint of `step`, the last completed one, saved or being saved costs nothing; the newest memory
        snapshot costs reading it back and a save. An older snapshot (`checkpoint.memory_every` > 1) loses
        the steps since, but fewer than the newest checkpoint would; one no newer than that is no fallback."""
        saved = ctx.checkpoints.started_step
        if saved == step:
            return step, 0.0
        snapshots = ctx.snapshots
        if snapshots is not None and snapshots.newest is not None and snapshots.newest > (saved or 0):
            return snapshots.newest, (snapshots.save_seconds or 0.0) + self._save_s(ctx)
        return -1, math.inf

    def _record(self, ctx: TrainContext, step: int, plan: Plan, finishing: str) -> None:
        """One line when the plan is no plain finish, and a `preemption_plan` event always. `step`: the step in
        progress, or just done."""
        name, choice, left = signal.Signals(plan.signum).name, plan.choice, max(0.0, plan.left_s)
        if not plan.fits:
            fallback = f"saving step {plan.fallback_step} ({plan.fallback_s:.1f}s)" if plan.fallback_step >= 0 else ""
            ctx.say(f"preemption: {name}: {finishing} ({plan.finish_s:.1f}s)" + (f" or {fallback}" if fallback
                        else "") + f" does not fit in the {left:.1f}s of grace left; trying to {choice} all the same")  # fmt: skip
        elif choice == "fall back":
            ctx.say(f"preemption: {name}: {finishing} would take {plan.finish_s:.1f}s of the {left:.1f}s of"
                        f" grace left: abandoning it, saving step {plan.fallback_step}")  # fmt: skip
        ctx.files.log_event("preemption_plan", signal=name, step=step, plan=choice, fits=plan.fits,
                                grace_left_s=round(plan.left_s, 2), finish_s=round(plan.finish_s, 2),
                                fallback_s=round(plan.fallback_s, 2) if plan.fallback_step >= 0 else None,
                                fallback_step=plan.fallback_step if plan.fallback_step >= 0 else None)  # fmt: skip


def preemption_callback(cfg: Config) -> PreemptionCallback | None:
    """Attached by every trainer built while a guard is installed (`liandan train` installs one in each
    process that trains); a trainer of a program that catches no signals has none."""
    return PreemptionCallback(_installed) if _installed is not None else None
