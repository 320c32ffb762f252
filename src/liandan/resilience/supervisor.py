"""The run supervisor: starts the workers, watches them, and restarts them after a crash or a hang from the
newest verified checkpoint, until the run finishes or a restart budget is spent.

A crash is a non-zero exit (a signal, an exception, a rank dying). A hang is no heartbeat progress from any
rank for longer than a timeout learned from the step times seen so far (hang_factor x median, at least
hang_floor_s; startup_timeout_s before the first step): the supervisor then asks every rank for its Python
stacks (SIGUSR1, faulthandler), records them, kills the workers and restarts. Every failure is an incident
in events.jsonl with its evidence and the steps and seconds it cost; the run's goodput (the share of wall
time spent on steps that were kept) goes into summary.json.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from liandan.config import Config
from liandan.track.logger import read_metrics
from liandan.train.heartbeat import read_heartbeats

POLL_S = 0.2


@dataclass
class Attempt:
    number: int
    started: float
    exit_code: int | None = None
    hang: bool = False
    last_lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=30))


class Supervisor:
    def __init__(self, cfg: Config, worker_cmd: list[str], run_dir: Path, nproc: int = 1, say=print):
        self.cfg, self.r, self.nproc = cfg, cfg.resilience, nproc
        self.worker_cmd, self.run_dir, self.say = worker_cmd, Path(run_dir), say
        self.heartbeat_dir = self.run_dir / "heartbeat"
        self.logs = self.run_dir / "logs"
        self.step_seconds: list[float] = []
        self.pending_recovery: dict | None = None

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> int:
        started = time.time()
        self.logs.mkdir(parents=True, exist_ok=True)
        failures: list[tuple[str, int]] = []
        restarts = 0
        while True:
            attempt = self._start(restarts)
            self._watch(attempt)
            if attempt.exit_code == 0 and not attempt.hang:
                self._finish(started, restarts, gave_up=None)
                return 0
            if attempt.exit_code == 2 and not attempt.hang:
                return 2  # a user error (bad config, missing file): it said so; restarting cannot help
            incident = self._record_failure(attempt)
            failures.append((incident["cause"], incident["step"]))
            repeats = _trailing_repeats(failures)
            reason = None
            if repeats >= self.r.same_failure_limit:
                reason = f"the same failure ({incident['cause']}) recurred {repeats} times at step {incident['step']}"
            elif restarts >= self.r.max_restarts:
                reason = f"the restart budget ({self.r.max_restarts}) is spent"
            if reason:
                self._event("gave_up", reason=reason, step=incident["step"])
                self.say(f"liandan: supervisor gave up: {reason}; last failure: {incident['summary']}")
                self._finish(started, restarts, gave_up=reason)
                return 1
            restarts += 1
            delay = min(60.0, self.r.backoff_s * 2 ** (restarts - 1))
            self.say(f"supervisor: {incident['summary']}; restart {restarts}/{self.r.max_restarts} in {delay:.1f}s")
            self._event("restart", attempt=restarts, after_seconds=delay, step=incident["step"])
            time.sleep(delay)  # backoff: a flapping node or file system gets a moment to recover

    def _start(self, number: int) -> Attempt:
        for stale in self.heartbeat_dir.glob("rank-*.json"):
            stale.unlink(missing_ok=True)
        env = dict(os.environ, LIANDAN_SUPERVISED="1", LIANDAN_ATTEMPT=str(number), PYTHONUNBUFFERED="1",
                   LIANDAN_FAILURE_FILE=str(self.logs / "failure.json"))  # fmt: skip
        if shutil.which("nvidia-smi"):  # NCCL settings, only where NCCL can run
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a dead peer fails the collective, not hangs
            env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # the NCCL flight recorder, for hang forensics
            env.setdefault("TORCH_FR_DUMP_ON_TIMEOUT", "1")
        attempt = Attempt(number, time.time())
        log = self._log = open(self.logs / f"attempt-{number}.log", "w")
        self.proc = subprocess.Popen(
            self.worker_cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,  # its own process group: a hang is ended by killing the whole group
        )  # fmt: skip
        lock = threading.Lock()
        self.relays = [
            threading.Thread(target=self._relay, args=(stream, sink, log, lock, attempt), daemon=True)
            for stream, sink in ((self.proc.stdout, sys.stdout), (self.proc.stderr, sys.stderr))
        ]
        for relay in self.relays:
            relay.start()
        return attempt

    @staticmethod
    def _relay(stream, sink, log, lock: threading.Lock, attempt: Attempt) -> None:
        """Pass the workers' output through unchanged, keep a log per attempt and the last lines."""
        for line in stream:
            sink.write(line)
            sink.flush()
            with lock:
                log.write(line)
                log.flush()
                attempt.last_lines.append(line.rstrip("\n"))

    def _watch(self, attempt: Attempt) -> None:
        last_key, last_change, last_step_time, top_step = None, time.time(), None, -1
        while self.proc.poll() is None:
            beats = read_heartbeats(self.heartbeat_dir)
            key = tuple((b["rank"], b["step"], b["phase"]) for b in beats)
            now = time.time()
            if key != last_key:
                last_key, last_change = key, now
                step = max((b["step"] for b in beats), default=-1)
                if step > top_step:
                    if last_step_time is not None and top_step >= 0:
                        self.step_seconds.append(now - last_step_time)
                    top_step, last_step_time = step, now
                    self._note_recovery(step)
            finishing = bool(beats) and all(b["phase"] == "done" for b in beats)
            started = top_step >= 0 and bool(self.step_seconds) and not finishing  # shutdown may take a while
            if now - last_change > self.hang_timeout(started=started):
                attempt.hang = True
                self._handle_hang(attempt, beats, now - last_change)
                break
            time.sleep(POLL_S)
        attempt.exit_code = self.proc.wait()
        final = max((b["step"] for b in read_heartbeats(self.heartbeat_dir)), default=-1)
        self._note_recovery(final)  # the last steps may have run between two polls
        for relay in self.relays:
            relay.join(timeout=10)
        self._log.close()

    def hang_timeout(self, started: bool) -> float:
        if not started:
            return self.r.startup_timeout_s
        return max(self.r.hang_floor_s, self.r.hang_factor * statistics.median(self.step_seconds[-50:]))

    # -- failures -----------------------------------------------------------------------------------------
    def _handle_hang(self, attempt: Attempt, beats: list[dict], stalled: float) -> None:
        stacks_dir = self.heartbeat_dir / "stacks"
        before = {p: p.stat().st_size for p in stacks_dir.glob("rank-*.txt")} if stacks_dir.is_dir() else {}
        for beat in beats:
            try:
                os.kill(beat["pid"], signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + 5.0  # faulthandler writes from a signal handler: give it a moment
        while time.time() < deadline and not all(
            (stacks_dir / f"rank-{b['rank']:05d}.txt").is_file()
            and (stacks_dir / f"rank-{b['rank']:05d}.txt").stat().st_size > before.get(stacks_dir / f"rank-{b['rank']:05d}.txt", 0)
            for b in beats
        ):  # fmt: skip
            time.sleep(0.05)
        attempt.stacks = {b["rank"]: _read(stacks_dir / f"rank-{b['rank']:05d}.txt") for b in beats}
        attempt.stalled = stalled
        attempt.beats = beats
        # torchrun starts each worker in a session of its own: end every group, not only the launcher's.
        for pgid in {self.proc.pid, *(b["pid"] for b in beats)}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _record_failure(self, attempt: Attempt) -> dict:
        beats = getattr(attempt, "beats", None) or read_heartbeats(self.heartbeat_dir)
        step = max((b["step"] for b in beats), default=0)
        resume_step = _latest_complete_step(self.run_dir / "checkpoints", self.cfg)
        host = socket.gethostname()
        if attempt.hang:
            # The rank that stopped first: the oldest heartbeat (its peers then wait for it in a collective).
            stuck = min(beats, key=lambda b: b["time"]) if beats else {}
            cause = f"hang in {stuck.get('phase', '?')}"
            rank = stuck.get("rank")
            evidence = {"stalled_seconds": round(attempt.stalled, 1), "timeout_seconds": round(self.hang_timeout(True), 1),
                        "ranks": beats, "stacks": attempt.stacks}  # fmt: skip
            summary = f"hang: no progress for {attempt.stalled:.0f}s, rank {rank} stuck in {stuck.get('phase')} at step {step}"
            kind = "hang"
        else:
            code = attempt.exit_code
            cause = f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
            failure = _read_json(self.logs / "failure.json")
            rank = failure.get("rank", 0 if self.nproc == 1 else None)
            if failure.get("exitcode") is not None and failure["exitcode"] < 0:
                cause = f"signal {signal.Signals(-failure['exitcode']).name}"
            elif failure.get("exitcode") is not None:
                cause = f"exit code {failure['exitcode']}"
            evidence = {"exit_code": code, "last_lines": list(attempt.last_lines)}
            summary = f"crash: rank {rank} ended with {cause} at step {step}"
            kind = "crash"
        lost_steps = max(0, step - resume_step)
        incident = {"failure": kind, "cause": cause, "step": step, "rank": rank, "host": host, "attempt": attempt.number,
                    "resume_step": resume_step, "steps_lost": lost_steps,
                    "seconds_lost": round(_seconds_since_step(self.run_dir, resume_step), 2), "evidence": evidence,
                    "summary": summary}  # fmt: skip
        self._event("incident", **incident)
        self.pending_recovery = {"failed_at": time.time(), "step": resume_step}
        (self.logs / "failure.json").unlink(missing_ok=True)
        return incident

    def _note_recovery(self, step: int) -> None:
        """The first completed step after a restart: how long recovery took."""
        if self.pending_recovery and step > self.pending_recovery["step"]:
            seconds = time.time() - self.pending_recovery["failed_at"]
            self._event("recovered", step=step, seconds=round(seconds, 2))
            self.pending_recovery = None

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> None:
        with open(self.run_dir / "events.jsonl", "a") as f:
            f.write(json.dumps({"time": time.time(), "kind": kind, **fields}, default=str) + "\n")

    def _finish(self, started: float, restarts: int, gave_up: str | None) -> None:
        wall = time.time() - started
        kept = sum(r.get("step_time_s", 0.0) for r in read_metrics(self.run_dir))
        goodput = kept / wall if wall else 0.0
        summary_path = self.run_dir / "summary.json"
        summary = _read_json(summary_path)
        summary.update(supervisor_wall_seconds=round(wall, 2), kept_step_seconds=round(kept, 2),
                       goodput=goodput, restarts=restarts, gave_up=gave_up)  # fmt: skip
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")
        self._event("supervisor_end", restarts=restarts, goodput=goodput, gave_up=gave_up)
        self.say(f"supervisor: {restarts} restart(s); goodput {100 * goodput:.1f}% "
                 f"({kept:.1f}s of kept steps in {wall:.1f}s)")  # fmt: skip


def _trailing_repeats(failures: list[tuple[str, int]]) -> int:
    n = 0
    for failure in reversed(failures):
        if failure != failures[-1]:
            break
        n += 1
    return n


def _read(path: Path) -> str:
    try:
        return path.read_text()[-20000:]
    except OSError:
        return ""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _latest_complete_step(root: Path, cfg: Config) -> int:
    """The step the next attempt resumes from: the newest checkpoint that verifies, as the workers will
    find it (0 when none does)."""
    from liandan.checkpoint.manager import newest_verified

    found = newest_verified(Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else root, cfg.checkpoint.verify)
    return int(found.name[5:]) if found else 0


def _seconds_since_step(run_dir: Path, step: int) -> float:
    """Wall time from the end of `step` (the checkpoint resumed from) to now: work that is redone."""
    records = read_metrics(run_dir)
    times = [r["time"] for r in records if r["step"] == step]
    start = times[-1] if times else (records[0]["time"] - records[0].get("step_time_s", 0) if records else time.time())
    return time.time() - start
