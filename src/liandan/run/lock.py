"""The run directory's lock: one run writes into a run directory at a time.

Two `liandan train` with the same run name would interleave their metrics.jsonl and checkpoint writes. The
process in charge of a run (the supervisor, or rank 0 of an unsupervised run) therefore holds an exclusive
`fcntl.flock` on `<run>/run.lock` for the run's lifetime, and a second run is refused with one line naming
the holder (its pid, host and start time are in the lock file). The kernel releases the lock when the
holder's process ends, however it ends: a SIGKILLed run leaves no stale lock behind. A run that ends in
order (`release()`) removes the lock file; one that was killed leaves it, free, naming the process that held
it. Since a lock file can be removed while another process opens it, a lock taken on a file that is no
longer the one at the path is given up and taken again.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
import weakref
from datetime import datetime
from pathlib import Path

from liandan.config import ConfigError
from liandan.run.layout import RunDir

LOCK_FILE = RunDir(Path()).lock.name
LOCKED_AT = "%Y-%m-%d %H:%M:%S %z"  # when the holder took the lock, as it writes it
_READ_HOLDER_TRIES = 20  # the holder writes who it is just after it locks: a moment for that to land


class RunDirInUse(ConfigError):
    """Another process holds the run directory's lock."""


class RunLock:
    """A held lock on a run directory, released by `release()`, when the object is collected, or when the
    process ends."""

    def __init__(self, path: Path, fd: int):
        self.path, self._fd = path, fd
        self._close = weakref.finalize(self, os.close, fd)

    @property
    def held(self) -> bool:
        return self._close.alive

    def release(self) -> None:
        """Remove the lock file, then let go of it: the run ended in order, so nothing is left behind. Removed
        while held, so that no other run holds a lock on it by then (one that opened it meanwhile takes the
        lock on a removed file, sees that, and starts over: `lock_run_dir`)."""
        if self._close.alive:
            with contextlib.suppress(OSError):  # gone or unwritable: the lock still goes with the descriptor
                if _same_file(self._fd, self.path):
                    os.unlink(self.path)
        self._close()


# Locks this process holds, so that a second Trainer in the same process (a resume in a test, a notebook)
# shares its lock rather than being refused by itself: flock treats two opens of one file as two holders.
_held: weakref.WeakValueDictionary[str, RunLock] = weakref.WeakValueDictionary()


def lock_run_dir(run_dir: Path | RunDir, name: str | None = None) -> RunLock:
    """Take the exclusive lock on `run_dir` (created if missing), or raise RunDirInUse naming its holder.
    `name` is another lock file in it (each node's supervisor of a multi-node run holds its own)."""
    room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    run_dir = room.path
    path = room.lock if name is None else run_dir / name
    return _take(path, lambda holder: RunDirInUse(
        f"run directory {run_dir} is in use by another run ({holder}); wait for it to end, or choose another"
        " --run.name"))  # fmt: skip


def lock_output_dir(directory: Path, lock_file: Path, what: str, option: str) -> RunLock:
    """The same lock on another command's output directory (`liandan data run` into `pipeline.output`): a
    second writer is refused in one line naming the holder, `what` it is doing and the `option` to change."""
    return _take(lock_file, lambda holder: DirectoryInUse(
        f"{directory} is in use by another {what} ({holder}); wait for it to end, or choose another {option}"))  # fmt: skip


class DirectoryInUse(ConfigError):
    """Another process holds an output directory's lock."""


def _take(path: Path, refusal) -> RunLock:
    key = os.path.abspath(path)
    held = _held.get(key)
    if held is not None and held.held:
        return held
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)  # not truncated: it names the holder
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise refusal(holder) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, path):
            break
        os.close(fd)  # its holder removed it as we opened it: the lock on a removed file locks nothing
    me = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime(LOCKED_AT)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
    lock = RunLock(path, fd)
    _held[key] = lock
    return lock


def _same_file(fd: int, path: Path) -> bool:
    """Whether the open file `fd` is still the file at `path`."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (here.st_dev, here.st_ino)


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote into the lock file."""
    for _ in range(_READ_HOLDER_TRIES):
        raw = os.pread(fd, 4096, 0)
        with contextlib.suppress(ValueError, KeyError, TypeError):
            who = json.loads(raw)
            return f"pid {who['pid']} on {who['host']}, started {who['started']}"
        time.sleep(0.01)
    return "a process that has not said who it is"


def holds_progress(run_dir: Path | RunDir) -> bool:
    """Whether an earlier run logged a step here. A run refused before its first step leaves at most an
    empty metrics.jsonl, which must not stand in the way of the corrected rerun."""
    metrics = (run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))).metrics
    return metrics.is_file() and metrics.stat().st_size > 0


def holder_running(run_dir: Path | RunDir) -> bool | None:
    """Whether the process that last took the run's lock is still alive: True or False when it ran on this
    host, None when it ran on another host (or never said who it is). It only reads the lock file: testing
    the lock by taking it, even for a moment, could refuse a run that starts at that moment."""
    room = run_dir if isinstance(run_dir, RunDir) else RunDir(Path(run_dir))
    try:
        who = json.loads(room.lock.read_text(encoding="utf-8"))
        pid, host = int(who["pid"]), str(who["host"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    return not _started_after(pid, who.get("started"))


def _started_after(pid: int, locked: object) -> bool:
    """Whether process `pid` started after the lock was taken (`locked`, as the holder wrote it): then the
    holder has ended and its pid went to another process. False when either time cannot be read (not Linux)."""
    try:
        when = datetime.strptime(str(locked), LOCKED_AT).timestamp()
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime: clock ticks after boot
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))  # fmt: skip
    except (OSError, ValueError, IndexError, StopIteration):
        return False
    # Both times are whole seconds: a process a moment older than its lock is still its holder.
    return boot + ticks / os.sysconf("SC_CLK_TCK") > when + 2
