"""The supervisor against faults injected into real 2-rank gloo runs.

For each fault the run must finish without a human, with final weights bit-identical to a fault-free run of
the same seed, an incident that names the fault, the rank and the steps lost, a recovery (failure to the
next completed step) within RECOVERY_S, and no worker process of the failed attempt left alive. A hang is
recorded within twice its timeout of the last heartbeat. A failure that recurs at the same step gives up
with a clear message; one that recurs without progress waits for its restart, one after progress does not.
"""

import os
import shutil
import sys

import pytest
import torch

from helpers import read_run, run_liandan, tiny_config, write_corpus
from liandan.checkpoint import snapshots
from liandan.checkpoint.manager import load_model
from liandan.config import load_config
from liandan.resilience.processes import alive
from liandan.resilience.supervisor import Supervisor
from liandan.train.heartbeat import read_heartbeats

pytestmark = pytest.mark.slow
RECOVERY_S = 60.0  # restart of 2 ranks on a loaded 2-core machine, including Python and torch start-up


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIANDAN_")}
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
    timeline = run_liandan("incidents", config.parent / "runs" / name)
    assert failure.upper() in timeline.stdout and "recovered" in timeline.stdout and "goodput" in timeline.stdout


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
    assert not snapshots.snapshot_dir(run_dir).exists()  # the supervisor gave the memory back


def test_full_disk_during_save_needs_no_restart(setup):
    config, clean = setup
    done = _train(config, "enospc", faults="enospc@save:4")
    assert done.returncode == 0, done.stderr[-3000:]
    assert [e["step"] for e in _events(config, "enospc", "checkpoint_failed")] == [4]
    assert _events(config, "enospc", "incident") == []
    for key, value in _weights(config, "enospc").items():
        assert torch.equal(value, clean[key]), key


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
    worker = [sys.executable, "-m", "liandan.cli", "train", str(config), "--nproc=2", f"--run.name={name}"]

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
    supervisor.step_seconds = [0.5, 0.7, 0.6]
    assert supervisor.hang_timeout(["data", "forward"]) == 4 * 0.6  # hang_factor 4 x median step
    assert supervisor.hang_timeout(["data", "done"]) == 600  # the teardown after the last step
    assert supervisor.hang_timeout(["checkpoint", "optimizer"]) == 600  # no checkpoint timed yet
    supervisor.phase_seconds["checkpoint"] = [0.2, 3.0]
    assert supervisor.hang_timeout(["checkpoint", "optimizer"]) == 4 * 3.0  # the longest checkpoint so far
    # The rank that stopped first is loading a batch, which it reports takes 0.01-0.3 s:
    stuck = {"rank": 1, "step": 5, "phase": "data", "time": 100.0, "longest": {"data": 0.3, "forward": 0.9}}
    waiting = {"rank": 0, "step": 5, "phase": "forward", "time": 100.2, "longest": {"data": 0.4}}
    assert supervisor.first_stopped_timeout([waiting, stuck]) == 4 * 0.3 < supervisor.hang_timeout(["data", "forward"])
    assert supervisor.first_stopped_timeout([waiting, {**stuck, "longest": {"data": 0.01}}]) == 1.0  # the floor
    assert supervisor.first_stopped_timeout([waiting, stuck], progressed=False) is None  # a first step warms up
    assert supervisor.first_stopped_timeout([waiting, {**stuck, "phase": "checkpoint"}]) is None
    assert supervisor.first_stopped_timeout([waiting, {**stuck, "longest": {}}]) is None  # nothing reported yet


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


def test_heartbeat_reports_how_long_each_part_of_a_step_takes(tmp_path):
    from liandan.train.heartbeat import Heartbeat

    beat = Heartbeat(tmp_path, rank=0)
    beat.beat(0, "startup")
    beat.beat(0, "data")
    beat.beat(0, "forward")
    [record] = read_heartbeats(tmp_path)
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
