"""Heartbeats: every rank says, in a small file, which step and phase it is in, so a watchdog outside the
process can tell a slow step from a hang and name the rank and the phase that stopped."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import signal
import sys
import time
from pathlib import Path

from liandan.run import RunDir, atomic_write, dumps_json, read_json, temporary
from liandan.run.worker_env import node_name

PHASES = ("startup", "data", "forward", "backward", "optimizer", "collective", "step_end", "checkpoint", "eval",
          "rollback", "done")  # fmt: skip
# The parts of a training step. FSDP's and TP's collectives run inside forward, backward and optimizer (the
# gradient norm); `collective` is the loop's own (the mean loss over ranks).
STEP_PHASES = ("data", "forward", "backward", "optimizer", "collective", "step_end")
# The order in which a rank passes the phases for one value of `step` (the steps completed): what follows a
# step (its logged loss, evaluation, checkpoint) is beaten with the new count, and so are the next step's
# parts. Forward and backward repeat for each micro-batch. A guard's rollback replays steps from the state it
# restored, beaten with that state's step, before the step after it starts.
_PROGRESS = ("startup", "collective", "step_end", "eval", "checkpoint", "rollback", "data", "micro_batches",
             "optimizer", "done")  # fmt: skip


class Heartbeat:
    def __init__(self, room: RunDir, rank: int):
        self.room = room
        room.heartbeats.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = room.heartbeat(rank)
        self._tmp = temporary(self.path)
        with contextlib.suppress(OSError):
            self._tmp.unlink(missing_ok=True)  # half-written by an earlier process of this rank
        self._write_failed = False
        self.host = node_name()  # $LIANDAN_NODE_NAME, Slurm's node name, or the host name
        self._stacks = None
        self._last: tuple[str, float] | None = None
        # Recent durations of each part of a step, so the watchdog can tell a part that usually takes
        # milliseconds (loading a batch) from the step as a whole.
        self._durations: dict[str, collections.deque] = {p: collections.deque(maxlen=50) for p in STEP_PHASES}

    def beat(self, step: int, phase: str, micro: int = 0) -> None:
        """`micro`: the micro-batch a forward or backward is for."""
        now = time.time()
        if self._last is not None and self._last[0] in self._durations:
            self._durations[self._last[0]].append(now - self._last[1])
        self._last = (phase, now)
        record = {"rank": self.rank, "pid": os.getpid(), "host": self.host, "step": step, "phase": phase,
                  "micro": micro, "time": now, "longest": {p: round(max(d), 4) for p, d in self._durations.items() if d}}  # fmt: skip
        self._write(dumps_json(record))

    def _write(self, text: str) -> None:
        """Best-effort: a heartbeat that cannot be written (a full disk) must not end training. Replacing the
        file keeps readers from ever seeing half a record; when there is no room for a new file, the record is
        rewritten in place instead (its blocks are already allocated), which readers skip if they catch it
        half-written. A failure is reported once."""
        try:
            atomic_write(self.path, text, durable=False)  # many a second: a crash of the machine ends the run anyway
            return
        except OSError as err:
            first_error = err
        try:
            with open(self.path, "r+") as f:  # never creates: a new file would need room too
                f.write(text)
                f.truncate()
            rewritten = True
        except OSError:
            rewritten = False
        if not self._write_failed:
            self._write_failed = True
            fallback = f"rewriting {self.path} in place" if rewritten else "skipping heartbeats"
            print(f"warning: rank {self.rank}: cannot write heartbeat {self._tmp}: {type(first_error).__name__}:"
                  f" {first_error.strerror or first_error}; {fallback} while this lasts (reported once)",
                  file=sys.stderr, flush=True)  # fmt: skip

    def enable_stack_dumps(self) -> Path:
        """On SIGUSR1, write every thread's Python stack to the run's stack dump of this rank (for the hang
        watchdog)."""
        path = self.room.stack_dump(self.rank)
        path.parent.mkdir(exist_ok=True)
        self._stacks = open(path, "w")  # noqa: SIM115 - open for the signal handler until close()
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=False)
        return path

    def close(self) -> None:
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
            self._stacks = None


def read_heartbeats(room: RunDir) -> list[dict]:
    out = []
    for path in room.heartbeat_files():
        beat = read_json(path)  # None: being replaced right now
        if isinstance(beat, dict):
            out.append(beat)
    return out


def stopped_first(beats: list[dict]) -> dict:
    """The rank that stopped first, from the ranks' last heartbeats: the one furthest behind (its peers ran on
    to the next collective and wait for it there), the oldest heartbeat among equals. Being behind decides
    before age does: a rank that hangs just after its beat can be overtaken in time by a peer's beat of a
    later phase, which that peer writes on its way into the collective it then waits in."""
    return min(beats, key=_progress)


def _progress(beat: dict) -> tuple:
    phase = beat["phase"]
    if phase in ("forward", "backward"):
        return beat["step"], _PROGRESS.index("micro_batches"), beat.get("micro", 0), phase == "backward", beat["time"]
    return beat["step"], _PROGRESS.index(phase), 0, False, beat["time"]
