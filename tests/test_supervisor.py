"""The supervisor against faults injected into real 2-rank gloo runs.

For each fault the run must finish without a human, with final weights bit-identical to a fault-free run of
the same seed, an incident that names the fault, the rank and the steps lost, and a recovery (failure to the
next completed step) within RECOVERY_S. A failure that recurs at the same step gives up with a clear message.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import tiny_config, write_corpus

from liandan.checkpoint.manager import load_model

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
    return config, _weights(config, "clean")


def _train(config, name, faults=None, always=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LIANDAN_")}
    if faults:
        env["LIANDAN_FAULTS"] = faults
    if always:
        env["LIANDAN_FAULTS_ALWAYS"] = always
    cmd = [sys.executable, "-m", "liandan.cli", "train", str(config), "--nproc=2", f"--run.name={name}"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=400)


def _weights(config, name):
    model, meta = load_model(config.parent / "runs" / name / "checkpoints" / "step-00000008")
    assert meta["step"] == 8
    return model.state_dict()


def _events(config, name, kind):
    lines = (config.parent / "runs" / name / "events.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


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
    if failure == "hang":
        evidence = incident["evidence"]
        assert evidence["stalled_seconds"] <= 2 * evidence["timeout_seconds"]  # detected within twice the timeout
        assert "maybe_inject" in evidence["stacks"]["1"]  # the stuck rank's stack shows where it hangs
    else:
        assert incident["evidence"]["last_lines"]
    if name == "corrupt-then-kill":
        [rejected] = _events(config, name, "checkpoint_rejected")
        assert "step-00000004" in rejected["path"] and "fails its checksum" in rejected["error"]
    summary = json.loads((config.parent / "runs" / name / "summary.json").read_text())
    assert summary["restarts"] == 1 and 0 < summary["goodput"] <= 1
    timeline = subprocess.run([sys.executable, "-m", "liandan.cli", "incidents", str(config.parent / "runs" / name)],
                              capture_output=True, text=True)  # fmt: skip
    assert failure.upper() in timeline.stdout and "recovered" in timeline.stdout and "goodput" in timeline.stdout


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
