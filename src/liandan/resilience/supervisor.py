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
start-up and the teardown after the last step. The supervisor then asks every rank for its Python stacks
(SIGUSR1, faulthandler), records them, and kills every process of the attempt. Every failure is an incident
in events.jsonl with its evidence and the steps and seconds it cost; the run's goodput (the share of wall
time spent on steps that were kept, over every launch of the run) goes into summary.json.
"""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from liandan.checkpoint import handoff, snapshots
from liandan.checkpoint.resume import choose_resume
from liandan.checkpoint.verify import complete_checkpoints, step_of
from liandan.config import Config
from liandan.resilience import incidents, nodes, suspects
from liandan.resilience.preempt import Preemption, SignalLatch
from liandan.resilience.processes import (
    DeathClock,
    StandbyPool,
    alive,
    end_processes,
    first_failure,
    module_command,
)
from liandan.resilience.relay import Relay
from liandan.run import RunDir, append_jsonl, atomic_write_json, lock_run_dir, rank_files, read_json, temporary
from liandan.run.errors import DEVICE_FAULT_EXIT
from liandan.run.worker_env import WORKER_NAMES, NodeEnv, WorkerEnv, node_name
from liandan.track.store import ingest_quietly
from liandan.train import stores
from liandan.train.heartbeat import STEP_PHASES, read_heartbeats, stopped_first

POLL_S = 0.2
PEER_EXIT_S = 2.0  # after a rank fails, how long its peers have to fail on their own before they are ended
STACKS_WAIT_S = 2.0  # faulthandler writes from a signal handler: it is there in milliseconds, or never
ATTRIBUTION_GRACE_S = 5.0  # how long a node waits for the other nodes' view of a failure
SLOW_PHASES = ("checkpoint", "eval")
EXCLUDED_EXIT = 3  # this node is excluded from the run: it does not join (the other nodes carry on)
ERROR_PREFIX = "liandan: error: "


@dataclass
class Attempt:
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


class Supervisor(Preemption):
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
        self.step_seconds: list[float] = []
        self.phase_seconds: dict[str, list[float]] = {p: [] for p in SLOW_PHASES}
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
                    if not self.rendezvous and not printed:  # else torchrun's agent or the worker printed it
                        log = self.room.attempt_log(attempt.number, self.log_node)
                        message = attempt.user_error or f"a worker ended with a user error; its output is in {log}"
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
                    repeats = _trailing_repeats(failures)
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

    @staticmethod
    def _peer_ended(attempt: Attempt, label: str) -> bool:
        """Whether a rank of the attempt other than `label`'s has ended: its traceback is a consequence."""
        return any(not alive(proc.pid) for rank, proc in attempt.procs if f"rank {rank}" != label and rank is not None)

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

    # -- watching -----------------------------------------------------------------------------------------
    def _watch(self, attempt: Attempt) -> None:
        last_key, last_change, last_step_time, top_step, progressed = None, time.time(), None, -1, False
        seen: dict[int, dict] = {}
        while True:
            self.clock.wait(POLL_S)
            if self._exited(attempt) or self.signals.first:
                break
            beats = self._beats(attempt)
            now = time.time()
            for beat in beats:
                if self.rendezvous and beat["host"] == self.node:
                    self.clock.watch(beat["pid"])  # the local workers' exact death times, for attribution
                before = seen.get(beat["rank"])
                moved = before and (before["step"], before["phase"]) != (beat["step"], beat["phase"])
                if moved and before["phase"] in SLOW_PHASES:
                    self.phase_seconds[before["phase"]].append(beat["time"] - before["time"])
                seen[beat["rank"]] = beat
            key = tuple((b["rank"], b["step"], b["phase"]) for b in beats)
            if key != last_key:
                last_key, last_change = key, now
                step = max((b["step"] for b in beats if b["phase"] != "startup"), default=-1)
                if step > top_step:
                    if last_step_time is not None:
                        self.step_seconds.append((now - last_step_time) / (step - top_step))
                        progressed = True
                        self._prepare_standby(attempt.number + 1)
                    top_step, last_step_time = step, now
                    self._note_recovery(step)
            timeout = self.hang_timeout([b["phase"] for b in beats], progressed)
            first = self.first_stopped_timeout(beats, progressed)
            timeout = min(timeout, first) if first is not None else timeout
            if now - last_change > timeout:
                attempt.hang, attempt.timeout, attempt.stalled = True, timeout, now - last_change
                self._handle_hang(attempt, beats)
                break
        final = max((b["step"] for b in self._beats(attempt)), default=-1)
        self._note_recovery(final)  # the last steps may have run between two polls

    def _let_peers_fail(self, attempt: Attempt) -> None:
        """A rank failed: its peers fail in their next collective within moments, each printing that a peer went
        away (one line on the console, the traceback in the log and the incident). Wait up to PEER_EXIT_S for
        them to end so, rather than end them before they could say it."""
        if attempt.exit_code in (0, None) or attempt.hang:
            return
        until = time.time() + PEER_EXIT_S
        while not self.signals.first and (left := until - time.time()) > 0:
            if all(proc.poll() is not None for _, proc in attempt.procs):
                return
            self.clock.wait(min(POLL_S, left))

    def _exited(self, attempt: Attempt) -> bool:
        """Whether the attempt is over: every rank done, or one failed (whose exit is then recorded)."""
        for rank, proc in attempt.procs:
            code = proc.poll()
            if code is not None and (rank or 0) not in attempt.exits:
                attempt.exits[rank or 0] = (self.clock.deaths.get(proc.pid, time.time()), code)
        failed = first_failure(attempt.exits)
        if failed:
            attempt.failed_at, attempt.failed_rank, attempt.exit_code = failed
            if self.rendezvous:  # the agent names the rank that failed first
                report = read_json(self.failure_report, {})
                attempt.failed_rank = report.get("rank")
                local = [self.clock.deaths[p] for p in self.clock.deaths if p != attempt.procs[0][1].pid]
                attempt.failed_at = min(local, default=attempt.failed_at)
            reports = rank_files(self.errors, ".txt")
            if reports or attempt.exit_code in (2, DEVICE_FAULT_EXIT):  # whichever rank was seen to end first
                attempt.device_fault = any(code == DEVICE_FAULT_EXIT for _, code in attempt.exits.values())
                attempt.exit_code = DEVICE_FAULT_EXIT if attempt.device_fault else 2
                attempt.user_error = _read(reports[0]).strip() if reports else ""
            return True
        if len(attempt.exits) == len(attempt.procs):
            attempt.exit_code = 0
            return True
        return False

    def _beats(self, attempt: Attempt) -> list[dict]:
        """This attempt's heartbeats (older files of other nodes' earlier attempts left out)."""
        return [b for b in read_heartbeats(self.room) if b["time"] >= attempt.started]

    def _clear_heartbeats(self) -> None:
        for stale in self.room.heartbeat_files():
            beat = read_json(stale, {})
            if not self.rendezvous or beat.get("host") in (None, self.node):  # other nodes clear their own
                stale.unlink(missing_ok=True)

    def hang_timeout(self, phases: list[str], progressed: bool = True) -> float:
        """No progress for longer than this is a hang: the most generous timeout of the ranks' phases."""
        return max((self._phase_timeout(p, progressed) for p in phases), default=self.r.startup_timeout_s)

    def first_stopped_timeout(self, beats: list[dict], progressed: bool = True) -> float | None:
        """The timeout of the rank that stopped first (`stopped_first`: its peers then wait for it in a
        collective) when it is in a part of a step whose recent durations it reported: hang_factor x the
        longest of them, at least hang_floor_s. A rank stuck loading a batch, which takes milliseconds, is
        then found sooner than after hang_factor whole steps. None when that does not apply."""
        if not beats or not progressed:
            return None
        first = stopped_first(beats)
        longest = first.get("longest", {}).get(first["phase"])
        if first["phase"] not in STEP_PHASES or not longest:
            return None
        return max(self.r.hang_floor_s, self.r.hang_factor * longest)

    def _phase_timeout(self, phase: str, progressed: bool) -> float:
        r = self.r
        if phase in STEP_PHASES and self.step_seconds and (progressed or not self.cfg.train.compile):
            return max(r.hang_floor_s, r.hang_factor * statistics.median(self.step_seconds[-50:]))
        if phase in SLOW_PHASES and self.phase_seconds[phase]:
            return max(r.hang_floor_s, r.hang_factor * max(self.phase_seconds[phase][-20:]))
        return r.startup_timeout_s  # start-up, the teardown after the last step, a first checkpoint or eval

    # -- failures -----------------------------------------------------------------------------------------
    def _handle_hang(self, attempt: Attempt, beats: list[dict]) -> None:
        local = [b for b in beats if not self.rendezvous or b["host"] == self.node]
        paths = {b["rank"]: self.room.stack_dump(b["rank"]) for b in beats}
        before = {rank: _size(path) for rank, path in paths.items()}
        for beat in local:
            try:
                os.kill(beat["pid"], signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + STACKS_WAIT_S
        while time.time() < deadline and any(_size(paths[b["rank"]]) <= before[b["rank"]] for b in local):
            time.sleep(0.02)
        attempt.stacks = {rank: _read(path) for rank, path in paths.items()}
        attempt.beats = beats
        attempt.failed_at = max((b["time"] for b in beats), default=attempt.started)  # the last progress
        attempt.exit_code = -signal.SIGKILL
        self._end(attempt)

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
            output = _read(self.room.attempt_log(attempt.number, self.log_node), 1 << 20)
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


def _trailing_repeats(failures: list[tuple[str, int]]) -> int:
    n = 0
    for failure in reversed(failures):
        if failure != failures[-1]:
            break
        n += 1
    return n


def _close_quietly(file) -> None:
    """Close a file whose buffered data may not fit on the disk any more (the file is closed all the same)."""
    with contextlib.suppress(OSError):
        file.close()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read(path: Path, tail: int = 20000) -> str:
    try:
        return path.read_text(errors="replace")[-tail:]
    except OSError:
        return ""
