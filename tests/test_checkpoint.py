"""Checkpoints with real processes and real files: kills, corruption, tampering, full disks, retention, resume."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from helpers import fill_disk, liandan_here, read_run, run_liandan, tiny_config, write_corpus
from liandan.checkpoint.loading import load_model
from liandan.checkpoint.manager import CheckpointManager
from liandan.checkpoint.rng import rng_state, set_rng_state
from liandan.checkpoint.verify import CheckpointError, verify, write_manifest

STEPS = 8


@pytest.fixture(scope="module")
def config(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    path = root / "tiny.toml"
    cfg = tiny_config(
        root / "runs",
        write_corpus(root),
        f"--train.steps={STEPS}",
        "--checkpoint.every=4",
        "--run.name=",
        "--resilience.supervise=false",
    )
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


@pytest.fixture(scope="module")
def killed_after_the_last_save(config):
    """A run killed after step 8, its saves synchronous so that step 8's checkpoint is complete when the kill
    comes; each test that damages that checkpoint takes a copy (`copy_of_killed`)."""
    train(config, "killed-after-8", "--checkpoint.async_save=false", faults="kill@step:8", expect="killed")
    return run_dir(config, "killed-after-8")


def copy_of_killed(config, killed: Path, name: str) -> Path:
    """A copy of the killed run as run `name`, to damage and resume as if it had been killed there."""
    shutil.copytree(killed, run_dir(config, name), symlinks=True)
    return run_dir(config, name)


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
@pytest.mark.parametrize("damage", ["flip", "truncate", "no-manifest", "missing-file", "meta-without-step"])
def test_damaged_newest_checkpoint_falls_back(config, straight, killed_after_the_last_save, damage):
    name = f"damaged-{damage}"
    newest = copy_of_killed(config, killed_after_the_last_save, name) / "checkpoints" / "step-00000008"
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
    elif damage == "missing-file":
        (newest / "meta.json").unlink()
        words = ["meta.json is missing"]
    else:  # changed together with its checksum: the manifest passes it, the meta is checked for itself
        meta = json.loads((newest / "meta.json").read_text())
        (newest / "meta.json").write_text(json.dumps({**meta, "step": "eight"}))
        write_manifest(newest)
        words = ["meta.json does not give the step", "'eight'"]
    info = liandan_here("ckpt", "info", newest)
    assert info.returncode == 0 and "NOT VERIFIED" in info.stdout
    for word in words:
        assert word in info.stdout
    done = train(config, name)
    assert "at step 4" in done.stdout
    rejected = events(config, name, "checkpoint_rejected")
    reported = words or ["manifest.json missing"]  # no candidate without it, but reported when the run looks
    assert rejected and rejected[0]["step"] == 8 and all(w in rejected[0]["error"] for w in reported), rejected
    assert losses(config, name) == straight[0]
    assert_same_weights(final_weights(config, name), straight[1])


def test_a_run_whose_every_checkpoint_fails_verification_stops_rather_than_start_over(
    config, killed_after_the_last_save
):
    """Starting from step 0 past checkpoints that no longer verify would lose the run's progress behind a
    warning, and its next saves would retire the checkpoints someone could still repair: the run stops in one
    line and leaves the run directory as it was."""
    run = copy_of_killed(config, killed_after_the_last_save, "all-damaged")
    damaged = {}
    for directory in sorted((run / "checkpoints").glob("step-*")):
        shard = _shard(directory)
        shard.write_bytes(shard.read_bytes()[::-1])  # same size, other bytes: fails its checksum
        damaged[shard] = shard.read_bytes()
    assert len(damaged) == 2
    metrics = (run / "metrics.jsonl").read_bytes()
    done = train(config, "all-damaged", expect=2)
    assert "Traceback" not in done.stderr, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert error.startswith("liandan: error: none of the 2 checkpoint(s) under ") and "step-00000008" in error
    assert "move the checkpoints aside to start over" in error
    assert [e["step"] for e in events(config, "all-damaged", "checkpoint_rejected")] == [8, 4]
    assert all(shard.read_bytes() == data for shard, data in damaged.items())
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]
    assert (run / "metrics.jsonl").read_bytes() == metrics  # nothing trained, nothing truncated


@pytest.mark.slow
def test_retention_keeps_newest_and_milestones(config):
    train(
        config,
        "retain",
        "--train.steps=10",
        "--checkpoint.every=1",
        "--checkpoint.keep_last=2",
        "--checkpoint.keep_every=4",
    )
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


def test_really_full_disk_fails_the_run_in_one_line(config, small_disk):
    disk = small_disk("256k")
    done = train(config, "fulldisk", f"--checkpoint.dir={disk}", "--doctor.preflight=true", expect=2)
    failed = events(config, "fulldisk", "checkpoint_failed")
    assert [e["step"] for e in failed] == [4, 8]
    # DCP reports a full disk in its own words (often a stream-writer error); the free space says why
    assert all(f"free space on {disk}: 0.0 MiB" in e["error"] for e in failed), failed
    assert all("\n" not in e["error"] and "Traceback" in e["traceback"] for e in failed)  # the record keeps it all
    assert list(disk.iterdir()) == []  # partial saves removed, space given back
    assert len(losses(config, "fulldisk")) == STEPS
    # The last step's checkpoint did not save: no "done", and one line that says which and why.
    assert "done:" not in done.stdout and "Traceback" not in done.stderr
    [error] = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert str(disk / "step-00000008") in error and f"free space on {disk}: 0.0 MiB" in error, error
    timeline = liandan_here("incidents", run_dir(config, "fulldisk"), check=True)
    shown = [line for line in timeline.stdout.splitlines() if "checkpoint failed" in line]
    assert len(shown) == 2 and "Traceback" not in timeline.stdout, timeline.stdout
    told = [line for line in timeline.stdout.splitlines() if not line.lstrip().startswith("-> ")]  # not triage
    assert len(told) <= 4, timeline.stdout  # a line per event, not a traceback
    # The preflight doctor saw it coming: a warning before step 1 that the disk cannot hold the checkpoints.
    assert "doctor warning before step 1: " in timeline.stdout and f"{disk} has 0.00 GiB free" in timeline.stdout


def test_failed_saves_in_a_row_stop_the_run(config, small_disk):
    disk = small_disk("256k")
    done = train(config, "nosaves", f"--checkpoint.dir={disk}", "--checkpoint.every=1", "--checkpoint.async_save=false",
                 expect=2)  # fmt: skip
    assert [e["step"] for e in events(config, "nosaves", "checkpoint_failed")] == [1, 2, 3]
    assert len(losses(config, "nosaves")) == 3  # stopped, rather than training on with nothing saved
    [error] = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert "3 checkpoint saves in a row failed" in error and str(disk / "step-00000003") in error, error


def test_injected_failed_saves_in_a_row_stop_the_run(config):
    """The same stop as on a really full disk, driven by injected faults so that it runs without a tmpfs."""
    faults = "enospc@save:1,enospc@save:2,enospc@save:3"
    overrides = ("--checkpoint.every=1", "--checkpoint.async_save=false")
    done = train(config, "nosaves-injected", *overrides, faults=faults, expect=2)
    assert [e["step"] for e in events(config, "nosaves-injected", "checkpoint_failed")] == [1, 2, 3]
    assert len(losses(config, "nosaves-injected")) == 3  # stopped, rather than training on with nothing saved
    [error] = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    newest_failed = run_dir(config, "nosaves-injected") / "checkpoints" / "step-00000003"
    assert "3 checkpoint saves in a row failed" in error and str(newest_failed) in error, error
    assert "No space left on device" in error and "there is no saved checkpoint to resume from" in error, error


def test_a_saved_checkpoint_resets_the_count_of_failed_saves(config):
    faults = "enospc@save:1,enospc@save:2,enospc@save:4,enospc@save:5"
    overrides = ("--train.steps=6", "--checkpoint.every=1", "--checkpoint.async_save=false")
    train(config, "somesaves", *overrides, faults=faults)
    assert [e["step"] for e in events(config, "somesaves", "checkpoint_failed")] == [1, 2, 4, 5]
    assert [e["step"] for e in events(config, "somesaves", "checkpoint_saved")] == [3, 6]


def test_stale_temporaries_are_removed_at_start(config, small_disk):
    disk = small_disk("8m")
    stale = disk / "step-00000002.tmp"  # a save that died half-way, holding the disk
    stale.mkdir()
    fill_disk(stale / "__0_0.distcp")
    train(config, "stale", f"--checkpoint.dir={disk}")
    assert sorted(p.name for p in disk.iterdir()) == ["step-00000004", "step-00000008"]
    assert [e["step"] for e in events(config, "stale", "checkpoint_saved")] == [4, 8]


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
    done = train(config, "badinit", f"--checkpoint.init_from={source}", "--model.llama.dim=128", expect=2)
    assert "model.dim = 128 (checkpoint: 64)" in done.stderr
    train(
        config,
        "init",
        f"--checkpoint.init_from={source}",
        "--train.steps=1",
        "--schedule.warmup_steps=0",
        "--checkpoint.every=0",
    )
    assert losses(config, "init")[0] < straight[0][0]  # starts from trained weights


# ---------------------------------------------------------------------------------------------------------
# Trust: a checkpoint is data, never code. Whoever can write a checkpoint can also make its manifest agree
# (it is unsigned), so these tamper with a file and then write a fresh, consistent manifest.


class _CreatesFile:
    """Unpickling this opens `path` for writing, creating the file: the least a crafted pickle could do."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))

    def __deepcopy__(self, memo):  # DCP's save copies state: that must not run the payload in the test itself
        return self


def _liandan(*args):
    """A command that only reads checkpoints (ckpt info, export, incidents), run in this process: a payload
    that ran would leave its marker just the same, and the exit code and error line are the command line's."""
    return liandan_here(*args)


def _plant_in_metadata(checkpoint: Path, marker: Path) -> None:
    """A `.metadata` that still describes every tensor but also carries the payload; manifest rewritten."""
    import pickle

    from liandan.checkpoint.verify import write_manifest

    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by this test suite's own run: trusted here
    metadata.planner_data["payload"] = _CreatesFile(marker)
    with open(checkpoint / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(checkpoint)


def _one_line_error(done, *words):
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("liandan: error: "), done.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]


def _tiny_checkpoint(root: Path, step: int = 1):
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    manager = CheckpointManager(root, async_save=False)
    manager.save(step, model, optimizer, {"model_args": {}})
    return manager, model, optimizer, root / f"step-{step:08d}"


@pytest.mark.parametrize("where", ["metadata", "optimizer-bytes"])
def test_crafted_checkpoint_runs_no_code_even_unverified(tmp_path, where):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from liandan.checkpoint.verify import write_manifest

    marker = tmp_path / "payload-ran"
    manager, model, optimizer, path = _tiny_checkpoint(tmp_path / "ckpt")
    if where == "metadata":
        _plant_in_metadata(path, marker)
        with pytest.raises(CheckpointError, match=r"\.metadata"):
            verify(path)
    else:  # DCP stores non-tensor optimizer state as pickles of its own inside the shards
        model_sd, optim_sd = get_state_dict(model, optimizer)
        optim_sd["param_groups"][0]["lr"] = _CreatesFile(marker)
        for name in list(os.listdir(path)):
            if name.endswith(".distcp") or name == ".metadata":
                os.unlink(path / name)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(path), no_dist=True)
        write_manifest(path)
        verify(path)  # consistent on disk: only loading it can tell
    with pytest.raises(CheckpointError) as refused:
        manager.load(path, model, optimizer, verified=True)  # as on resume, where rank 0 verified it already
    message = str(refused.value)
    assert str(path) in message and "\n" not in message, message
    assert ".metadata" in message if where == "metadata" else ".distcp" in message, message
    assert not marker.exists()


def test_checkpoint_meta_is_strict_json(tmp_path):
    """meta.json never holds NaN or Infinity (which strict JSON readers refuse): they are written as null."""
    import json

    def refuse(constant):
        raise ValueError(f"{constant} in meta.json")

    model = torch.nn.Linear(4, 4)
    manager = CheckpointManager(tmp_path, async_save=False)
    manager.save(1, model, torch.optim.AdamW(model.parameters()), {"callbacks": {"guard": {"level": float("nan")}},
                                                                   "tokens": float("-inf")})  # fmt: skip
    meta = json.loads((tmp_path / "step-00000001" / "meta.json").read_text(), parse_constant=refuse)
    assert meta["callbacks"] == {"guard": {"level": None}} and meta["tokens"] is None and meta["step"] == 1


@pytest.mark.parametrize("outside", ["../elsewhere.distcp", "/ABS/elsewhere.distcp", "sub/../../elsewhere.distcp"])
def test_metadata_naming_a_shard_outside_the_checkpoint_is_refused(tmp_path, outside):
    """A crafted `.metadata` whose shard names lead out of the checkpoint's directory (up, or to an absolute
    path) is refused in one line, though the file it names is there and well-formed."""
    import pickle

    from liandan.checkpoint.restricted import read_metadata
    from liandan.checkpoint.verify import write_manifest

    manager, model, optimizer, path = _tiny_checkpoint(tmp_path / "ckpt")
    target = Path(outside.replace("/ABS", str(tmp_path))) if outside.startswith("/ABS") else path / outside
    (path / "sub").mkdir()
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # written by this test itself: trusted here
    for index, info in metadata.storage_data.items():
        shutil.copyfile(path / info.relative_path, target)  # a real shard, where the crafted name points
        metadata.storage_data[index] = type(info)(str(target) if outside.startswith("/ABS") else outside,
                                                  info.offset, info.length)  # fmt: skip
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    write_manifest(path)
    with pytest.raises(CheckpointError) as refused:
        read_metadata(path)
    message = str(refused.value)
    assert "outside the checkpoint's directory" in message and ".metadata" in message and "\n" not in message
    with pytest.raises(CheckpointError, match="outside the checkpoint's directory"):
        manager.load(path, model, optimizer, verified=True)


def test_crafted_metadata_is_refused_by_every_command(config, straight, tmp_path):
    marker = tmp_path / "payload-ran"
    tampered = tmp_path / "step-00000008"
    shutil.copytree(run_dir(config, "straight") / "checkpoints" / f"step-{STEPS:08d}", tampered)
    _plant_in_metadata(tampered, marker)
    for flags in ([], ["--no-checksums"]):
        info = _liandan("ckpt", "info", tampered, *flags)
        assert info.returncode == 0 and "NOT VERIFIED" in info.stdout and ".metadata" in info.stdout, info.stdout
    _one_line_error(_liandan("export", tampered, tmp_path / "hf", "--hf"), str(tampered), ".metadata")
    _one_line_error(_liandan("export", tampered, tmp_path / "m.safetensors", "--consolidated"), str(tampered))
    for verify_flag in ("true", "false"):
        done = train(config, f"init-tampered-{verify_flag}", f"--checkpoint.init_from={tampered}",
                     f"--checkpoint.verify={verify_flag}", "--train.steps=1", "--schedule.warmup_steps=0",
                     expect=2)  # fmt: skip
        _one_line_error(done, str(tampered), ".metadata")
    assert not marker.exists()
    assert not (tmp_path / "hf").exists() and not (tmp_path / "m.safetensors").exists()


def test_ckpt_info_without_checksums_does_not_claim_verified(config, straight):
    newest = run_dir(config, "straight") / "checkpoints" / f"step-{STEPS:08d}"
    fast = _liandan("ckpt", "info", newest, "--no-checksums")
    assert fast.returncode == 0 and "NOT VERIFIED" not in fast.stdout
    assert "verified" not in fast.stdout and "checksums not checked" in fast.stdout, fast.stdout
    full = _liandan("ckpt", "info", newest)
    assert full.stdout.rstrip().endswith(", verified"), full.stdout


@pytest.mark.parametrize("tamper", ["metadata-payload", "inconsistent-shard"])
def test_checkpoint_that_fails_to_load_falls_back_to_the_previous(
    config, straight, killed_after_the_last_save, tmp_path, tamper
):
    from liandan.checkpoint.verify import write_manifest

    name = f"unloadable-{tamper}"
    marker = tmp_path / "payload-ran"
    newest = copy_of_killed(config, killed_after_the_last_save, name) / "checkpoints" / "step-00000008"
    if tamper == "metadata-payload":
        _plant_in_metadata(newest, marker)
        file = ".metadata"
    else:  # the tensors' bytes are cut short, and the manifest agrees: only DCP's load finds out
        shard = _shard(newest)
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size // 2)
        write_manifest(newest)
        file = shard.name
    done = train(config, name)
    assert "at step 4" in done.stdout, done.stdout + done.stderr[-3000:]
    [rejected] = events(config, name, "checkpoint_rejected")
    assert rejected["step"] == 8 and rejected["path"].endswith("step-00000008") and file in rejected["error"]
    assert losses(config, name) == straight[0]
    assert_same_weights(final_weights(config, name), straight[1])
    assert not marker.exists()
    timeline = _liandan("incidents", run_dir(config, name))
    assert "checkpoint rejected step 8" in timeline.stdout, timeline.stdout


@pytest.mark.slow
def test_ranks_agree_on_falling_back_from_an_unloadable_checkpoint(config, straight):
    from liandan.checkpoint.verify import write_manifest

    name = "unloadable-2-ranks"
    train(config, name, "--nproc=2", "--checkpoint.async_save=false", faults="kill@step:8:0", expect=1)
    newest = run_dir(config, name) / "checkpoints" / "step-00000008"
    shard = newest / "__1_0.distcp"  # rank 1's shard; with FSDP every rank reads from both
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size // 2)
    write_manifest(newest)
    done = train(config, name, "--nproc=2")
    assert "at step 4" in done.stdout, done.stdout + done.stderr[-3000:]
    [rejected] = events(config, name, "checkpoint_rejected")
    assert rejected["step"] == 8 and "__1_0.distcp" in rejected["error"]
    assert len(losses(config, name)) == STEPS


def test_step_directory_without_manifest_is_reported(tmp_path):
    root = tmp_path / "ckpt"
    found = []
    manager, *_ = _tiny_checkpoint(root, 1)
    for step in (2, 3):
        _tiny_checkpoint(root, step)
    (root / "step-00000003" / "manifest.json").unlink()
    # a save in progress: its .tmp directory, and an older copy of the same step being replaced
    (root / "step-00000004.tmp").mkdir()
    (root / "step-00000002.tmp").mkdir()
    (root / "step-00000002" / "manifest.json").unlink()
    manager.on_event = lambda kind, **fields: found.append((kind, fields))
    assert manager.latest_verified() == root / "step-00000001"
    assert [(kind, fields["step"]) for kind, fields in found] == [("checkpoint_rejected", 3)]
    assert "step-00000003" in found[0][1]["path"] and "manifest.json missing" in found[0][1]["error"]


def test_a_run_that_fails_during_a_save_leaves_no_partial_checkpoint(config):
    """The save of step 4 never completes (its rank-0 finaliser hangs before the manifest) and the run fails at
    step 5: the partial step-00000004.tmp goes with it, not left for someone to find (or fill a disk)."""
    train(config, "failsaving", "--checkpoint.every=4", faults="hang@save:4:0,raise@step:5", expect=1)
    assert sorted(p.name for p in (run_dir(config, "failsaving") / "checkpoints").iterdir()) == []
