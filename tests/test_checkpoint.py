"""Checkpoints with real processes and real files: kills, corruption, full disks, retention, resume."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import read_run, run_liandan, tiny_config, write_corpus
from liandan.checkpoint.manager import CheckpointManager, load_model, rng_state, set_rng_state
from liandan.checkpoint.verify import CheckpointError, verify

STEPS = 8


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    path = root / "tiny.toml"
    cfg = tiny_config(root / "runs", write_corpus(root), f"--train.steps={STEPS}", "--checkpoint.every=4", "--run.name=", "--resilience.supervise=false")
    path.write_text(cfg.to_toml())
    return path


def train(config, name, *overrides, faults=None, expect=0):
    env = dict(os.environ)
    env.pop("LIANDAN_FAULTS", None)
    if faults:
        env["LIANDAN_FAULTS"] = faults
    done = run_liandan("train", config, f"--run.name={name}", *overrides, env=env, timeout=300)
    if expect == "killed":
        assert done.returncode == -9, done.stderr[-2000:]
    else:
        assert done.returncode == expect, done.stderr[-3000:]
    return done


def run_dir(config, name) -> Path:
    return config.parent / "runs" / name


def losses(config, name):
    records = read_run(run_dir(config, name)).metrics
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


def events(config, name, kind):
    return read_run(run_dir(config, name)).of_kind(kind)


def final_weights(config, name):
    model, meta = load_model(run_dir(config, name) / "checkpoints" / f"step-{STEPS:08d}")
    assert meta["step"] == STEPS
    return model.state_dict()


@pytest.fixture(scope="module")
def straight(config):
    train(config, "straight")
    return losses(config, "straight"), final_weights(config, "straight")


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.slow
def test_kill_and_resume_is_bit_identical(config, straight):
    # the kill run saves synchronously so that step 4's checkpoint is surely complete at step 6
    train(config, "killed", "--checkpoint.async_save=false", faults="kill@step:6", expect="killed")
    assert sorted(p.name for p in (run_dir(config, "killed") / "checkpoints").iterdir()) == ["step-00000004"]
    assert len(losses(config, "killed")) == 6
    done = train(config, "killed")
    assert "resumed from" in done.stdout and "at step 4" in done.stdout
    assert losses(config, "killed") == straight[0]  # exact, metrics of steps 5-6 replaced
    assert_same_weights(final_weights(config, "killed"), straight[1])


@pytest.mark.slow
def test_kill_in_the_middle_of_a_save(config, straight):
    train(config, "midsave", "--checkpoint.every=2", faults="kill@save:6", expect="killed")
    names = sorted(p.name for p in (run_dir(config, "midsave") / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000004", "step-00000006.tmp"]
    with pytest.raises(CheckpointError, match="manifest.json missing"):
        verify(run_dir(config, "midsave") / "checkpoints" / "step-00000006.tmp")
    done = train(config, "midsave", "--checkpoint.every=2")
    assert "at step 4" in done.stdout
    assert losses(config, "midsave") == straight[0]
    assert_same_weights(final_weights(config, "midsave"), straight[1])
    assert not list((run_dir(config, "midsave") / "checkpoints").glob("*.tmp"))  # cleaned up


@pytest.mark.slow
def test_synchronous_saves_match_async(config, straight):
    train(config, "sync", "--checkpoint.async_save=false")
    assert losses(config, "sync") == straight[0]
    assert_same_weights(final_weights(config, "sync"), straight[1])
    saved = events(config, "sync", "checkpoint_saved")
    assert [e["step"] for e in saved] == [4, 8]


def _shard(directory: Path) -> Path:
    return min(directory.glob("*.distcp"))


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest", "missing-file"])
def test_damaged_newest_checkpoint_falls_back(config, straight, damage):
    name = f"damaged-{damage}"
    # synchronous saves: step 8's checkpoint is complete when the kill after step 8 comes
    train(config, name, "--checkpoint.async_save=false", faults="kill@step:8", expect="killed")
    newest = run_dir(config, name) / "checkpoints" / "step-00000008"
    assert (newest / "manifest.json").is_file()
    shard = _shard(newest)
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x01
        shard.write_bytes(bytes(data))
        words = [shard.name, "fails its checksum"]
    elif damage == "truncate":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        words = [shard.name, "bytes, the manifest says"]
    elif damage == "no-manifest":
        (newest / "manifest.json").unlink()
        words = []
    else:
        (newest / "meta.json").unlink()
        words = ["meta.json is missing"]
    info = run_liandan("ckpt", "info", newest)
    assert info.returncode == 0 and "NOT VERIFIED" in info.stdout
    for word in words:
        assert word in info.stdout
    done = train(config, name)
    assert "at step 4" in done.stdout
    rejected = events(config, name, "checkpoint_rejected")
    if damage != "no-manifest":  # without a manifest it is not a candidate at all
        assert rejected and all(w in rejected[0]["error"] for w in words)
    assert losses(config, name) == straight[0]
    assert_same_weights(final_weights(config, name), straight[1])


@pytest.mark.slow
def test_retention_keeps_newest_and_milestones(config):
    train(config, "retain", "--train.steps=10", "--checkpoint.every=1", "--checkpoint.keep_last=2", "--checkpoint.keep_every=4")
    names = sorted(p.name for p in (run_dir(config, "retain") / "checkpoints").iterdir())
    assert names == ["step-00000004", "step-00000008", "step-00000009", "step-00000010"]


@pytest.mark.slow
def test_injected_enospc_is_reported_and_training_goes_on(config, straight):
    train(config, "enospc", faults="enospc@save:4")
    failed = events(config, "enospc", "checkpoint_failed")
    assert [e["step"] for e in failed] == [4] and "No space left on device" in failed[0]["error"]
    names = sorted(p.name for p in (run_dir(config, "enospc") / "checkpoints").iterdir())
    assert names == ["step-00000008"]
    assert losses(config, "enospc") == straight[0]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, check=False)
    return done.returncode == 0


@pytest.mark.slow
def test_really_full_disk(config, tmp_path):
    disk = tmp_path / "small-disk"
    if not _mount_tmpfs(disk, "256k"):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected ENOSPC test covers the path")
    try:
        train(config, "fulldisk", f"--checkpoint.dir={disk}")
        failed = events(config, "fulldisk", "checkpoint_failed")
        assert [e["step"] for e in failed] == [4, 8]
        # DCP reports a full disk in its own words (often a stream-writer error); the free space says why
        assert all(f"free space on {disk}: 0.0 MiB" in e["error"] for e in failed), failed
        assert list(disk.iterdir()) == []  # partial saves removed, space given back
        assert len(losses(config, "fulldisk")) == STEPS
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_rng_states_round_trip_through_weights_only_load(tmp_path):
    import random

    import numpy as np

    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    torch.save(rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1]) and got[2] == expected[2]


def test_manager_never_deletes_the_only_checkpoint(tmp_path):
    model = torch.nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path, keep_last=1, async_save=False)
    for step in (1, 2, 3):
        manager.save(step, model, torch.optim.AdamW(model.parameters()), {"model_args": {}})
    assert [p.name for p in manager.complete_checkpoints()] == ["step-00000003"]
    assert manager.latest_verified() == tmp_path / "step-00000003"


@pytest.mark.slow
def test_init_from_checks_the_model_shape(config, straight):
    source = run_dir(config, "straight") / "checkpoints" / f"step-{STEPS:08d}"
    done = train(config, "badinit", f"--checkpoint.init_from={source}", "--model.dim=128", expect=2)
    assert "model.dim = 128 (checkpoint: 64)" in done.stderr
    train(config, "init", f"--checkpoint.init_from={source}", "--train.steps=1", "--schedule.warmup_steps=0", "--checkpoint.every=0")
    assert losses(config, "init")[0] < straight[0][0]  # starts from trained weights
