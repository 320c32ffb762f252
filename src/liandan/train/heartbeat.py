"""Heartbeats: every rank says, in a small file, which step and phase it is in, so a watchdog outside the
process can tell a slow step from a hang and name the rank and the phase that stopped.

A rank beats six times a step, so a beat must cost little. On a local file system the record is written over
the old one in place, one `pwrite` into a file the rank keeps open (about a microsecond; replacing the file,
a temporary written and renamed over it, took 0.2 ms on a quiet disk and 5 to 8 ms on a busy one). The write
is whole when the call returns, so a rank killed right after a beat leaves that beat, as before. A reader
that catches a write halfway would see parts of two records: each record carries the CRC-32 of its text,
and a reader that finds it wrong reads again. Where the run directory is on a network file system (NFS,
Lustre...), whose clients may hold a write back until the file is closed, the file is replaced as a whole
each time, which a watchdog on another node sees at once."""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import os
import signal
import statistics
import sys
import time
import zlib
from pathlib import Path

from liandan.run import RunDir, atomic_write, dumps_json, temporary
from liandan.run.jsonl import loads_bounded
from liandan.run.worker_env import node_name

PHASES = ("startup", "data", "forward", "backward", "optimizer", "collective", "step_end", "checkpoint", "eval",
          "rollback", "done")  # fmt: skip
# The parts of a training step. FSDP's and TP's collectives run inside forward, backward and optimizer (the
# gradient norm); `collective` is the loop's own (the mean loss over ranks).
STEP_PHASES = ("data", "forward", "backward", "optimizer", "collective", "step_end")
# What a heartbeat times besides whole steps: the parts of a step, and what may come between two steps.
TIMED_PHASES = (*STEP_PHASES, "checkpoint", "eval")
RECENT = 50  # how many of the latest durations of each timed phase, and of whole steps, a heartbeat sums up
# The order in which a rank passes the phases for one value of `step` (the steps completed): what follows a
# step (its logged loss, evaluation, checkpoint) is beaten with the new count, and so are the next step's
# parts. Forward and backward repeat for each micro-batch. A guard's rollback replays steps from the state it
# restored, beaten with that state's step, before the step after it starts.
_PROGRESS = ("startup", "collective", "step_end", "eval", "checkpoint", "rollback", "data", "micro_batches",
             "optimizer", "done")  # fmt: skip
# File systems whose writes other processes read at once from the same page cache: a heartbeat is rewritten
# in place there. Anything else (NFS, CIFS, Lustre, GPFS, FUSE...) gets the whole file replaced each beat.
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "zfs", "f2fs", "overlay"})
# A record written in place starts with the CRC-32 of the record's own text (an object without this key); a
# file replaced whole never does. A read that mixes two records always has the key, and a CRC of neither.
CRC_PREFIX = '{"crc32": "'
READ_TRIES = 3  # reads of a heartbeat caught halfway through a write before it counts as unreadable


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
        self._in_place = file_system(room.heartbeats) in LOCAL_FILE_SYSTEMS
        self._fd: int | None = None  # the heartbeat file, kept open for writing in place
        self._size = 0  # the file's length: a shorter record is padded to it, so nothing is left of a longer one
        self.host = node_name()  # $LIANDAN_NODE_NAME, Slurm's node name, or the host name
        self._stacks = None
        self._last: tuple[str, float] | None = None
        # Recent durations of each part of a step, so the watchdog can tell a part that usually takes
        # milliseconds (loading a batch) from the step as a whole, and of checkpoints and evaluations.
        self._durations: dict[str, collections.deque] = {p: collections.deque(maxlen=RECENT) for p in TIMED_PHASES}
        # Recent durations of whole steps (from a step's batch to the next's), timed here: a watchdog that polls
        # would miss steps shorter than its poll, and with them the step time its timeout follows.
        self._steps: collections.deque = collections.deque(maxlen=RECENT)
        self._step_s: float | None = None  # their median, reported in each beat
        self._step_started: tuple[int, float] | None = None  # (the step count, when that step's batch began)

    def beat(self, step: int, phase: str, micro: int = 0) -> None:
        """`micro`: the micro-batch a forward or backward is for."""
        now = time.time()
        if self._last is not None and self._last[0] in self._durations:
            self._durations[self._last[0]].append(now - self._last[1])
        self._last = (phase, now)
        self._time_step(step, phase, now)
        record = {"rank": self.rank, "pid": os.getpid(), "host": self.host, "step": step, "phase": phase,
                  "micro": micro, "time": now, "longest": {p: round(max(d), 4) for p, d in self._durations.items() if d}}  # fmt: skip
        if self._step_s is not None:
            record["step_s"] = self._step_s
        self._write(dumps_json(record))

    def _time_step(self, step: int, phase: str, now: float) -> None:
        """A step's time runs from its batch (`data`, beaten with the count of steps before it) to the next
        step's batch: the step and what follows it (its logged loss, the callbacks, an evaluation or a
        checkpoint, which the median passes over where they are rare), as a watchdog sees steps go by. A
        count that does not grow by one between two batches (a guard's rollback, a resumed start) times nothing."""
        if phase != "data":
            return
        if self._step_started is not None and step == self._step_started[0] + 1:
            self._steps.append(now - self._step_started[1])
            self._step_s = round(statistics.median(self._steps), 4)
        self._step_started = (step, now)

    def _write(self, text: str) -> None:
        """Best-effort: a heartbeat that cannot be written (a full disk) must not end training. In place on a
        local file system (see the module's docstring); elsewhere the file is replaced, and when there is no
        room for a new file the record is rewritten in place instead (its blocks are already allocated),
        which readers skip if they catch it half-written. A failure is reported once."""
        try:
            if self._in_place:
                self._write_in_place(text)
            else:  # many a second: a crash of the machine ends the run anyway, so not durable
                atomic_write(self.path, text, durable=False)
            return
        except OSError as err:
            first_error = err
        if self._in_place:
            self._report_failure(first_error, "skipping heartbeats")
            return
        try:
            with open(self.path, "r+") as f:  # never creates: a new file would need room too
                f.write(text)
                f.truncate()
            rewritten = True
        except OSError:
            rewritten = False
        self._report_failure(first_error, f"rewriting {self.path} in place" if rewritten else "skipping heartbeats")

    def _write_in_place(self, text: str) -> None:
        """`text` over the file's start in one `pwrite`, with its CRC-32 as the first key, padded with spaces
        (which JSON readers skip) to the file's length."""
        if self._fd is None:
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            self._fd = os.open(self.path, flags, 0o666)
            self._size = os.fstat(self._fd).st_size
        data = stamped(text).encode("utf-8")
        data = data.ljust(self._size)
        if os.pwrite(self._fd, data, 0) != len(data):
            raise OSError(f"short write of {self.path}")
        self._size = len(data)

    def _report_failure(self, err: OSError, fallback: str) -> None:
        if not self._write_failed:
            self._write_failed = True
            print(f"warning: rank {self.rank}: cannot write heartbeat {self.path if self._in_place else self._tmp}:"
                  f" {type(err).__name__}: {err.strerror or err}; {fallback} while this lasts (reported once)",
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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._stacks is not None:
            faulthandler.unregister(signal.SIGUSR1)
            self._stacks.close()
            self._stacks = None


def read_heartbeats(room: RunDir) -> list[dict]:
    out = []
    for path in room.heartbeat_files():
        beat = read_heartbeat(path)  # None: not written yet, or caught halfway through a write
        if beat is not None:
            out.append(beat)
    return out


def read_heartbeat(path: Path) -> dict | None:
    """A rank's last heartbeat, or None. A record written in place is read again while its CRC-32 says it was
    caught halfway through a write; the CRC is not part of what is returned."""
    for _ in range(READ_TRIES):
        try:
            text = path.read_text(encoding="utf-8").rstrip()
        except (OSError, UnicodeDecodeError):  # half a multi-byte character of a torn read counts as torn
            continue
        if text.startswith(CRC_PREFIX):
            crc, body = text[len(CRC_PREFIX) : len(CRC_PREFIX) + 8], "{" + text[len(CRC_PREFIX) + 11 :]
            if text[len(CRC_PREFIX) + 8 : len(CRC_PREFIX) + 11] != '", ' or crc32(body) != crc:
                continue  # caught halfway through a write
            text = body
        beat = read_json_text(text)  # a file replaced whole is never torn
        return beat if isinstance(beat, dict) else None
    return None


def read_json_text(text: str) -> object:
    try:
        return loads_bounded(text)
    except ValueError:
        return None


def stamped(text: str) -> str:
    """A record's JSON text (an object, not empty) with the CRC-32 of that text added as its first key."""
    return f'{CRC_PREFIX}{crc32(text)}", {text[1:]}'


def crc32(text: str) -> str:
    return f"{zlib.crc32(text.encode('utf-8')):08x}"


def file_system(path: Path) -> str:
    """The type of the file system `path` is on ("ext4", "nfs4"...), from the mount table; "" when unknown
    (not Linux)."""
    try:
        mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return ""
    target, best, kind = os.path.realpath(path), "", ""
    for line in mounts:
        fields, _, rest = line.partition(" - ")
        mount_point = fields.split(" ")[4].replace("\\040", " ")
        inside = target == mount_point or target.startswith(mount_point.rstrip("/") + "/")
        if inside and len(mount_point) >= len(best) and rest:
            best, kind = mount_point, rest.split(" ")[0]
    return kind


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
