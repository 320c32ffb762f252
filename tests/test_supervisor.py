"""The supervisor against faults injected into real 2-rank gloo runs.

For each fault the run must finish without a human, with final weights bit-identical to a fault-free run of
the same seed, an incident that names the fault, the rank and the steps lost, a recovery (failure to the
next completed step) within RECOVERY_S, and no worker process of the failed attempt left alive. A hang is
recorded within twice its timeout of the last heartbeat. A failure that recurs at the same step gives up
with a clear message; one that recurs without progress waits for its restart, one after progress does not.
"""

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from helpers import (
    environment_without,
    fill_disk,
    liandan_command,
    liandan_here,
    process_tree,
    read_metrics,
    read_run,
    run_liandan,
    start_liandan,
    tiny_config,
    wait_for_step,
    write_corpus,
)
from liandan.checkpoint import snapshots
from liandan.checkpoint.loading import load_model
from liandan.checkpoint.verify import complete_checkpoints, step_of, verify
from liandan.config import load_config
from liandan.resilience.processes import alive
from liandan.resilience.relay import Relay, brief
from liandan.resilience.supervisor import Supervisor
from liandan.run import RunDir
from liandan.track.triage import triage
from liandan.train.heartbeat import Heartbeat, read_heartbeats

pytestmark = pytest.mark.slow
RECOVERY_S = 60.0  # restart of 2 ranks on a loaded 2-core machine, including Python and torch start-up
TOKENS_PER_STEP = 4 * 64  # tiny_config: global batch 4 of 64 tokens


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("supervise")
    config = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), "--train.steps=8", "--checkpoint.every=2", "--run.name=",
                      "--resilience.backoff_s=0", "--resilience.hang_floor_s=4", "--resilience.hang_factor=4",
                      "--checkpoint.async_save=false")  # fmt: skip
    # Synchronous saves make "which checkpoint exists when the fault strikes" certain, and with it the step
    # each incident resumes from; asynchronous saves under kills are tested in test_checkpoint.py.
    config.write_text(cfg.to_toml())
    done = _train(config, "clean")
    assert done.returncode == 0, done.stderr[-3000:]
    assert _events(config, "clean", "incident") == []  # checkpoints and the teardown are no hangs
    return config, _weights(config, "clean")


def _train(config, name, faults=None, always=None, extra=()):
    env = environment_without()
    if faults:
        env["LIANDAN_FAULTS"] = faults
    if always:
        env["LIANDAN_FAULTS_ALWAYS"] = always
    return run_liandan("train", config, "--nproc=2", f"--run.name={name}", *extra, env=env, timeout=400)


def _weights(config, name):
    model, meta = load_model(config.parent / "runs" / name / "checkpoints" / "step-00000008")
    assert meta["step"] == 8
    return model.state_dict()


def _events(config, name, kind):
    return read_run(config.parent / "runs" / name).of_kind(kind)


TRIAGED = {"kill": ("unknown", "killed from outside (signal SIGKILL)"),
           "raise": ("code", "a crash in liandan at liandan/faults.py"),
           "hang": ("hardware", "stopped first, in data"),
           "kill-in-save": ("unknown", "killed from outside"),
           "corrupt-then-kill": ("unknown", "killed from outside")}  # fmt: skip


@pytest.mark.parametrize(
    "name, faults, failure, cause, rank, resume_step, step",
    [
        ("kill", "kill@step:5:1", "crash", "signal SIGKILL", 1, 4, 5),
        ("raise", "raise@step:5:0", "crash", "exit code 1", 0, 4, 5),
        ("hang", "hang@data:5:1", "hang", "hang in data", 1, 4, 4),
        ("kill-in-save", "kill@save:4:0", "crash", "signal SIGKILL", 0, 2, 4),
        ("corrupt-then-kill", "corrupt@saved:4,kill@step:5", "crash", "signal SIGKILL", None, 2, 5),
    ],
)
def test_fault_is_survived_exactly(setup, name, faults, failure, cause, rank, resume_step, step):
    config, clean = setup
    done = _train(config, name, faults=faults)
    assert done.returncode == 0, done.stderr[-3000:]
    for key, value in _weights(config, name).items():
        assert torch.equal(value, clean[key]), key
    [incident] = _events(config, name, "incident")
    assert incident["failure"] == failure and incident["cause"] == cause
    if rank is not None:
        assert incident["rank"] == rank
    assert incident["resume_step"] == resume_step and incident["step"] == step
    assert incident["steps_lost"] == step - resume_step
    assert incident["seconds_lost"] >= 0 and incident["host"]
    [recovered] = _events(config, name, "recovered")
    assert recovered["seconds"] < RECOVERY_S
    evidence = incident["evidence"]
    if failure == "hang":
        last_progress = max(beat["time"] for beat in evidence["ranks"])
        assert incident["time"] - last_progress <= 2 * evidence["timeout_seconds"]  # recorded within twice the timeout
        assert "maybe_inject" in evidence["stacks"]["1"]  # the stuck rank's stack shows where it hangs
        assert evidence["nccl_traces"] == []  # the flight recorder runs only under NCCL
        pids = [beat["pid"] for beat in evidence["ranks"]]
    else:
        assert evidence["last_lines"] and evidence["exits"][str(incident["rank"] or 0)]["after_s"] == 0
        pids = [e["pid"] for e in evidence["exits"].values()]
    assert len(pids) >= 1 and not any(alive(pid) for pid in pids) and incident["workers_left_alive"] == []
    if name == "corrupt-then-kill":
        [rejected] = _events(config, name, "checkpoint_rejected")
        assert "step-00000004" in rejected["path"] and "fails its checksum" in rejected["error"]
    summary = read_run(config.parent / "runs" / name).summary
    assert summary["restarts"] == 1 and 0 < summary["goodput"] <= 1
    assert summary["steps"] == 8 and summary["tokens"] == 8 * TOKENS_PER_STEP  # not only the last attempt's
    timeline = liandan_here("incidents", config.parent / "runs" / name)
    assert failure.upper() in timeline.stdout and "recovered" in timeline.stdout and "goodput" in timeline.stdout
    # each drill triaged: a kill from outside says nothing, the planted exception is in liandan, a hang names
    # where the rank stopped
    found = triage(incident)
    assert found.category == TRIAGED[name][0] and TRIAGED[name][1] in found.evidence, found
    assert f"-> {found.category}: " in timeline.stdout


@pytest.mark.parametrize(
    "name, faults, cause, step, memory_every, resume_step, source",
    [
        ("memory-kill", "kill@step:5:1", "signal SIGKILL", 5, 1, 5, "memory"),
        # the durable checkpoint of step 4 is lost; the snapshot of step 4 is not
        ("memory-exit-in-save", "exit@save:4:0", "exit code 1", 4, 1, 4, "memory"),
        ("memory-kill-before-any-checkpoint", "kill@step:1:0", "signal SIGKILL", 1, 1, 1, "memory"),
        # snapshots every 3 steps: the checkpoint of step 4 is newer than the snapshot of step 3
        ("memory-older-than-checkpoint", "kill@step:5:1", "signal SIGKILL", 5, 3, 4, "checkpoint"),
    ],
)
def test_memory_snapshots_resume_from_the_last_step(setup, name, faults, cause, step, memory_every, resume_step,
                                                     source):  # fmt: skip
    config, clean = setup
    done = _train(config, name, faults=faults, extra=[f"--checkpoint.memory_every={memory_every}"])
    assert done.returncode == 0, done.stderr[-3000:]
    for key, value in _weights(config, name).items():
        assert torch.equal(value, clean[key]), key
    [incident] = _events(config, name, "incident")
    assert incident["cause"] == cause and incident["step"] == step
    assert incident["resume_step"] == resume_step and incident["steps_lost"] == step - resume_step
    [resumed] = _events(config, name, "resumed")
    assert resumed["source"] == source and resumed["step"] == resume_step
    run_dir = config.parent / "runs" / name
    logged = [r["step"] for r in read_run(run_dir).metrics]
    assert logged == list(range(1, 9))  # every step once: none lost, none twice
    assert snapshots.snapshot_dirs(run_dir) == []  # the supervisor gave the memory back


def test_full_disk_during_save_needs_no_restart(setup):
    config, clean = setup
    done = _train(config, "enospc", faults="enospc@save:4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in _events(config, "enospc", "checkpoint_failed")] == [4]
    assert _events(config, "enospc", "incident") == []
    for key, value in _weights(config, "enospc").items():
        assert torch.equal(value, clean[key]), key


def test_a_full_run_disk_ends_in_one_line_that_names_what_failed(setup, small_disk):
    """The whole run directory on a disk with room for the data and one checkpoint: heartbeats, logs, events and
    later saves then meet ENOSPC. The run must end non-zero with one error line that names what failed
    (never an empty one, never a traceback), not claim success."""
    config, _ = setup
    disk = small_disk("3m")
    done = _train(config, "fullrun", extra=[f"--run.output_dir={disk}"])
    assert done.returncode != 0 and "done:" not in done.stdout, done.stdout[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert len(errors) == 1 and str(disk) in errors[0], done.stderr[-3000:]


def test_second_launch_counts_tokens_and_goodput_over_both(setup):
    """A run trained to step 4, then launched again for 8 steps: its summary counts all 8 steps' tokens, and
    goodput is the kept step seconds of both launches over the wall seconds of both."""
    config, _ = setup
    first = _train(config, "relaunch", extra=["--nproc=1", "--train.steps=4"])
    assert first.returncode == 0, first.stderr[-3000:]
    second = _train(config, "relaunch", extra=["--nproc=1"])
    assert second.returncode == 0, second.stderr[-3000:]
    summary = json.loads((config.parent / "runs" / "relaunch" / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["tokens"] == 8 * TOKENS_PER_STEP
    assert summary["supervisor_launches"] == 2 and 0 < summary["goodput"] <= 1
    [ended_first, _] = _events(config, "relaunch", "supervisor_end")
    assert summary["supervisor_wall_seconds"] > ended_first["wall_seconds"]


def test_goodput_counts_every_launch_of_the_run(tmp_path):
    """Three launches of one run directory: the first ended in order, the second was killed (no end event, its
    last record ends it), the third is finishing now. Goodput is every kept step second over every launch's
    wall second: over the last launch's wall time alone it would be 467%."""
    run_dir = tmp_path / "launches"
    run_dir.mkdir()
    now = time.time()
    events = [(now - 400, "supervisor_start", {"supervisor": "a"}), (now - 300, "supervisor_end", {"supervisor": "a"}),
              (now - 200, "supervisor_start", {"supervisor": "b"})]  # fmt: skip
    (run_dir / "events.jsonl").write_text("".join(json.dumps({"time": t, "kind": k, **f}) + "\n" for t, k, f in events))
    ends = [now - 380, now - 360, now - 340, now - 320, now - 180, now - 160, now - 5]  # steps of 20 s
    kept = list(enumerate(ends, start=1))
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time": t, "loss": 1.0, "step_time_s": 20.0}) + "\n" for s, t in kept)
    )
    cfg = tiny_config(tmp_path, tmp_path / "corpus.jsonl")
    Supervisor(cfg, [sys.executable, "-c", "pass"], run_dir, say=lambda m: None)._finish(now - 30, 0, gave_up=None)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["supervisor_launches"] == 3 and summary["kept_step_seconds"] == 140.0
    assert summary["supervisor_wall_seconds"] == pytest.approx(100 + 40 + 30, abs=1.0)
    assert summary["goodput"] == pytest.approx(140 / 170, rel=0.01)


@pytest.mark.parametrize("in_place", [True, False], ids=["local-disk", "network-disk"])
def test_heartbeats_survive_a_full_disk(small_disk, capsys, monkeypatch, in_place):
    """On a local disk a beat is written in place, into the block the file already has: a full disk does not
    stop it. Where the file is replaced each beat (a network file system; here the tmpfs taken for one), a
    full disk falls back to rewriting it in place."""
    from liandan.train import heartbeat

    if not in_place:
        monkeypatch.setattr(heartbeat, "LOCAL_FILE_SYSTEMS", frozenset())
    disk = small_disk("64k")
    beat = Heartbeat(RunDir(disk), rank=0)
    beat.beat(1, "data")
    fill_disk(disk / "filler")
    for step in range(2, 6):
        beat.beat(step, "forward")  # best-effort: never an exception that would end the worker
    [record] = read_heartbeats(RunDir(disk))
    assert record["step"] == 5
    late = Heartbeat(RunDir(disk), rank=1)
    late.beat(1, "data")  # no room for its first block: skipped
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "heartbeat" in line]
    assert len(warnings) == (1 if in_place else 2), err  # once per rank that could not write
    assert all("No space left on device" in w and "rank-" in w for w in warnings), err
    (disk / "filler").unlink()
    late.beat(2, "data")
    assert [b["step"] for b in read_heartbeats(RunDir(disk))] == [5, 2]


def test_output_relay_survives_a_full_disk(small_disk, capsys):
    """The attempt log cannot be written: the workers' output still reaches the console, and the workers are
    never left blocked on a pipe nobody reads."""
    disk = small_disk("64k")
    relay = Relay(disk / "attempt-0.log", peer_ended=lambda label: False)  # the log is opened here
    fill_disk(disk / "filler")
    lines = 20000  # about 200 KB: far more than a pipe holds
    worker = subprocess.Popen([sys.executable, "-c", f"for i in range({lines}): print('line', i)"],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    sink = io.StringIO()
    relay.start("rank 0", worker.stdout, sink)
    try:
        assert worker.wait(timeout=30) == 0  # ample for 200 KB: a blocked worker never ends
    finally:
        worker.kill()
        relay.close()
    assert sink.getvalue().count("\n") == lines and relay.last_lines[-1] == f"line {lines - 1}"
    err = capsys.readouterr().err
    warnings = [line for line in err.splitlines() if "attempt-0.log" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], err  # once, not per line


def test_deterministic_crash_gives_up(setup):
    config, _ = setup
    done = _train(config, "determinism", always="raise@step:3:0")
    assert done.returncode == 1
    assert "supervisor gave up: the same failure (exit code 1) recurred 2 times at step 3" in done.stdout
    incidents = _events(config, "determinism", "incident")
    assert [i["step"] for i in incidents] == [3, 3]
    [gave_up] = _events(config, "determinism", "gave_up")
    assert "recurred 2 times" in gave_up["reason"]


def test_backoff_only_without_progress_and_seconds_lost_per_attempt(setup):
    """Attempts 0 and 1 die at step 3 (no checkpoint in between: the second restart backs off), attempt 2
    at step 7 after the run got past step 4 (progress: it restarts at once). Each incident counts only its
    own attempt's redone work."""
    config, clean = setup
    name, schedule = "backoff", ["kill@step:3:1", "kill@step:3:1", "kill@step:7:0"]
    cfg = load_config(config, [f"--run.name={name}", "--resilience.backoff_s=0.5", "--resilience.same_failure_limit=3"])
    run_dir = config.parent / "runs" / name
    run_dir.mkdir(parents=True)
    worker = liandan_command("train", config, "--nproc=2", f"--run.name={name}")

    def attempt_env(number):
        return {"LIANDAN_FAULTS_ALWAYS": schedule[number]} if number < len(schedule) else {}

    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("LIANDAN_")}
    try:
        assert Supervisor(cfg, worker, run_dir, nproc=2, say=lambda m: None, attempt_env=attempt_env).run() == 0
    finally:
        os.environ.update(saved)
    assert [r["after_seconds"] for r in _events(config, name, "restart")] == [0.0, 0.5, 0.0]
    incidents = _events(config, name, "incident")
    assert [(i["step"], i["resume_step"]) for i in incidents] == [(3, 2), (3, 2), (7, 6)]
    starts = _events(config, name, "train_start")
    for incident, start in zip(incidents, starts):
        assert 0 < incident["seconds_lost"] <= incident["time"] - start["time"]  # this attempt's work only
    for key, value in _weights(config, name).items():
        assert torch.equal(value, clean[key]), key


def test_hang_timeout_follows_the_phase(setup):
    config, _ = setup
    cfg = load_config(config, ["--resilience.startup_timeout_s=600", "--resilience.hang_floor_s=1"])
    supervisor = Supervisor(cfg, [sys.executable, "-c", "pass"], config.parent / "runs" / "phases", nproc=2)
    assert supervisor.hang_timeout(["startup", "startup"]) == 600  # nothing learned yet
    assert supervisor.hang_timeout(["data", "forward"]) == 600  # no step timed yet
    # The ranks report their own times: the slowest rank's median step and longest checkpoint count.
    reports = [{"rank": 0, "step_s": 0.5, "longest": {"checkpoint": 0.2}}, {"rank": 1, "step_s": 0.6, "longest": {}}]
    assert supervisor._learn_timings(reports)  # a rank completed a step: progress
    assert supervisor.hang_timeout(["data", "forward"]) == 4 * 0.6  # hang_factor 4 x median step
    assert supervisor.hang_timeout(["data", "done"]) == 600  # the teardown after the last step
    assert supervisor.hang_timeout(["checkpoint", "optimizer"]) == 4 * 0.6  # the step's, which is longer
    assert supervisor._learn_timings([{"rank": 0, "step_s": 0.7, "longest": {"checkpoint": 3.0}}])
    assert supervisor.hang_timeout(["checkpoint", "optimizer"]) == 4 * 3.0  # the longest checkpoint reported
    assert supervisor.hang_timeout(["eval", "optimizer"]) == 600  # no evaluation timed yet
    # A restarted attempt's ranks, before their first step, keep what the last attempt's reported.
    assert not supervisor._learn_timings([{"rank": 0, "longest": {}}, {"rank": 1, "longest": {}}])
    assert supervisor.hang_timeout(["data", "checkpoint"]) == 4 * 3.0
    # The rank that stopped first is loading a batch, which it reports takes 0.01-0.3 s:
    stuck = {"rank": 1, "step": 5, "phase": "data", "time": 100.0, "longest": {"data": 0.3, "forward": 0.9}}
    waiting = {"rank": 0, "step": 5, "phase": "forward", "time": 100.2, "longest": {"data": 0.4}}
    assert supervisor.first_stopped_timeout([waiting, stuck]) == 4 * 0.3 < supervisor.hang_timeout(["data", "forward"])
    assert supervisor.first_stopped_timeout([waiting, {**stuck, "longest": {"data": 0.01}}]) == 1.0  # the floor
    assert supervisor.first_stopped_timeout([waiting, stuck], progressed=False) is None  # a first step warms up
    assert supervisor.first_stopped_timeout([waiting, {**stuck, "phase": "checkpoint"}]) is None
    assert supervisor.first_stopped_timeout([waiting, {**stuck, "longest": {}}]) is None  # nothing reported yet


HUNG_WORKER = """
import os, sys, threading
from liandan.run import RunDir
from liandan.train.heartbeat import Heartbeat

beat = Heartbeat(RunDir(sys.argv[1]), int(os.environ["RANK"]))
beat.enable_stack_dumps()
beat.beat(0, "startup")
for step in range(5):  # steps of microseconds: between two of the supervisor's polls, all of them
    for phase in ("data", "forward", "backward", "optimizer"):
        beat.beat(step, phase)
    beat.beat(step + 1, "step_end")
for phase in ("data", "forward", "backward"):
    beat.beat(5, phase)
threading.Event().wait()  # stuck in the backward of step 6, as in a collective whose peer never comes
"""


def test_a_hang_after_steps_shorter_than_a_poll_is_found_by_the_step_time(tmp_path):
    """Workers that run five steps and hang before the supervisor has polled twice: the ranks' own step
    times set the timeout (the floor here), not the start-up's, which the supervisor kept when it had to see
    a step pass between two polls (a short run under load waited for startup_timeout_s)."""
    cfg = tiny_config(tmp_path / "runs", tmp_path / "corpus.jsonl", "--resilience.hang_floor_s=1",
                      "--resilience.hang_factor=4", "--resilience.startup_timeout_s=60",
                      "--resilience.max_restarts=0")  # fmt: skip
    run_dir = tmp_path / "runs" / "run"
    run_dir.mkdir(parents=True)
    worker = [sys.executable, "-c", HUNG_WORKER, str(run_dir)]
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("LIANDAN_")}
    try:
        assert Supervisor(cfg, worker, run_dir, nproc=2, say=lambda m: None).run() == 1  # no restart allowed
    finally:
        os.environ.update(saved)
    [incident] = read_run(run_dir).of_kind("incident")
    assert incident["failure"] == "hang" and incident["cause"] == "hang in backward" and incident["step"] == 5
    assert incident["evidence"]["timeout_seconds"] == 1.0  # not startup_timeout_s
    assert all(beat["step_s"] < 1 for beat in incident["evidence"]["ranks"])
    assert "threading.py" in incident["evidence"]["stacks"]["1"]  # asked for and recorded before the end
    assert incident["workers_left_alive"] == []


def test_the_rank_furthest_behind_stopped_first():
    from liandan.train.heartbeat import stopped_first

    def beat(rank, step, phase, time, micro=0):
        return {"rank": rank, "step": step, "phase": phase, "time": time, "micro": micro}

    # Rank 1 hangs after its beat for loading step 6's batch; rank 0 beat "forward" before that (it was
    # ahead) and waits in forward's first all-gather: behind beats older.
    assert stopped_first([beat(0, 5, "forward", 100.0), beat(1, 5, "data", 100.2)])["rank"] == 1
    # What follows step 5 (its logged loss, checkpoint) comes before step 6's parts, beaten with step 5 too
    assert stopped_first([beat(0, 5, "data", 100.0), beat(1, 5, "checkpoint", 100.3)])["rank"] == 1
    assert stopped_first([beat(0, 6, "collective", 100.0), beat(1, 5, "optimizer", 100.3)])["rank"] == 1
    assert stopped_first([beat(0, 5, "forward", 100.0, micro=1), beat(1, 5, "backward", 100.3)])["rank"] == 1
    assert stopped_first([beat(0, 5, "forward", 100.3), beat(1, 5, "forward", 100.0)])["rank"] == 1  # equals: oldest
    # A guard's rollback replays steps before the next step's batch; a phase missing from the order used to
    # end the supervisor watching such a run.
    assert stopped_first([beat(0, 5, "rollback", 100.0, micro=3), beat(1, 5, "data", 100.3)])["rank"] == 0


def test_heartbeat_reports_how_long_each_part_of_a_step_takes(tmp_path):
    from liandan.train.heartbeat import Heartbeat

    beat = Heartbeat(RunDir(tmp_path), rank=0)
    beat.beat(0, "startup")
    beat.beat(0, "data")
    beat.beat(0, "forward")
    [record] = read_heartbeats(RunDir(tmp_path))
    assert record["phase"] == "forward" and set(record["longest"]) == {"data"}
    assert 0 <= record["longest"]["data"] < 1


def test_checkpoint_verdict_is_trusted_only_while_nothing_changed(tmp_path, monkeypatch):
    from liandan.checkpoint import handoff
    from liandan.checkpoint.verify import write_manifest
    from liandan.run.worker_env import VERIFIED_CHECKPOINT

    root = tmp_path / "checkpoints"
    for step in (2, 4):
        directory = root / f"step-{step:08d}"
        directory.mkdir(parents=True)
        (directory / "shard.distcp").write_bytes(bytes(range(256)) * 64)
        write_manifest(directory)
    shard = root / "step-00000004" / "shard.distcp"
    shard.write_bytes(shard.read_bytes()[::-1])  # same size, other bytes: fails its checksum
    events = []
    found = handoff.verify_and_hand_over(root, True, tmp_path / "verified.json", lambda kind, **f: events.append(kind))
    assert found.name == "step-00000002" and events == ["checkpoint_rejected"]
    monkeypatch.setenv(VERIFIED_CHECKPOINT, str(tmp_path / "verified.json"))
    assert handoff.trusted(root, checksums=True) == found.resolve()
    newer = root / "step-00000006"
    newer.mkdir()
    write_manifest(newer)
    assert handoff.trusted(root, checksums=True) is None  # a newer checkpoint appeared: verify again
    shutil.rmtree(newer)
    assert handoff.trusted(root, checksums=True) == found.resolve()
    os.utime(found / "shard.distcp", ns=(1, 1))  # touched since the verdict
    assert handoff.trusted(root, checksums=True) is None


def test_supervised_run_listens_on_loopback_only(setup):
    """The rendezvous store the supervisor hosts and the ranks' gloo sockets listen on 127.0.0.1 only."""
    from helpers import listeners_until_exit

    config, _ = setup
    proc = start_liandan("train", config, "--nproc=2", "--run.name=loopback", "--train.steps=2",
                         env=environment_without("LIANDAN_", "GLOO_", "NCCL_"))  # fmt: skip
    seen = listeners_until_exit(proc)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    assert seen and {address for address, _ in seen} == {"127.0.0.1"}, seen


PREEMPT_STEPS = ["--train.steps=40", "--checkpoint.every=10"]  # long enough to be signalled in the middle


def _preempted_run(config, name, signals):
    """A real `liandan train --nproc=2` supervisor, sent `signals` after step 3: (run dir, its stdout, the
    processes it had when signalled: itself, its workers and their standbys)."""
    run_dir = config.parent / "runs" / name
    proc = start_liandan("train", config, "--nproc=2", f"--run.name={name}", *PREEMPT_STEPS,
                         "--checkpoint.memory_every=1", env=environment_without())  # fmt: skip
    wait_for_step(run_dir, 3, proc)
    deadline = time.time() + 60
    while len(tree := process_tree(proc.pid)) < 5:  # the supervisor, 2 workers and the next attempt's 2 standbys
        assert time.time() < deadline and proc.poll() is None, "no standby workers started"
        time.sleep(0.02)
    assert len(snapshots.snapshot_dirs(run_dir)) == 1
    proc.send_signal(signals[0])
    announced = []
    if len(signals) > 1:  # signals of one kind merge while pending: wait until the first one is handled
        announced = [next(line for line in proc.stdout if "the workers save a checkpoint" in line)]
        proc.send_signal(signals[1])
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signals[0], err[-3000:]
    assert not any(alive(pid) for pid in tree)  # no worker, no standby
    assert snapshots.snapshot_dirs(run_dir) == []  # the memory given back
    [event] = _events(config, name, "preempted")
    assert event["signal"] == signals[0].name and event["workers_left_alive"] == []
    for checkpoint in complete_checkpoints(run_dir / "checkpoints"):
        verify(checkpoint, checksums=True)  # a save cut short is not among them
    timeline = liandan_here("incidents", run_dir, check=True).stdout
    [line] = [line for line in timeline.splitlines() if "PREEMPTED" in line]
    assert f"by {signals[0].name}" in line
    return run_dir, "".join(announced) + out, event


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_preemption_saves_cleans_up_and_resumes_exactly(setup, signum):
    """A real signal to a real supervisor of two ranks: it exits 128 + signum with a checkpoint of the step
    reached, no worker or standby left, no snapshots in memory and the event in the incident timeline; the
    next launch finishes with the weights and final loss of an uninterrupted run."""
    config, _ = setup
    reference = config.parent / "runs" / "preempt-reference"
    if not reference.is_dir():
        done = _train(config, reference.name, extra=PREEMPT_STEPS)
        assert done.returncode == 0, done.stderr[-3000:]
    name = f"preempt-{signum.name}"
    run_dir, out, event = _preempted_run(config, name, [signum])
    step = event["step"]
    assert event["saved"] and event["resume_step"] == step and 3 <= step < 40
    assert (run_dir / "checkpoints" / f"step-{step:08d}" / "manifest.json").is_file()
    logged = [record["step"] for record in read_metrics(run_dir)]
    assert logged[-1] == step
    assert f"stopped by {signum.name} at step {step}: checkpoint saved" in out
    resumed = _train(config, name, extra=PREEMPT_STEPS)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [resume] = _events(config, name, "resumed")
    assert resume["step"] == step and resume["source"] == "checkpoint"
    summaries = [json.loads((run / "summary.json").read_text()) for run in (run_dir, reference)]
    assert summaries[0]["final_loss"] == summaries[1]["final_loss"]
    clean, _ = load_model(reference / "checkpoints" / "step-00000040")
    again, _ = load_model(run_dir / "checkpoints" / "step-00000040")
    for key, value in again.state_dict().items():
        assert torch.equal(value, clean.state_dict()[key]), key


def test_a_second_signal_during_the_preemption_save_stops_at_once(setup):
    config, _ = setup
    _, out, event = _preempted_run(config, "preempt-twice", [signal.SIGTERM, signal.SIGTERM])
    assert not event["saved"] and "second signal" in event["outcome"]
    assert "a second signal stopped it at once" in out


def _signal_when(config, name, faults, overrides, reached, grace_s):
    """A real supervisor of two ranks with `faults`, sent SIGTERM once a rank's heartbeat satisfies `reached`;
    it must exit 143 leaving no process and no snapshot behind. Returns (run dir, its stdout, the event)."""
    run_dir = config.parent / "runs" / name
    env = environment_without(LIANDAN_FAULTS=faults)
    proc = start_liandan("train", config, "--nproc=2", f"--run.name={name}", *overrides,
                         "--checkpoint.memory_every=1", f"--resilience.preempt_grace_s={grace_s}", env=env)  # fmt: skip
    deadline = time.time() + 300
    while not any(reached(b) for b in read_heartbeats(RunDir(run_dir))):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.02)
    tree = process_tree(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert not any(alive(pid) for pid in tree)  # the workers and standbys, killed or not
    assert snapshots.snapshot_dirs(run_dir) == []
    [event] = _events(config, name, "preempted")
    assert event["workers_left_alive"] == []
    return run_dir, out, event


# Two micro-batches per rank; steps of stalled forward passes are no hang.
STALLED = ["--train.steps=4", "--checkpoint.every=4", "--train.micro_batch=1", "--resilience.hang_floor_s=60"]


def test_preemption_abandons_a_step_that_cannot_finish_in_time(setup):
    """Steps of two forward passes of STALL_S each; SIGTERM in the first forward of step 2 with a grace period
    shorter than the rest of the step: the ranks abandon it at the next phase boundary, save step 1 from its
    memory snapshot in time, and the next launch ends with the weights of an uninterrupted run."""
    from liandan.faults import STALL_S

    config, _ = setup
    reference = config.parent / "runs" / "stalled-reference"
    done = _train(config, reference.name, extra=STALLED)
    assert done.returncode == 0, done.stderr[-3000:]
    grace = 2 * STALL_S  # after the first forward's sleep, less is left than the second one takes
    run_dir, out, event = _signal_when(config, "stalled", "stall@forward:1", STALLED,
                                       lambda b: (b["rank"], b["step"], b["phase"], b["micro"]) == (0, 1, "forward", 0),
                                       grace)  # fmt: skip
    assert event["saved"] and event["step"] == event["resume_step"] == 1, event
    assert event["seconds"] < grace
    [plan] = _events(config, "stalled", "preemption_plan")
    assert plan["plan"] == "fall back" and plan["fits"] and plan["fallback_step"] == 1 and plan["step"] == 2
    assert plan["finish_s"] > plan["grace_left_s"] >= plan["fallback_s"]
    assert "abandoning it, saving step 1" in out
    timeline = liandan_here("incidents", run_dir, check=True).stdout
    assert "preemption plan by SIGTERM: abandon step 2, save step 1 (" in timeline
    assert [step_of(c) for c in complete_checkpoints(run_dir / "checkpoints")] == [1]
    resumed = _train(config, "stalled", extra=STALLED)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [resume] = _events(config, "stalled", "resumed")
    assert resume["step"] == 1 and resume["source"] == "checkpoint"
    clean, _ = load_model(reference / "checkpoints" / "step-00000004")
    again, _ = load_model(run_dir / "checkpoints" / "step-00000004")
    for key, value in again.state_dict().items():
        assert torch.equal(value, clean.state_dict()[key]), key


def test_preemption_past_the_grace_period_kills_the_workers(setup):
    """A rank hangs in the data of step 4 and cannot save: at the end of a short grace period the supervisor
    kills every worker, says no checkpoint was saved, exits 143, and the next launch resumes from step 2's
    checkpoint to the weights of an uninterrupted run."""
    config, clean = setup
    grace = 1.5
    _run_dir, out, event = _signal_when(config, "grace-over", "hang@data:4:1", [],
                                       lambda b: (b["rank"], b["step"], b["phase"]) == (1, 3, "data"), grace)  # fmt: skip
    assert not event["saved"] and event["resume_step"] == 2 and event["step"] == 3, event
    assert "grace period" in event["outcome"] and grace <= event["seconds"] < grace + 30
    assert "the next launch resumes from step 2" in out
    resumed = _train(config, "grace-over")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    [resume] = _events(config, "grace-over", "resumed")
    assert resume["step"] == 2 and resume["source"] == "checkpoint"
    for key, value in _weights(config, "grace-over").items():
        assert torch.equal(value, clean[key]), key


@pytest.mark.parametrize("faults, first", [("kill@step:3:1", 1), ("raise@step:3:0", 0)], ids=["kill", "raise"])
def test_a_peers_traceback_costs_the_console_one_line(setup, faults, first):
    """The rank that failed first keeps its traceback on the console (when it printed one); the rank that
    failed only because a peer went away gets exactly one line there, naming it (the supervisor lets it fail
    on its own before ending the attempt), its traceback kept in the attempt's log and in the incident."""
    config, _ = setup
    name = f"console-{faults.split('@')[0]}"
    done = _train(config, name, faults=faults, extra=["--train.steps=4"])
    assert done.returncode == 0, done.stderr[-3000:]
    survivor, own = 1 - first, int(faults.startswith("raise"))  # a raise prints a traceback, a kill does not
    log = config.parent / "runs" / name / "logs" / "attempt-0.log"
    assert done.stderr.count("Traceback (most recent call last)") == own  # the first failure's only, in full
    if own:
        assert "RuntimeError: injected fault at step 3 on rank 0" in done.stderr
    [line] = [line for line in done.stderr.splitlines() if line.startswith(f"rank {survivor}: ")]
    assert log.read_text().count("Traceback (most recent call last)") == own + 1  # the survivor's, in full there
    [incident] = _events(config, name, "incident")
    [traceback] = incident["evidence"]["tracebacks"][f"rank {survivor}"]
    assert "a consequence of another process ending" in line and str(log) in line
    assert traceback.startswith("Traceback") and brief(traceback.strip().splitlines()[-1].strip()) in line
    assert "GLHF" not in done.stderr


def test_the_rank_that_crashed_first_is_not_a_consequence_of_those_it_brought_down(tmp_path):
    """Crash times, not which process is still alive when a traceback is read, decide: the rank that failed
    first ends at once, and the peer it brought down may have ended too before its traceback is relayed."""
    from liandan.resilience.supervisor import peer_ended_first
    from liandan.run.layout import rank_file
    from liandan.run.worker_env import CRASHED

    def ended():
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait()
        return proc

    living = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        procs = [(0, ended()), (1, ended()), (2, living)]
        rank_file(tmp_path, 0, CRASHED).write_text("100.0")
        rank_file(tmp_path, 1, CRASHED).write_text("101.5")
        assert not peer_ended_first(procs, tmp_path, "rank 0")  # rank 1 crashed after it; rank 2 lives
        assert peer_ended_first(procs, tmp_path, "rank 1")
        assert peer_ended_first(procs, tmp_path, "rank 2")  # no crash time of its own: a peer has ended
        assert not peer_ended_first([(2, living)], tmp_path, "rank 2")
        rank_file(tmp_path, 1, CRASHED).unlink()  # killed: no time of its own, it ended
        assert peer_ended_first(procs, tmp_path, "rank 0")
    finally:
        living.communicate(b"")


def test_relay_holds_a_traceback_until_it_is_complete(tmp_path):
    """A traceback (chained ones too) is shown in full, or as one line when a peer ended first or it says a
    peer went away (all a node's supervisor can tell of other nodes); the log keeps every line."""
    import io

    from liandan.resilience.relay import Relay

    def traceback(error):
        return ("Traceback (most recent call last):\n  File \"a.py\", line 1, in f\n    g()\nValueError: first\n\n"
                "During handling of the above exception, another exception occurred:\n\n"
                f"Traceback (most recent call last):\n  File \"b.py\", line 2, in g\n    h()\n{error}\n")  # fmt: skip

    for peer_ended, error, full in [(False, "RuntimeError: boom", True), (True, "RuntimeError: boom", False),
                                    (False, "RuntimeError: Connection reset by peer", False)]:  # fmt: skip
        output = "before\n" + traceback(error) + "step 5: loss 1.0\n"
        relay, console = Relay(tmp_path / "attempt.log", lambda label, ended=peer_ended: ended), io.StringIO()
        relay.follow("rank 0", io.StringIO(output), console)
        relay.close()
        if full:
            assert console.getvalue() == output
        else:
            before, line, after = console.getvalue().splitlines()
            assert (before, after) == ("before", "step 5: loss 1.0")
            assert line == f"rank 0: {error} (a consequence of another process ending; traceback in {relay.log_path})"
        assert relay.log_path.read_text() == output
        assert relay.tracebacks["rank 0"] == [traceback(error)]


def test_a_killed_rank_is_blamed_not_the_peer_that_lost_it():
    """Rank 1 is SIGKILLed and rank 0, its peer, exits 1 on the broken connection; the supervisor finds both
    dead at one wake-up (the same time): the killed rank failed first. A rank that exits with an error
    well before another is killed is still the first."""
    import subprocess
    import sys

    from liandan.resilience.processes import DeathClock, first_failure

    killed = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    lost = [sys.executable, "-c", "raise SystemExit(1)"]
    procs = {0: subprocess.Popen(lost), 1: subprocess.Popen(killed)}
    for proc in procs.values():
        proc.wait()  # both gone before the supervisor looks, as when it wakes late
    clock = DeathClock()
    for proc in procs.values():
        clock.watch(proc.pid)
    clock.wait(0.01)
    exits = {rank: (clock.deaths.get(proc.pid), proc.returncode) for rank, proc in procs.items()}
    assert exits[0][0] == exits[1][0] and exits[1][1] == -9  # one moment
    assert first_failure(exits)[1:] == (1, -9)
    assert first_failure({0: (100.0, 1), 1: (101.0, -9)})[1:] == (0, 1)  # a second apart: rank 0 was first
    assert first_failure({0: (100.0, 0), 1: (100.0, 0)}) is None


def test_a_rank_killed_between_the_watchs_polls_is_blamed_not_its_casualty(tmp_path):
    """The watch polls the ranks one after another. Rank 0 is alive when polled, then killed, and takes rank 1
    down before rank 1 is polled: the watch first sees only rank 1's error exit, and must not blame it."""
    from liandan.resilience.attempts import Attempt
    from liandan.resilience.processes import DeathClock

    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])

    class KilledByItsPeer(subprocess.Popen):
        def poll(self):
            if killed.returncode is None:  # rank 0 dies after its poll, and this rank of it
                killed.kill()
                killed.wait()
            return super().poll()

    lost = KilledByItsPeer([sys.executable, "-c", "raise SystemExit(1)"])
    lost.wait()
    supervisor = Supervisor(load_config(None, []), [sys.executable, "-c", "pass"], tmp_path / "run", nproc=2)
    supervisor.clock = DeathClock()
    attempt = Attempt(number=0, started=time.time(), token="test", procs=[(0, killed), (1, lost)])
    try:
        assert supervisor._exited(attempt)
        assert (attempt.failed_rank, attempt.exit_code) == (0, -signal.SIGKILL) and set(attempt.exits) == {0, 1}
    finally:
        killed.kill()
        killed.wait()


def test_a_lost_peers_gloo_error_is_one_plain_line_on_the_console(tmp_path):
    import io

    from liandan.resilience.relay import Relay

    gloo = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error"
            " [127.0.0.1]:28355: Connection reset by peer. This is typically caused by a remote worker hanging or"
            " bugs in the application. Check the logs of the remote worker before reporting an error. GLHF! 🏖️")  # fmt: skip
    output = f'Traceback (most recent call last):\n  File "a.py", line 1, in f\n    g()\n{gloo}\nstep 5\n'
    relay, console = Relay(tmp_path / "attempt.log", lambda label: True), io.StringIO()
    relay.follow("rank 0", io.StringIO(output), console)
    relay.close()
    shown = ("rank 0: RuntimeError: Read error [127.0.0.1]:28355: Connection reset by peer (a consequence of another"
             f" process ending; traceback in {relay.log_path})")  # fmt: skip
    assert console.getvalue().splitlines() == [shown, "step 5"]
    assert gloo in relay.log_path.read_text()  # the log keeps it whole


def test_a_lost_peers_plain_log_line_goes_to_the_log_only_when_a_peer_ended(tmp_path):
    """gloo logs a closed connection on a line of its own before the traceback it leads to: once a peer has
    ended, that line and the traceback are the one consequence line on the console; a plain line followed by
    more output is shown only when no peer ended (the network itself failed)."""
    import io

    from liandan.resilience.relay import Relay

    gloo = ("[rank0]:[E1129 07:19:34.235867753 ProcessGroupGloo.cpp:67] Gloo connectFullMesh failed with [/__w/pytorch"
            "/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:35035.")  # fmt: skip
    error = "RuntimeError: Gloo connectFullMesh failed with Connection closed by peer"
    crash = f'Traceback (most recent call last):\n  File "a.py", line 1, in f\n    g()\n{error}\n'
    for output in (f"step 1\n{gloo}\n{crash}", f"step 1\n{gloo}\nstep 2\n", f"step 1\n{gloo}\n"):
        for peer_ended in (True, False):
            relay, console = Relay(tmp_path / "attempt.log", lambda label, ended=peer_ended: ended), io.StringIO()
            relay.follow("rank 0", io.StringIO(output), console)
            relay.close()
            assert relay.log_path.read_text() == output
            shown = console.getvalue().splitlines()
            if "Traceback" in output:
                summary = f"rank 0: {error} (a consequence of another process ending; traceback in {relay.log_path})"
                assert shown == ["step 1", summary], shown  # a traceback saying a peer went away is one line
            elif peer_ended:
                assert shown == output.splitlines()[:1] + output.splitlines()[2:], shown
            else:
                assert console.getvalue() == output
