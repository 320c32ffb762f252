"""Silent-data-corruption and straggler detection on real multi-process gloo runs: a rank whose matrix
products are wrong in rare elements, a rank that flips a bit of a parameter, a rank that sleeps in its forward
pass, a rank whose all-reduce contribution is corrupted, and a clean run of 500 steps with no alarm."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest
import torch

from helpers import MICRO_MODEL, read_run, run_liandan, tiny_config, write_corpus
from liandan import faults
from liandan.config import ConfigError, load_config
from liandan.model.llama import ModelArgs, Transformer
from liandan.resilience.incidents import timeline
from liandan.run import RunDir, read_jsonl
from liandan.run.errors import DEVICE_FAULT_EXIT
from liandan.track.triage import triage
from liandan.train.health.sdc import fingerprint

STEPS = 40
CHECK = 5  # fingerprints, cross-checks and replays every CHECK steps; so are the guard's in-memory states
WINDOW = 5  # steps in one straggler window
# Every check often, so that a fault is met within CHECK steps; checkpoints at the end to compare the weights.
CHECKED = [f"--train.steps={STEPS}", f"--health.check_every={CHECK}", f"--health.replay_every={CHECK}",
           f"--guard.ring_every={CHECK}", f"--health.straggler_every={WINDOW}", f"--checkpoint.every={STEPS}",
           "--resilience.supervise=false"]  # fmt: skip
DDP2 = ["--nproc=2", "--parallel.dp_replicate=2"]
DDP3 = ["--nproc=3", "--parallel.dp_replicate=3", "--train.global_batch=12"]


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("health")
    corpus = write_corpus(out, 40)
    path = out / "health.toml"
    path.write_text(tiny_config(out / "runs", corpus, *MICRO_MODEL).to_toml())
    return path


def train(config: Path, name: str, *args: str, fault: str = "") -> tuple:
    """`liandan train` with `fault` in $LIANDAN_FAULTS; returns (the process, what its run directory holds)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in (faults.ENV, faults.ENV_ALWAYS)}
    if fault:
        env[faults.ENV] = fault
    done = run_liandan("train", config, *args, f"--run.name={name}", env=env, timeout=400)
    return done, read_run(config.parent / "runs" / name)


def same_weights(a: Path, b: Path) -> bool:
    """Whether the final checkpoints of two runs hold the same bytes in every shard."""
    ours = sorted((a / "checkpoints").glob(f"step-{STEPS:08d}/*.distcp"))
    theirs = sorted((b / "checkpoints").glob(f"step-{STEPS:08d}/*.distcp"))
    assert ours and [p.name for p in ours] == [p.name for p in theirs]
    return all(filecmp.cmp(x, y, shallow=False) for x, y in zip(ours, theirs, strict=True))


@pytest.fixture(scope="module")
def clean2(config):
    done, records = train(config, "clean2", *DDP2, *CHECKED)
    assert done.returncode == 0, done.stderr[-3000:]
    return records


@pytest.fixture(scope="module")
def clean3(config):
    done, records = train(config, "clean3", *DDP3, *CHECKED)
    assert done.returncode == 0, done.stderr[-3000:]
    return records


@pytest.fixture(scope="module")
def faulted2(config):
    """Two DDP ranks: rank 0 sleeps in every forward from step 5, rank 1's all-reduce contribution of step 15
    is corrupted, rank 0 flips a parameter bit after the update of step 22 (two replicas: no majority)."""
    fault = "slow@forward:5:0,corrupt@allreduce:15:1,flip@param:22:0"
    done, records = train(config, "faulted2", *DDP2, *CHECKED, fault=fault)
    assert done.returncode == 0, done.stderr[-3000:]
    return records


@pytest.mark.slow
def test_a_corrupted_allreduce_contribution_names_its_sender_and_is_undone(faulted2, clean2):
    [corrupt, _] = faulted2.of_kind("sdc")
    assert corrupt["step"] == 15 and corrupt["checks"] == ["allreduce"]  # on the step it happened, before its update
    assert corrupt["ranks"] == [1] and not corrupt["persistent"] and corrupt["to"] == 10
    assert "rank(s) 1 sent other gradients" in corrupt["detail"]
    assert same_weights(faulted2.path, clean2.path)
    found = triage(corrupt)  # the corrupt@allreduce drill: the device that sent it
    assert found.category == "hardware" and found.evidence.startswith("rank 1 on ") and "allreduce" in found.evidence


@pytest.mark.slow
def test_two_replicas_that_disagree_are_said_to_have_no_majority(faulted2):
    [_, flip] = faulted2.of_kind("sdc")
    assert flip["step"] == 25 and flip["checks"] == ["fingerprint"]  # the next check after the flip at step 22
    assert flip["ranks"] == [] and flip["ambiguous"].startswith("ranks 0 and 1 disagree; no majority")
    assert flip["to"] == 20 and all(g["ok"] for g in flip["golden"])
    assert triage(flip).category == "unknown"  # two replicas cannot say which one flipped


@pytest.mark.slow
def test_a_rank_that_sleeps_in_compute_is_named_a_straggler(faulted2):
    [straggler] = faulted2.of_kind("straggler")
    # From step 5 every window is over the threshold: the third window in a row ends at step 15.
    assert straggler["rank"] == 0 and straggler["phase"] == "compute" and straggler["step"] <= 5 + 3 * WINDOW
    assert straggler["seconds"] >= faults.SLOW_S and straggler["median_seconds"] < faults.SLOW_S / 2
    lines = "\n".join(timeline(faulted2.path))
    assert "STRAGGLER rank 0" in lines and "SILENT DATA CORRUPTION at step 15: rank 1" in lines
    assert triage(straggler).category == "hardware" and "its compute takes" in triage(straggler).evidence
    # Every window's times of both ranks are kept for the dashboard's heat map, the sleeper's forward among them.
    windows = read_jsonl(RunDir(faulted2.path).rank_times)
    assert [w["step"] for w in windows][:2] == [WINDOW, 2 * WINDOW] and all(len(w["seconds"]) == 2 for w in windows)
    forward = windows[-1]["phases"].index("forward")
    assert windows[-1]["seconds"][0][forward] >= faults.SLOW_S > windows[-1]["seconds"][1][forward]


@pytest.mark.slow
def test_a_flipped_parameter_bit_is_named_by_the_majority_and_undone(config, clean3):
    done, records = train(config, "flip3", *DDP3, *CHECKED, fault="flip@param:17:2")
    assert done.returncode == 0, done.stderr[-3000:]
    [sdc] = records.of_kind("sdc")
    assert sdc["step"] == 20 and sdc["checks"] == ["fingerprint"] and sdc["ranks"] == [2]  # within CHECK steps
    assert sdc["to"] == 15 and not sdc["persistent"]
    assert same_weights(records.path, clean3.path)
    found = triage(sdc)  # the flip@param drill, named by the majority of three replicas
    assert found.category == "hardware" and found.evidence.startswith("rank 2 on ") and "fingerprint" in found.evidence


@pytest.mark.slow
def test_hsdp_compares_fingerprints_within_each_group_of_replicas(config):
    """Four ranks as 2 replicas x 2 shards: ranks 1 and 3 hold the same shard; a bit flipped on rank 3 is seen
    in their group alone, every rank agrees on it, and the run rolls back and finishes."""
    args = ["--nproc=4", "--parallel.dp_replicate=2", *CHECKED, "--train.steps=25", "--checkpoint.every=0"]
    done, records = train(config, "hsdp", *args, fault="flip@param:12:3")
    assert done.returncode == 0, done.stderr[-3000:]
    [sdc] = records.of_kind("sdc")
    assert sdc["step"] == 15 and sdc["checks"] == ["fingerprint"] and sdc["to"] == 10
    assert "ranks 1, 3 disagree; no majority" in sdc["detail"] and records.summary["steps"] == 25


@pytest.mark.slow
def test_a_device_that_computes_wrong_stops_the_run_and_is_recorded_as_a_suspect(config):
    args = [*DDP2, *CHECKED, "--resilience.supervise=true"]
    done, records = train(config, "perturbed", *args, fault="perturb@matmul:12:1")
    assert done.returncode == DEVICE_FAULT_EXIT, done.stderr[-3000:]
    [sdc] = records.of_kind("sdc")
    # The replay of step 15 is the first after the fault began; the replay of step 10 agreed.
    assert sdc["step"] == 15 and sdc["checks"] == ["replay"] and sdc["ranks"] == [1] and sdc["persistent"]
    assert [g["ok"] for g in sdc["golden"]] == [True, False] and sdc["to"] == 10
    error = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert len(error) == 1 and "rank 1 computes wrong" in error[0] and "suspect" in error[0]
    assert records.of_kind("restart") == []  # not retried on the bad device
    excluded = json.loads((records.path / "excluded_nodes.json").read_text())
    [(host, entry)] = excluded["nodes"].items()
    assert host == sdc["hosts"][0] and not entry["excluded"] and entry["suspect"][0]["rank"] == 1
    assert any(line.endswith("run stopped") for line in timeline(records.path))
    assert any(f"DEVICE FAULT: node {host} recorded as a suspect" in line for line in timeline(records.path))
    # the perturb@matmul drill: the device that failed its golden matrix product
    assert triage(sdc).category == "hardware" and "failed its golden matrix product" in triage(sdc).evidence
    assert "stopped on that device" in triage(sdc).next_step
    [fault] = records.of_kind("device_fault")
    assert triage(fault).category == "hardware"
    triaged = timeline(records.path, triaged=True)
    assert any(line.strip().startswith("-> hardware: rank 1 on ") for line in triaged), triaged


@pytest.mark.slow
def test_a_clean_run_of_500_steps_raises_no_alarm(config):
    args = [*DDP2, "--train.steps=500", "--health.check_every=5", "--health.replay_every=5", "--guard.ring_every=5",
            "--health.straggler_every=25", "--resilience.supervise=false", "--train.log_every=50"]  # fmt: skip
    done, records = train(config, "clean500", *args)
    assert done.returncode == 0, done.stderr[-3000:]
    assert records.of_kind("sdc") == [] and records.of_kind("straggler") == [] and records.summary["steps"] == 500


def test_a_fingerprint_sees_one_flipped_bit_in_one_tensor():
    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=16, n_layers=1, n_heads=2, max_seq_len=8))
    before = fingerprint([model])
    assert torch.equal(before, fingerprint([model]))
    with torch.no_grad():
        flat = next(model.parameters()).view(-1)
        flat[3:4].view(torch.int32).bitwise_xor_(1)  # the lowest mantissa bit: a change of one part in 2^23
    after = fingerprint([model])
    assert torch.nonzero(after != before).flatten().tolist() == [0]


def test_health_settings_are_checked():
    with pytest.raises(ConfigError, match="health.check_every = 0 is too small"):
        load_config(None, ["--health.check_every=0"])
    with pytest.raises(ConfigError, match="health.straggler_ratio = 0.5 is too small"):
        load_config(None, ["--health.straggler_ratio=0.5"])


def test_a_reported_straggler_is_excluded_on_request(tmp_path):
    """What the supervisor does on a restart with `health.exclude_stragglers`: the straggler events of its
    node's ranks since the attempt began exclude the node, in the run's own list."""
    from liandan.resilience import suspects
    from liandan.resilience.nodes import ExclusionList
    from liandan.run import RunDir, append_jsonl

    room = RunDir(tmp_path)
    event = {"kind": "straggler", "step": 150, "rank": 3, "host": "node-b", "phase": "compute", "ratio": 2.4}
    append_jsonl(room.events, {"time": 10.0, **event})
    append_jsonl(room.events, {"time": 30.0, **event, "host": "node-a"})
    assert suspects.stragglers_on(room, "node-b", since=20.0) == []  # an earlier attempt's
    assert [e["rank"] for e in suspects.stragglers_on(room, "node-b", since=5.0)] == [3]
    exclusions = ExclusionList(tmp_path)
    reason = suspects.mark_straggler(exclusions, "node-b", suspects.stragglers_on(room, "node-b", since=5.0)[-1])
    assert "rank 3 was a straggler in compute (2.4x" in reason
    assert exclusions.excluded()["node-b"]["reason"] == reason and "node-a" not in exclusions.excluded()
    assert room.excluded_hostlist.read_text().strip() == "node-b"
