"""The worker processes of an attempt: marked, watched to the millisecond, ended without survivors, and
started ahead of need.

Every process of an attempt carries `$LIANDAN_ATTEMPT_TOKEN` in its environment, and so does every process
it starts. Ending an attempt kills each process whose environment holds the token, however it was started:
torchrun puts each worker in a session of its own, so killing the launcher's process group is not enough.

A standby is a worker process started while the previous attempt still runs or while a failure is handled:
it imports torch and liandan, then waits for its orders (environment and arguments) on stdin, so a restart
does not pay the interpreter and import start-up again.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from liandan.run.worker_env import ATTEMPT_TOKEN


def processes_with_token(token: str) -> list[int]:
    """Live processes whose environment carries this attempt token (Linux /proc; [] elsewhere)."""
    needle = f"{ATTEMPT_TOKEN}={token}\0".encode()
    found = []
    try:
        entries = os.scandir("/proc")
    except OSError:
        return found
    with entries:
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry.name}/environ", "rb") as f:
                    environ = f.read()
            except OSError:  # gone, or not ours
                continue
            if needle in environ:  # a zombie's environment reads empty: only live processes match
                found.append(int(entry.name))
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (OSError, IndexError):
        if not Path("/proc").is_dir():
            try:
                os.kill(pid, 0)
                return True
            except OSError:
                return False
        return False


def end_processes(token: str, pids=(), timeout: float = 5.0) -> list[int]:
    """SIGKILL every process of an attempt (the token's, and `pids` with their process groups); returns
    those still alive after `timeout` seconds (none, unless the kernel cannot end them)."""
    deadline = time.time() + timeout
    targets = set(pids)
    while True:
        targets = {p for p in targets | set(processes_with_token(token)) if alive(p)}
        if not targets or time.time() >= deadline:
            return sorted(targets)
        for pid in targets:
            for kill in (os.killpg, os.kill):  # the group takes children that do not carry the token
                try:
                    kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        time.sleep(0.02)


class DeathClock:
    """The moment each watched process ends, also for processes that are not our children (pidfd)."""

    def __init__(self):
        self.poller = select.poll() if hasattr(select, "poll") else None
        self.fds: dict[int, int] = {}
        self.deaths: dict[int, float] = {}

    def watch(self, pid: int) -> None:
        if pid in self.fds or pid in self.deaths:
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            fd = -1  # no pidfd here (or already gone): checked by polling instead
        self.fds[pid] = fd
        if fd >= 0 and self.poller is not None:
            self.poller.register(fd, select.POLLIN)

    def wait(self, timeout: float) -> list[int]:
        """Wait up to `timeout` seconds for a watched process to end; returns the pids that ended."""
        if self.poller is not None and any(fd >= 0 for fd in self.fds.values()):
            self.poller.poll(timeout * 1000)
        else:
            time.sleep(timeout)
        now, ended = time.time(), []
        for pid, fd in list(self.fds.items()):
            if not alive(pid):
                self.deaths[pid] = now
                ended.append(pid)
                self._forget(pid)
        return ended

    def _forget(self, pid: int) -> None:
        fd = self.fds.pop(pid)
        if fd >= 0:
            if self.poller is not None:
                self.poller.unregister(fd)
            os.close(fd)

    def close(self) -> None:
        for pid in list(self.fds):
            self._forget(pid)


# A rank ended by a signal this soon after a peer's error exit is what the peer died of, not its casualty.
SAME_MOMENT_S = 0.5


def first_failure(exits: dict[int, tuple[float, int]]) -> tuple[float, int, int] | None:
    """(time, rank, exit code) of the failure that came first among `exits` (rank -> (time, code)), or None.
    Ranks found dead at one wake-up share its time, and a rank killed (SIGKILL, the OOM killer) takes its
    peers down within moments, which then exit with an error of a lost connection: among the failures of
    about the first moment, one by a signal is the cause; else the earliest, then the lowest rank."""
    failed = sorted((when, rank, code) for rank, (when, code) in exits.items() if code != 0)
    if not failed:
        return None
    moment = [f for f in failed if f[0] - failed[0][0] <= SAME_MOMENT_S]
    return min(moment, key=lambda f: (f[2] > 0, f[0], f[1]))


# -- standby workers ---------------------------------------------------------------------------------------
def module_command(command: list[str]) -> tuple[str, list[str]] | None:
    """(module, arguments) of a `python -m module ...` command run by this interpreter, else None."""
    if len(command) >= 3 and command[0] == sys.executable and command[1] == "-m":
        return command[2], command[3:]
    return None


class Standby:
    """A worker process for a later attempt: imported and waiting. `go` hands it the command's module,
    arguments and environment; until then it costs memory, not CPU."""

    def __init__(self, env: dict[str, str], module: str | None = None):
        command = [sys.executable, "-m", "liandan.resilience.standby", *([module] if module else [])]
        self.proc = subprocess.Popen(
            command, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        )  # fmt: skip

    def go(self, module: str, args: list[str], env: dict[str, str]) -> subprocess.Popen | None:
        """Start it; None if it is no longer there to start."""
        if self.proc.poll() is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps({"module": module, "args": args, "env": env}) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            return None
        return self.proc

    def dismiss(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except (BrokenPipeError, OSError):
                pass


class StandbyPool:
    """The worker processes of one later attempt, started ahead of need."""

    def __init__(self, size: int):
        self.size, self.number, self.processes = size, None, []

    def prepare(self, number: int, env: dict[str, str], module: str | None = None) -> None:
        """Start the worker processes of attempt `number`, importing the worker's entry `module` ahead of need."""
        if self.number != number:
            self.dismiss()
            self.number, self.processes = number, [Standby(env, module) for _ in range(self.size)]

    def take(self, number: int) -> list[Standby] | None:
        """The standbys prepared for attempt `number` (others are dismissed)."""
        if self.number == number:
            taken, self.number, self.processes = self.processes, None, []
            return taken
        self.dismiss()
        return None

    def dismiss(self) -> None:
        for process in self.processes:
            process.dismiss()
        self.number, self.processes = None, []
