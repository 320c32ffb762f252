"""Preemption of a supervised run: SIGTERM (Slurm, Kubernetes) or SIGINT (Ctrl-C) to the supervisor.

The supervisor asks its workers to stop (SIGUSR2: each saves a checkpoint at the end of the step it is in,
all ranks at the same step, or, when that would not fit in the grace period it handed them in
$LIANDAN_PREEMPT_GRACE_S, of the step before, and exits; see liandan.train.preemption), waits for them up to
`resilience.preempt_grace_s`, then ends whatever is left, its standbys included, gives back the memory
snapshots, records a `preempted` event and exits with 128 + the signal's number. A second signal stops at
once: the workers are killed; a checkpoint cut short is never complete, so nothing that a resume reads is
damaged. The next launch resumes from the newest checkpoint, the one just saved when it completed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING

from liandan.checkpoint.verify import complete_checkpoints, step_of
from liandan.run import RunDir
from liandan.run.worker_env import EXTERNAL_SIGNALS as EXTERNAL
from liandan.run.worker_env import PREEMPT_REQUEST as REQUEST

if TYPE_CHECKING:
    from liandan.resilience.attempts import Attempt

POLL_S = 0.2


class SignalLatch:
    """Records SIGTERM and SIGINT instead of dying of them (main thread only) and wakes whoever waits."""

    def __init__(self):
        self.received: list[int] = []
        self.wake = threading.Event()
        self._previous: dict[int, object] = {}

    def install(self) -> SignalLatch:
        if threading.current_thread() is threading.main_thread():
            for signum in EXTERNAL:
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, frame) -> None:
        self.received.append(signum)
        self.wake.set()

    def close(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    @property
    def first(self) -> int | None:
        return self.received[0] if self.received else None

    @property
    def again(self) -> bool:
        """A second signal: stop now."""
        return len(self.received) > 1


def request_stop(pids: list[int]) -> None:
    """Ask these workers to save at the end of their step and exit."""
    for pid in pids:
        try:
            os.kill(pid, REQUEST)
        except (ProcessLookupError, PermissionError):
            pass


class Preemption:
    """The supervisor's part in a preemption (a base of Supervisor, whose state it uses)."""

    def _preempt(self, attempt: Attempt | None) -> int:
        """SIGTERM or SIGINT: the workers save at the end of their step within the grace period, then
        everything ends. Returns the exit code, 128 + the signal's number."""
        signum, began, grace = self.signals.first, time.time(), self.r.preempt_grace_s
        name, step, left, outcome = signal.Signals(signum).name, None, [], "no training was running"
        if attempt is not None and not attempt.ended:
            self.say(f"supervisor: {name}: the workers save a checkpoint at the end of their step (up to {grace:g}s)")
            local = [proc.pid for rank, proc in attempt.procs if rank is not None]
            request_stop(local or [b["pid"] for b in self._beats(attempt) if b["host"] == self.node])
            while not self.signals.again and time.time() < began + grace and self._running(attempt):
                self.clock.wait(POLL_S)
            step = max((b["step"] for b in self._beats(attempt)), default=None)
            if self.signals.again:
                outcome = "a second signal stopped it at once"
            elif self._running(attempt):
                outcome = f"no checkpoint within the grace period of {grace:g}s (resilience.preempt_grace_s)"
            else:
                outcome = None  # the workers stopped on their own: the newest checkpoint tells whether they saved
            self._end(attempt)
            left = attempt.survivors
        resume = self._newest_checkpoint_step()
        if outcome is None:
            outcome = "checkpoint saved" if resume == step else "the workers stopped before a step to save"
        self._event("preempted", signal=name, step=step, resume_step=resume, saved=outcome == "checkpoint saved",
                    outcome=outcome, seconds=round(time.time() - began, 2), workers_left_alive=left)  # fmt: skip
        self.say(f"supervisor: stopped by {name}" + (f" at step {step}" if step is not None else "")
                 + f": {outcome}; the next launch resumes from step {resume}")  # fmt: skip
        return 128 + signum

    @staticmethod
    def _running(attempt: Attempt) -> bool:
        return any(proc.poll() is None for _, proc in attempt.procs)

    def _newest_checkpoint_step(self) -> int:
        c = self.cfg.checkpoint
        complete = complete_checkpoints(RunDir.of(self.run_dir, c.dir).checkpoints)
        return step_of(complete[-1]) if complete else 0
