"""The run supervisor: starts the workers, watches them, and restarts them after a crash or a hang from the
newest verified checkpoint, until the run finishes or a restart budget is spent.

On one node the supervisor starts the ranks itself (it hosts their rendezvous store, as torchrun's agent
would), so it sees the first rank to fail to the millisecond and ends the others at once. On several nodes
each node's supervisor runs torchrun's elastic agent (see nodes.py). A crash is a rank that exits non-zero.
A hang is no heartbeat progress for longer than the timeout of the phases the ranks are in: for the parts of
a training step hang_factor x the median step time (at least hang_floor_s), or less when the rank that stopped
first is in a part of a step that it reports usually takes far less (hang_factor x its longest recent time
there, at least hang_floor_s); for checkpoints and evaluation
hang_factor x the longest one seen (startup_timeout_s before one has been seen); startup_timeout_s for the
start-up and the teardown after the last step. The ranks time their steps, checkpoints and evaluations
themselves and report the times in their heartbeats: steps shorter than the supervisor's poll count too.
The supervisor then asks every rank for its Python stacks (SIGUSR1, faulthandler), records them, and kills
every process of the attempt. Every failure is an incident in events.jsonl with its evidence and the steps
and seconds it cost; the run's goodput (the share of wall time spent on steps that were kept, over every
launch of the run) goes into summary.json.

The watch over an attempt (exits, hangs, their stacks) is in watch.py, the record of an attempt and of its
failure in attempts.py, and preemption in preempt.py: bases of Supervisor that share its state.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from liandan.checkpoint import snapshot_dirs as snapshots
from liandan.config import Config
from liandan.resilience import incidents, nodes, suspects
from liandan.resilience.attempts import Attempt, FailureRecords, trailing_repeats
from liandan.resilience.preempt import Preemption, SignalLatch
from liandan.resilience.processes import (
    DeathClock,
    StandbyPool,
    alive,
    end_processes,
    module_command,
)
from liandan.resilience.relay import Relay
from liandan.resilience.watch import WorkerWatch
from liandan.run import RunDir, append_jsonl, atomic_write_json, lock_run_dir, temporary
from liandan.run.errors import DEVICE_FAULT_EXIT
from liandan.run.layout import rank_file
from liandan.run.worker_env import CRASHED, WORKER_NAMES, NodeEnv, WorkerEnv, node_name
from liandan.track.store import ingest_quietly
from liandan.train import stores

EXCLUDED_EXIT = 3  # this node is excluded from the run: it does not join (the other nodes carry on)
ERROR_PREFIX = "liandan: error: "


class Supervisor(WorkerWatch, FailureRecords, Preemption):
    def __init__(self, cfg: Config, worker_cmd: list[str], run_dir: Path, nproc: int = 1, say=print,
                 attempt_env: Callable[[int], dict[str, str]] | None = None):  # fmt: skip
        self.cfg, self.r, self.nproc = cfg, cfg.resilience, nproc
        self.worker_cmd, self.run_dir, self.say = worker_cmd, Path(run_dir), say
        self.attempt_env = attempt_env or (lambda number: {})
        self.room = RunDir.of(self.run_dir, cfg.checkpoint.dir)
        self.node = node_name()
        self.rendezvous = nodes.rendezvous_from_env(default_id=self.run_dir.name)
        self.log_node = self.node if self.rendezvous else None  # each node's logs apart on several nodes
        self.logs = self.room.node_logs(self.log_node)
        self.verdict = self.room.verdict(self.log_node)
        self.errors = self.room.worker_errors(self.log_node)  # where workers leave a user error's message
        self.failure_report = self.room.failure_report(self.log_node)
        self.exclusions = nodes.ExclusionList(self.run_dir, nodes.failure_limit()) if self.rendezvous else None
        self.id = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.module = module_command(worker_cmd)
        self.use_standby = bool(self.module) and not self.rendezvous and NodeEnv.from_env().standby
        self.standby = StandbyPool(nproc)
        # What the ranks' heartbeats report (watch.py): their median step time and their longest checkpoint
        # and evaluation, the slowest rank's; an attempt starts with the one before it's.
        self.step_seconds: float | None = None
        self.phase_seconds: dict[str, float] = {}
        self.pending_recovery: dict | None = None
        self.snapshots: Path | None = None  # this supervisor's memory snapshot directory, made by run()
        self.store_warned = False

    # -- the loop -----------------------------------------------------------------------------------------
    def run(self) -> int:
        """Supervise the run to its end, holding the run directory's lock all along (its workers take none).
        On several nodes each node's supervisor holds a lock of its own node."""
        lock = lock_run_dir(self.room, self.room.node_lock(self.node).name if self.rendezvous else None)
        try:
            return self._supervise()
        finally:
            lock.release()

    def _supervise(self) -> int:
        started = time.time()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.verdict.unlink(missing_ok=True)  # a verdict is handed over only moments after it
        temporary(self.verdict).unlink(missing_ok=True)  # half-written by an earlier one
        if self.exclusions and self.node in self.exclusions.excluded():
            return self._refuse(self.exclusions.excluded()[self.node])
        failures: list[tuple[str, int]] = []
        restarts, streak, last_resume = 0, 0, None
        attempt = None
        c = self.cfg.checkpoint
        for left in snapshots.remove_stale(self.run_dir, c.memory_dir):  # earlier supervisors' (never ours)
            self.say(f"supervisor: warning: cannot remove an earlier memory snapshot directory {left}")
        self.snapshots = snapshots.create_dir(self.run_dir, c.memory_dir) if c.memory_every else None
        self.signals = SignalLatch().install()
        self._event("supervisor_start", supervisor=self.id, node=self.node)  # goodput counts every launch
        try:
            while True:
                if self.signals.first:
                    return self._preempt(attempt)
                attempt = self._start(restarts)
                self._watch(attempt)
                if self.signals.first and not attempt.exits:
                    return self._preempt(attempt)
                self._let_peers_fail(attempt)
                self._end(attempt)
                if attempt.exit_code == 0 and not attempt.hang:
                    self._finish(started, restarts, gave_up=None)
                    return 0
                # A worker whose message file had no room (a full disk) printed its error itself. (On several
                # nodes torchrun's agent prints every failure so, user error or not: its exit code tells.)
                printed = [line for line in attempt.last_lines if line.startswith(ERROR_PREFIX) and not self.rendezvous]
                if attempt.user_error is None and printed and not attempt.hang:
                    attempt.user_error = printed[-1][len(ERROR_PREFIX) :]
                if attempt.device_fault:
                    fault = suspects.device_fault(self.room, attempt.started)
                    if not (self.rendezvous and fault.get("host") not in (None, self.node)):
                        return self._stop_for_device(fault, started, restarts)
                    # another node's device: that node leaves, this one starts again without it
                    restarts += 1
                    self._event("restart", attempt=restarts, after_seconds=0.0, step=fault.get("step"))
                    continue
                if attempt.user_error is not None:  # a bad config, a missing file: restarting cannot help
                    log = self.room.attempt_log(attempt.number, self.log_node)
                    message = attempt.user_error or f"a worker ended with a user error; its output is in {log}"
                    # the run's records say it ended, and why, rather than leave it "running" until stale
                    self._event("train_stopped", error=message, cause="user error")
                    if not self.rendezvous and not printed:  # else torchrun's agent or the worker printed it
                        print(ERROR_PREFIX + message, file=sys.stderr)
                    return 2
                self._prepare_standby(restarts + 1)  # its imports overlap the bookkeeping below
                incident = self._record_failure(attempt)
                ours = incident["host"] == self.node or not self.rendezvous
                if self.exclusions and ours:
                    count, excluded = self.exclusions.record_failure(self.node, {k: incident[k] for k in
                                                                     ("time", "cause", "step", "summary")})  # fmt: skip
                    if excluded:
                        return self._leave(count, incident)
                straggling = suspects.stragglers_on(self.room, self.node, attempt.started)
                if self.exclusions and straggling and self.cfg.health.exclude_stragglers:
                    return self._exclude_straggler(straggling[-1])
                # Progress since the last failure (a newer checkpoint) starts a fresh streak: restart at once.
                streak = streak + 1 if last_resume is not None and incident["resume_step"] <= last_resume else 1
                last_resume = incident["resume_step"]
                reason = None
                if ours:  # a failure that began on another node is that node's to count
                    failures.append((incident["cause"], incident["step"]))
                    repeats = trailing_repeats(failures)
                    if repeats >= self.r.same_failure_limit:
                        reason = f"the same failure ({incident['cause']}) recurred {repeats} times at step {incident['step']}"
                if reason is None and restarts >= self.r.max_restarts:
                    reason = f"the restart budget ({self.r.max_restarts}) is spent"
                if reason:
                    self._event("gave_up", reason=reason, step=incident["step"])
                    self.say(f"liandan: supervisor gave up: {reason}; last failure: {incident['summary']}")
                    self._finish(started, restarts, gave_up=reason)
                    return 1
                restarts += 1
                delay = 0.0 if streak == 1 else min(60.0, self.r.backoff_s * 2 ** (streak - 2))
                self.say(f"supervisor: {incident['summary']}; restart {restarts}/{self.r.max_restarts}"
                         + (f" in {delay:.1f}s" if delay else " now"))  # fmt: skip
                self._event("restart", attempt=restarts, after_seconds=delay, step=incident["step"])
                self.signals.wake.wait(delay)  # a failure that recurs without progress: give things a moment
        finally:
            self.signals.close()
            if attempt is not None:  # interrupted or not: leave nothing running
                self._end(attempt)
            self.standby.dismiss()
            self._remove_snapshots()  # give the host memory back
            if not self.signals.first:  # preempted, time is short: the next launch's workers hand them on
                self._export_events()

    def _remove_snapshots(self) -> None:
        try:
            snapshots.remove_dir(self.snapshots)
        except OSError as err:  # host memory stays taken until someone removes it: say so
            self.say(f"supervisor: warning: cannot remove the memory snapshots in {self.snapshots}: {err}")
        self.snapshots = None

    def _export_events(self) -> None:
        """The events recorded after the last worker ended (gave_up, supervisor_end...), to the trackers of
        `[track] exporters`; on several nodes the next launch's workers hand them on, not every node at once."""
        if self.rendezvous or not self.cfg.track.exporters:
            return
        from liandan.track.exporters import hand_on_events

        try:
            hand_on_events(self.room, self.cfg, say=self._warn)
        except Exception as err:  # noqa: BLE001 - the run's files have them; the trackers are a copy
            self._warn(f"cannot hand the last events to the trackers: {type(err).__name__}: {err}")

    def _start(self, number: int) -> Attempt:
        self._clear_heartbeats()
        attempt = Attempt(number, time.time(), token=f"{self.id}-{number}")
        shutil.rmtree(self.errors, ignore_errors=True)
        self.errors.mkdir()
        env = self._env(number)
        self.clock = DeathClock()
        self.store = None
        if self.rendezvous:  # torchrun's elastic agent, in a process that reports the first failure
            command = [sys.executable, "-m", "liandan.resilience.agent", f"--nproc={self.nproc}",
                       *self.rendezvous.torchrun_args(), "--", *self.worker_cmd]  # fmt: skip
            attempt.procs.append((None, self._popen(command, env)))
        else:
            if self.nproc > 1:  # the ranks' rendezvous store, hosted here as torchrun's agent would
                self.store = stores.bound_store(stores.LOOPBACK, 0)
            standby = self.standby.take(number)
            for rank in range(self.nproc):
                rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(self.nproc),
                            "LOCAL_WORLD_SIZE": str(self.nproc), "GROUP_RANK": "0", "MASTER_ADDR": stores.LOOPBACK,
                            "MASTER_PORT": str(self.store.port if self.store else 0),
                            "TORCHELASTIC_USE_AGENT_STORE": str(self.store is not None)}  # fmt: skip
                proc = standby[rank].go(*self.module, rank_env) if standby else None
                attempt.procs.append((rank, proc or self._popen(self.worker_cmd, rank_env)))
        self.relay = Relay(self.room.attempt_log(number, self.log_node), lambda label: self._peer_ended(attempt, label))
        attempt.last_lines = self.relay.last_lines
        for rank, proc in attempt.procs:
            self.clock.watch(proc.pid)
            label = f"rank {rank}" if rank is not None else f"node {self.node}"
            for stream, sink in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                self.relay.start(label, stream, sink)
        return attempt

    def _peer_ended(self, attempt: Attempt, label: str) -> bool:
        return peer_ended_first(attempt.procs, self.errors, label)

    def _env(self, number: int) -> dict[str, str]:
        """The workers' environment for attempt `number`: this process's, the `attempt_env` hook's additions,
        and the supervisor-worker contract (`liandan.run.worker_env`) for this attempt."""
        inherited = {**os.environ, **self.attempt_env(number)}
        verified = self.verdict
        worker = WorkerEnv.from_env(inherited).for_attempt(
            number, attempt_token=f"{self.id}-{number}", snapshot_owner=self.id, error_dir=self.errors,
            failure_file=self.failure_report, verified_checkpoint=verified if verified.is_file() else None,
            snapshot_dir=self.snapshots, preempt_grace_s=self.r.preempt_grace_s,
        )  # fmt: skip
        env = {k: v for k, v in inherited.items() if k not in WORKER_NAMES}
        env.update(PYTHONUNBUFFERED="1", **worker.to_env())
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // self.nproc)))  # share the cores
        if not self.rendezvous:  # one node: the process group's sockets listen on loopback only
            for key, value in stores.single_node_env().items():
                env.setdefault(key, value)
        if shutil.which("nvidia-smi"):  # NCCL settings, only where NCCL can run
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")  # a dead peer fails the collective, not hangs
            env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")  # the NCCL flight recorder, for hang forensics
            env.setdefault("TORCH_FR_DUMP_ON_TIMEOUT", "1")
            env.setdefault(
                "TORCH_FR_DUMP_TEMP_FILE", str(self.room.nccl_trace_prefix(self.log_node))
            )  # kept with the run
        return env

    @staticmethod
    def _popen(command: list[str], env: dict[str, str]) -> subprocess.Popen:
        return subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip

    # -- standby workers ----------------------------------------------------------------------------------
    def _prepare_standby(self, number: int) -> None:
        """Start attempt `number`'s worker processes now, so that their start-up is done when needed."""
        if self.use_standby and self.standby.number != number:
            self.standby.prepare(number, self._env(number), self.module[0])

    def _end(self, attempt: Attempt) -> None:
        """Kill whatever is left of the attempt, its workers' own sessions and children included."""
        if attempt.ended:
            return
        attempt.ended = True
        pids = [proc.pid for _, proc in attempt.procs] + [b["pid"] for b in attempt.beats if b["host"] == self.node]
        attempt.survivors = end_processes(attempt.token, pids)
        for _, proc in attempt.procs:
            proc.wait()
        self.relay.close()
        self.clock.close()
        self.store = None
        if attempt.exit_code is None:
            attempt.exit_code = -signal.SIGKILL

    # -- nodes --------------------------------------------------------------------------------------------
    def _refuse(self, entry: dict) -> int:
        path = self.exclusions.path
        self._event("node_refused", node=self.node, reason=entry.get("reason"))
        print(f"liandan: node {self.node} is excluded from run {self.run_dir} ({entry.get('reason')}); it does not "
              f"join, the other nodes carry on. To let it join again, remove it from {path}.", file=sys.stderr)  # fmt: skip
        return EXCLUDED_EXIT

    def _stop_for_device(self, fault: dict, started: float, restarts: int) -> int:
        """A rank's device failed its golden test: mark its node and end the run (restarting on that device
        would corrupt the run again). Several nodes: the node is excluded and leaves; the others carry on."""
        exclusions = self.exclusions or nodes.ExclusionList(self.run_dir, nodes.failure_limit())
        host, reason = suspects.mark_device(exclusions, fault, self.node, exclude=bool(self.rendezvous))
        self._event("device_fault", node=host, rank=fault.get("rank"), step=fault.get("step"),
                    excluded=bool(self.rendezvous), reason=reason)  # fmt: skip
        if self.rendezvous:
            print(f"liandan: node {host} is excluded from run {self.run_dir}: {reason}; the other nodes carry on"
                  f" without it (list: {exclusions.path})", file=sys.stderr)  # fmt: skip
            return EXCLUDED_EXIT
        self._finish(started, restarts, gave_up=reason)
        print(f"{ERROR_PREFIX}{reason} on {host}; recorded as a suspect in {exclusions.path}; the run stopped"
              " instead of training on that device again: replace it or move the run, then start it again to"
              " resume", file=sys.stderr)  # fmt: skip
        return DEVICE_FAULT_EXIT

    def _exclude_straggler(self, straggler: dict) -> int:
        reason = suspects.mark_straggler(self.exclusions, self.node, straggler)
        self._event("node_excluded", node=self.node, failures=0, step=straggler["step"], reason=reason)
        print(f"liandan: node {self.node} is excluded from run {self.run_dir}: {reason} (health.exclude_stragglers);"
              f" the other nodes carry on without it (list: {self.exclusions.path})", file=sys.stderr)  # fmt: skip
        return EXCLUDED_EXIT

    def _leave(self, count: int, incident: dict) -> int:
        self._event("node_excluded", node=self.node, failures=count, step=incident["step"])
        print(f"liandan: node {self.node} is excluded from run {self.run_dir} after {count} failures attributed to "
              f"it; the other nodes carry on without it (list: {self.exclusions.path})", file=sys.stderr)  # fmt: skip
        return EXCLUDED_EXIT

    # -- bookkeeping --------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> float:
        """Record an event; one the disk has no room for is said on stderr instead, and supervision goes on."""
        now = time.time()
        path = self.room.events
        try:
            append_jsonl(path, {"time": now, "kind": kind, **fields})
        except OSError as err:
            self._warn(f"cannot record the {kind} event in {path}: {type(err).__name__}: {err.strerror or err}")
        if self.cfg.track.store:  # the project's index of runs shows the incident, the restart, the end at once
            note = ingest_quietly(self.room)
            if note and not self.store_warned:  # one warning: the store stays as broken for every event
                self.store_warned = True
                self._warn(note)
        return now

    @staticmethod
    def _warn(message: str) -> None:
        print(f"supervisor: warning: {message}", file=sys.stderr, flush=True)

    def _finish(self, started: float, restarts: int, gave_up: str | None) -> None:
        now = time.time()
        kept, wall, launches = incidents.goodput(self.run_dir, (started, now), self.id)
        goodput = kept / wall if wall else 0.0
        summary_path = self.room.summary
        summary = self.room.read_summary()
        summary.update(supervisor_wall_seconds=round(wall, 2), kept_step_seconds=round(kept, 2), goodput=goodput,
                       supervisor_launches=launches, restarts=restarts, gave_up=gave_up)  # fmt: skip
        try:
            atomic_write_json(summary_path, summary)
        except OSError as err:
            self._warn(f"cannot write {summary_path}: {type(err).__name__}: {err.strerror or err}")
        self._event("supervisor_end", supervisor=self.id, wall_seconds=round(now - started, 2), restarts=restarts,
                    goodput=goodput, gave_up=gave_up)  # fmt: skip
        over = f" over {launches} launches" if launches > 1 else ""
        self.say(f"supervisor: {restarts} restart(s); goodput {100 * goodput:.1f}% "
                 f"({kept:.1f}s of kept steps in {wall:.1f}s{over})")  # fmt: skip


def peer_ended_first(procs: list, errors: Path, label: str) -> bool:
    """Whether a rank among `procs` ((rank, process) pairs) other than `label`'s ended before `label`'s failed:
    `label`'s traceback is then a consequence. A rank that crashed left the time it did in `errors` (`CRASHED`):
    that time decides, not whether it is alive when the traceback is read, since the rank that fails first ends
    at once and the ranks it brings down may end before its traceback has been relayed."""
    crashed = {}
    for rank, _ in procs:
        with contextlib.suppress(OSError, ValueError):
            crashed[rank] = float(rank_file(errors, rank, CRASHED).read_text())
    own = next((crashed.get(rank) for rank, _ in procs if f"rank {rank}" == label), None)
    for rank, proc in procs:
        if rank is None or f"rank {rank}" == label or alive(proc.pid):
            continue
        if own is None or rank not in crashed or crashed[rank] < own:
            return True
    return False
