"""An attempt of the supervisor's workers, and what its failure is recorded as (a base of Supervisor, whose
state it uses): the incident with its evidence, the step the next attempt resumes from, the steps and seconds
the failure cost, and how long recovery took.
"""

from __future__ import annotations

import collections
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from liandan.checkpoint import handoff
from liandan.checkpoint import snapshot_dirs as snapshots
from liandan.checkpoint.resume import choose_resume
from liandan.checkpoint.verify import complete_checkpoints, step_of
from liandan.resilience import nodes
from liandan.run import read_json
from liandan.train.heartbeat import stopped_first

ATTRIBUTION_GRACE_S = 5.0  # how long a node waits for the other nodes' view of a failure


@dataclass
class Attempt:
    """One start of the workers: its processes, how it ended, and the evidence of a failure."""

    number: int
    started: float
    token: str
    procs: list[tuple[int | None, subprocess.Popen]] = field(default_factory=list)  # (rank or None, process)
    exit_code: int | None = None
    failed_rank: int | None = None
    failed_at: float | None = None
    user_error: str | None = None
    device_fault: bool = False  # the workers stopped on a device that computes wrong (`DeviceFault`)
    hang: bool = False
    stalled: float = 0.0
    timeout: float = 0.0
    beats: list[dict] = field(default_factory=list)
    stacks: dict = field(default_factory=dict)
    exits: dict[int, tuple[float, int]] = field(default_factory=dict)  # rank -> (time, exit code)
    survivors: list[int] = field(default_factory=list)
    ended: bool = False
    last_lines: collections.deque = field(default_factory=lambda: collections.deque(maxlen=30))


class FailureRecords:
    """The record of a failed attempt and of the recovery after it (a base of Supervisor)."""

    def _record_failure(self, attempt: Attempt) -> dict:
        beats = attempt.beats or self._beats(attempt)
        step = max((b["step"] for b in beats), default=0)
        resume_step = self._resume_step()
        failed_at = attempt.failed_at or time.time()
        host, attribution = self.node, None
        if attempt.hang:
            stuck = stopped_first(beats) if beats else {"phase": "startup", "host": self.node}
            cause = f"hang in {stuck['phase']}"
            rank, host = stuck.get("rank"), stuck["host"]
            evidence = {"stalled_seconds": round(attempt.stalled, 1), "timeout_seconds": round(attempt.timeout, 1),
                        "ranks": beats, "stacks": attempt.stacks,
                        "nccl_traces": [str(p) for p in self.room.nccl_traces(self.log_node)]}  # fmt: skip
            summary = (
                f"hang: no progress for {attempt.stalled:.0f}s, rank {rank} stuck in {stuck['phase']} at step {step}"
            )
            kind, since = "hang", stuck.get("time", attempt.started)
        else:
            code = attempt.exit_code
            cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            if self.rendezvous:
                report = read_json(self.failure_report, {})
                if report.get("exitcode") is not None:
                    code = report["exitcode"]
                    cause = f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
            rank = attempt.failed_rank
            pids = {rank: proc.pid for rank, proc in attempt.procs}
            exits = {
                r: {"code": c, "after_s": round(t - failed_at, 3), "pid": pids.get(r)}
                for r, (t, c) in attempt.exits.items()
            }
            evidence = {"exit_code": code, "last_lines": list(attempt.last_lines), "exits": exits,
                        "tracebacks": dict(self.relay.tracebacks)}  # fmt: skip
            summary = f"crash: rank {rank} ended with {cause} at step {step}"
            kind, since = "crash", failed_at
        if self.rendezvous:
            output = read_tail(self.room.attempt_log(attempt.number, self.log_node), 1 << 20)
            secondary = kind == "crash" and nodes.lost_a_peer(output)
            nodes.write_report(
                self.run_dir, self.node, {"since": since, "origin": host, "cause": cause, "secondary": secondary}
            )
            participants = {}
            for b in beats:
                participants[b["host"]] = max(participants.get(b["host"], 0.0), b["time"])
            host, attribution = nodes.attribute(self.run_dir, attempt.started, participants, ATTRIBUTION_GRACE_S)
            summary += f" (attributed to node {host})"
            rank = rank if host == self.node or attempt.hang else None  # a local rank means nothing there
        incident = {"failure": kind, "cause": cause, "step": step, "rank": rank, "host": host, "attempt": attempt.number,
                    "resume_step": resume_step, "steps_lost": max(0, step - resume_step),
                    "seconds_lost": round(self._redone_seconds(attempt, resume_step, failed_at), 2),
                    "workers_left_alive": attempt.survivors, "evidence": evidence, "summary": summary}  # fmt: skip
        if self.rendezvous:
            incident.update(reported_by=self.node, attribution=attribution)
        incident["time"] = self._event("incident", **incident)
        self.pending_recovery = {"failed_at": time.time(), "step": resume_step}
        self.failure_report.unlink(missing_ok=True)
        return incident

    def _resume_step(self) -> int:
        """The step the next attempt resumes from: the newest memory snapshot that every rank holds or the
        newest checkpoint that verifies, as the workers will find them (0 when there is neither). The
        checkpoint verdict is handed to the workers, who then need not verify again."""
        c = self.cfg.checkpoint
        root = self.room.checkpoints
        in_memory = None
        if self.snapshots and not self.rendezvous:  # on several nodes, the ranks agree among themselves
            in_memory = snapshots.newest_common_step(self.snapshots, self.nproc, self.id)
        complete = complete_checkpoints(root)
        point = choose_resume(
            in_memory,
            step_of(complete[-1]) if complete else None,
            lambda: handoff.verify_and_hand_over(root, c.verify, self.verdict, self._event),
        )
        if point.source == "memory":  # the workers will read no checkpoint: none is handed over
            self.verdict.unlink(missing_ok=True)
        return point.step

    def _redone_seconds(self, attempt: Attempt, resume_step: int, failed_at: float) -> float:
        """Seconds of this attempt's work that the next one does again: from when this attempt stood at the
        resumed checkpoint (its start of training, or the last record at or before that step) to the failure."""
        began = None
        for e in self.room.read_events():
            if e["kind"] == "train_start" and e["time"] >= attempt.started and e["step"] >= resume_step:
                began = e["time"]
                break
        if began is None:
            records = [r for r in self.room.read_metrics() if r["time"] >= attempt.started and r["step"] <= resume_step]
            began = records[-1]["time"] if records else None
        return max(0.0, failed_at - began) if began is not None else 0.0

    def _note_recovery(self, step: int) -> None:
        """The first completed step after a restart: how long recovery took."""
        if self.pending_recovery and step > self.pending_recovery["step"]:
            seconds = time.time() - self.pending_recovery["failed_at"]
            self._event("recovered", step=step, seconds=round(seconds, 2))
            self.pending_recovery = None


def trailing_repeats(failures: list[tuple[str, int]]) -> int:
    """How many times the last failure (cause, step) recurred in a row at the end of `failures`."""
    n = 0
    for failure in reversed(failures):
        if failure != failures[-1]:
            break
        n += 1
    return n


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_tail(path: Path, tail: int = 20000) -> str:
    try:
        return path.read_text(errors="replace")[-tail:]
    except OSError:
        return ""
