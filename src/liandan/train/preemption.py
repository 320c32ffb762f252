"""Stopping for preemption: SIGTERM (what Slurm and Kubernetes send), SIGINT (Ctrl-C) or the supervisor's
request (SIGUSR2) makes a worker save a checkpoint at the end of the step it is in and exit with
128 + the signal's number, rather than die mid-write.

The ranks get the signal at different moments, in different parts of a step, so they agree on the step to
stop at: after every step they all-reduce (MAX) the signal each has seen, on a small gloo group of their
own (CPU only: no device synchronisation), and all of them stop at the first step where any rank has one.
Before the first step there is nothing to save and a signal ends the worker at once; during the teardown
after the last step it is ignored, as the run is finishing anyway. A second SIGTERM or SIGINT means stop
now: the worker dies of it at once (checkpoints are written to a temporary directory and renamed when
complete, so a save cut short leaves nothing that a resume would read).
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from liandan.config import Config
from liandan.train.callbacks import Callback, register_callback

if TYPE_CHECKING:
    from liandan.train.trainer import Trainer, TrainResult

REQUEST = signal.SIGUSR2  # the supervisor's request: it forwards the SIGTERM or SIGINT that it received
EXTERNAL = (signal.SIGTERM, signal.SIGINT)
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
        if self.phase == "startup":
            raise Preempted(self.signum)

    def start_loop(self, distributed: bool) -> None:
        """Enter the training loop: from here a signal stops the run after the step it arrives in. Collective
        when `distributed` (every rank makes the group for agreeing on that step)."""
        if distributed and self.group is None:
            self.group = dist.new_group(backend="gloo")
        self.phase = "loop"  # a signal that came meanwhile stops the run after the first step

    def agreed(self) -> int:
        """The signal to stop for after this step (0: go on); the same on every rank. Collective."""
        seen = torch.tensor([self.signum or 0], dtype=torch.int32)
        if self.group is not None:
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.group)
        return int(seen.item())

    def end_loop(self) -> None:
        self.phase = "teardown"


class PreemptionCallback(Callback):
    """The guard in the loop: after every step but the last the ranks agree whether to stop; on a signal,
    the step is saved (unless its regular checkpoint just was) and the run ends with `Preempted`."""

    order = 95  # after the step's own checkpoint

    def __init__(self, guard: PreemptionGuard):
        self.guard = guard

    def on_train_start(self, trainer: Trainer) -> None:
        self.guard.start_loop(trainer.dist.distributed)

    def after_step(self, trainer: Trainer, step: int, metrics: dict[str, float]) -> None:
        if step >= trainer.cfg.train.steps or trainer.rolling_back:  # stop after the step that replaces it
            return
        signum = self.guard.agreed()
        if not signum:
            return
        every = trainer.cfg.checkpoint.every
        if not (every and step % every == 0):
            trainer.phase("checkpoint")
            trainer.save_checkpoint()
        trainer.stop_for_preemption(signum)

    def on_train_end(self, trainer: Trainer, result: TrainResult) -> None:
        self.guard.end_loop()


@register_callback("preemption", builtin=True)
def preemption_callback(cfg: Config) -> PreemptionCallback | None:
    """Attached by every trainer built while a guard is installed (`liandan train` installs one in each
    process that trains); a trainer of a program that catches no signals has none."""
    return PreemptionCallback(_installed) if _installed is not None else None
