"""Heartbeats: every rank says, in a small file, which step and phase it is in, so a watchdog outside the
process can tell a slow step from a hang and name the rank and the phase that stopped."""

from __future__ import annotations

import collections
import faulthandler
import json
import os
import signal
import time
from pathlib import Path

from liandan.run.worker_env import node_name

PHASES = ("startup", "data", "forward", "backward", "optimizer", "collective", "step_end", "checkpoint", "eval", "done")
# The parts of a training step. FSDP's and TP's collectives run inside forward, backward and optimizer (the
# gradient norm); `collective` is the loop's own (the mean loss over ranks).
STEP_PHASES = ("data", "forward", "backward", "optimizer", "collective", "step_end")
# The order in which a rank passes the phases for one value of `step` (the steps completed): what follows a
# step (its logged loss, evaluation, checkpoint) is beaten with the new count, and so are the next step's
# parts. Forward and backward repeat for each micro-batch.
_PROGRESS = ("startup", "collective", "step_end", "eval", "checkpoint", "data", "micro_batches", "optimizer", "done")


class Heartbeat:
    def __init__(self, directory: Path, rank: int):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.path = self.directory / f"rank-{rank:05d}.json"
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
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)  # readers never see half a record

    def enable_stack_dumps(self) -> Path:
        """On SIGUSR1, write every thread's Python stack to stacks/rank-R.txt (for the hang watchdog)."""
        stacks = self.directory / "stacks"
        stacks.mkdir(exist_ok=True)
        path = stacks / f"rank-{self.rank:05d}.txt"
        self._stacks = open(path, "w")  # noqa: SIM115 - open for the signal handler until close()
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True, chain=False)
        return path

    def close(self) -> None:
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
            self._stacks = None


def read_heartbeats(directory: Path) -> list[dict]:
    out = []
    for path in sorted(Path(directory).glob("rank-*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError):
            continue  # being replaced right now
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
