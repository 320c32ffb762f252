"""The supervisor's watch over an attempt's workers (a base of Supervisor, whose state it uses): who ended
and how, and when no heartbeat progress for longer than the ranks' phases allow is a hang, whose evidence
(every rank's Python stacks) it gathers before the attempt is ended.
"""

from __future__ import annotations

import os
import signal
import time

from liandan.resilience.attempts import Attempt, file_size, read_tail
from liandan.resilience.processes import first_failure
from liandan.run import rank_files, read_json
from liandan.run.errors import DEVICE_FAULT_EXIT
from liandan.train.heartbeat import STEP_PHASES, read_heartbeats, stopped_first

POLL_S = 0.2
PEER_EXIT_S = 2.0  # after a rank fails, how long its peers have to fail on their own before they are ended
STACKS_WAIT_S = 2.0  # faulthandler writes from a signal handler: it is there in milliseconds, or never
SLOW_PHASES = ("checkpoint", "eval")


class WorkerWatch:
    """Watching an attempt until it ends, fails or hangs (a base of Supervisor)."""

    def _watch(self, attempt: Attempt) -> None:
        last_key, last_change, top_step, progressed = None, time.time(), -1, False
        while True:
            self.clock.wait(POLL_S)
            if self._exited(attempt) or self.signals.first:
                break
            beats = self._beats(attempt)
            now = time.time()
            if self.rendezvous:
                for beat in beats:
                    if beat["host"] == self.node:
                        self.clock.watch(beat["pid"])  # the local workers' exact death times, for attribution
            if self._learn_timings(beats) and not progressed:
                progressed = True
                self._prepare_standby(attempt.number + 1)
            key = tuple((b["rank"], b["step"], b["phase"]) for b in beats)
            if key != last_key:
                last_key, last_change = key, now
                step = max((b["step"] for b in beats if b["phase"] != "startup"), default=-1)
                if step > top_step:
                    top_step = step
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

    def _learn_timings(self, beats: list[dict]) -> bool:
        """The step time and the longest checkpoint and evaluation the ranks report in their heartbeats (the
        slowest rank's), kept until this attempt's ranks report their own. Timed by the ranks, not by this
        poll: a run whose steps are shorter than a poll could reach a hang before two polls saw it move, and
        its timeout would have stayed the start-up's. True when a rank of this attempt has completed a step."""
        steps = [b["step_s"] for b in beats if b.get("step_s")]
        if steps:
            self.step_seconds = max(steps)
        for phase in SLOW_PHASES:
            longest = [b["longest"][phase] for b in beats if b.get("longest", {}).get(phase)]
            if longest:
                self.phase_seconds[phase] = max(longest)
        return bool(steps)

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
        # The ranks are polled one after another: a rank that was alive when polled may be killed and take down
        # a peer polled after it, whose error exit would then be all there is to see. So when one has failed,
        # they are polled again at once: a rank that ended before that failure was seen has ended by now.
        for sweep in range(2):
            for rank, proc in attempt.procs:
                code = proc.poll()
                if code is not None and (rank or 0) not in attempt.exits:
                    attempt.exits[rank or 0] = (self.clock.deaths.get(proc.pid, time.time()), code)
            if not any(code != 0 for _, code in attempt.exits.values()):
                break
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
                attempt.user_error = read_tail(reports[0]).strip() if reports else ""
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
            return max(r.hang_floor_s, r.hang_factor * self.step_seconds)
        if phase in SLOW_PHASES and self.phase_seconds.get(phase):
            return max(r.hang_floor_s, r.hang_factor * self.phase_seconds[phase])
        return r.startup_timeout_s  # start-up, the teardown after the last step, a first checkpoint or eval

    def _handle_hang(self, attempt: Attempt, beats: list[dict]) -> None:
        local = [b for b in beats if not self.rendezvous or b["host"] == self.node]
        paths = {b["rank"]: self.room.stack_dump(b["rank"]) for b in beats}
        before = {rank: file_size(path) for rank, path in paths.items()}
        for beat in local:
            try:
                os.kill(beat["pid"], signal.SIGUSR1)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.time() + STACKS_WAIT_S
        while time.time() < deadline and any(file_size(paths[b["rank"]]) <= before[b["rank"]] for b in local):
            time.sleep(0.02)
        attempt.stacks = {rank: read_tail(path) for rank, path in paths.items()}
        attempt.beats = beats
        attempt.failed_at = max((b["time"] for b in beats), default=attempt.started)  # the last progress
        attempt.exit_code = -signal.SIGKILL
        self._end(attempt)
