"""Checkpoints in an object store (`checkpoint.dir = "s3://..."`), against a real S3-compatible server on
loopback: save, verify, corrupt, fall back, retention, partial saves, and a supervised run whose writer is
killed in the middle of an upload."""

import re

import pytest
import torch

from helpers import MICRO_MODEL, S3_BUCKET, environment_without, read_run, run_liandan, tiny_config, write_corpus
from liandan.checkpoint.loading import load_model
from liandan.checkpoint.manager import CheckpointManager
from liandan.checkpoint.verify import CheckpointError, verify
from liandan.cli.main import main
from liandan.config import ConfigError
from liandan.run import RunDir
from liandan.run.remote import RemotePath, locate

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

BUCKET = S3_BUCKET


def _model_and_optimizer(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer


def _manager(root, events, **kwargs):
    return CheckpointManager(root, on_event=lambda kind, **fields: events.append((kind, fields)), **kwargs)


def _flip_a_byte(path: RemotePath) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_store_checkpoints_verify_fall_back_and_keep_the_newest(s3):
    root, events = f"s3://{BUCKET}/unit/checkpoints", []
    manager = _manager(root, events, keep_last=2)
    models = {}
    for step in (1, 2, 3):
        models[step], optimizer = _model_and_optimizer(step)
        manager.save(step, models[step], optimizer, {"tokens": step})
        assert manager.wait().ok
    steps = manager.complete_checkpoints()
    assert [p.name for p in steps] == ["step-00000002", "step-00000003"]  # retention removed step 1
    assert not (locate(root) / "step-00000001").exists()
    names = {p.relative_to(steps[-1]) for p in steps[-1].rglob()}
    assert {"manifest.json", "meta.json", ".metadata", "rank-00000.pt"} <= names
    verify(steps[-1])

    _flip_a_byte(min(p for p in steps[-1].rglob() if p.name.endswith(".distcp")))
    with pytest.raises(CheckpointError, match="fails its checksum"):
        verify(steps[-1])
    assert manager.latest_verified() == steps[0]
    assert [(kind, fields["step"]) for kind, fields in events if kind == "checkpoint_rejected"] == [
        ("checkpoint_rejected", 3)
    ]
    model, optimizer = _model_and_optimizer(99)
    meta = manager.load(steps[0], model, optimizer)
    assert meta["step"] == 2 and meta["tokens"] == 2
    assert torch.equal(model.weight, models[2].weight)


def test_a_step_without_its_manifest_is_a_partial_save(s3):
    root, events = f"s3://{BUCKET}/partial/checkpoints", []
    manager = _manager(root, events, async_save=False)
    for step in (2, 4):
        manager.save(step, *_model_and_optimizer(step), {})
    newest = locate(root) / "step-00000004"
    (newest / "manifest.json").unlink()  # an upload that stopped before its manifest
    assert [p.name for p in manager.complete_checkpoints()] == ["step-00000002"]
    assert manager.latest_verified().name == "step-00000002"
    assert events[-1][0] == "checkpoint_saved"  # a partial save is not reported as a rejected checkpoint
    assert [p.name for p in manager.remove_stale_saves()] == ["step-00000004"]
    assert not newest.exists()


def test_a_store_that_cannot_be_written_stops_the_run_at_its_start(s3):
    manager = _manager(f"s3://no-such-bucket-{BUCKET}/run/checkpoints", [])
    with pytest.raises(CheckpointError, match=r"^checkpoint.dir = s3://no-such-bucket-.* cannot be written: \w+"):
        manager.remove_stale_saves()


def test_a_store_checkpoint_dir_stays_a_url():
    room = RunDir.of("runs/x", "s3://bucket/prefix/")
    assert str(room.checkpoints) == "s3://bucket/prefix"
    assert str(room.checkpoints / "step-00000004") == "s3://bucket/prefix/step-00000004"
    with pytest.raises(ConfigError, match=r"^nosuch://bucket: Protocol not known: nosuch \(install"):
        locate("nosuch://bucket/prefix").exists()  # one line, not a backend's traceback


@pytest.mark.slow
def test_supervised_run_resumes_from_the_store_after_a_broken_upload(s3, tmp_path, capsys):
    """Rank 0 is killed after both ranks' shards are uploaded and before the manifest: the supervisor restarts
    the run, which removes the partial save, resumes from the previous complete checkpoint in the store and
    finishes with every checkpoint complete and verified."""
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path), *MICRO_MODEL, "--train.steps=6",
                                  "--checkpoint.every=2", "--run.name=", "--resilience.backoff_s=0",
                                  "--doctor.preflight=false").to_toml())  # fmt: skip
    env = environment_without(**s3)

    store = locate(f"s3://{BUCKET}/broken/checkpoints")
    done = run_liandan("train", config, "--nproc=2", "--run.name=broken", f"--checkpoint.dir={store}", timeout=300,
                       env={**env, "LIANDAN_FAULTS": "kill@save:4:0"})  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    broken = read_run(tmp_path / "runs" / "broken")
    [incident] = broken.of_kind("incident")
    assert incident["cause"] == "signal SIGKILL" and incident["resume_step"] == 2
    resumed = [e for e in broken.of_kind("resumed") if e["source"] == "checkpoint"]
    assert [e["path"] for e in resumed] == [f"s3://{BUCKET}/broken/checkpoints/step-00000002"]
    assert [r["step"] for r in broken.metrics] == list(range(1, 7))
    assert [p.name for p in store.iterdir()] == ["step-00000002", "step-00000004", "step-00000006"]
    _, meta = load_model(store / "step-00000006")  # verified and read from the store, as `liandan export` does
    assert meta["step"] == 6 and meta["world_size"] == 2
    assert {p.name for p in (store / "step-00000006").rglob()} >= {"rank-00000.pt", "rank-00001.pt"}
    assert main(["ckpt", "info", str(store)]) == 0
    info = capsys.readouterr().out
    assert info.count(", verified") == 3 and f"{store}/step-00000006" in info
    assert main(["export", str(store), str(tmp_path / "model.safetensors"), "--consolidated"]) == 0  # the newest
    assert capsys.readouterr().out.startswith(f"exported step 6 of {store}/step-00000006")


@pytest.fixture
def closed_port():
    """A loopback port nothing listens on: an endpoint that refuses every connection."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def store_env(monkeypatch):
    """Set the variables a test gives, with no file systems made for another endpoint before or after it."""
    from conftest import forget_file_systems

    def use(**env):
        for key in (
            "AWS_ENDPOINT_URL",
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_PROFILE",
            "AWS_SESSION_TOKEN",
        ):
            monkeypatch.delenv(key, raising=False)
        for key, value in {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                           "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1", **env}.items():  # fmt: skip
            monkeypatch.setenv(key, value)
        forget_file_systems()

    yield use
    forget_file_systems()


@pytest.mark.parametrize("trouble", ["unreachable endpoint", "no credentials"])
def test_a_store_that_cannot_be_used_is_one_line_within_seconds(trouble, closed_port, store_env, capsys):
    import time

    if trouble == "no credentials":
        store_env()
        said = r"Unable to locate credentials \(set AWS_ACCESS_KEY_ID"
    else:
        store_env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port}", AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s")
        said = r"Could not connect to the endpoint URL.*\(check AWS_ENDPOINT_URL"
    for command in (["ckpt", "info", "s3://bucket/run"], ["export", "s3://bucket/run", "/nonexistent/m", "--hf"]):
        started = time.monotonic()
        assert main(command) == 2
        assert time.monotonic() - started < 5, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert re.match(rf"liandan: error: s3://bucket/run\S*: cannot use the store: .*{said}", err), err


def test_a_supervised_run_with_an_unreachable_store_stops_in_one_line(closed_port, tmp_path):
    config = tmp_path / "tiny.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path), *MICRO_MODEL, "--train.steps=2",
                                  "--checkpoint.every=1", "--doctor.preflight=false").to_toml())  # fmt: skip
    env = environment_without(AWS_ENDPOINT_URL=f"http://127.0.0.1:{closed_port}", AWS_ACCESS_KEY_ID="k",
                              AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    done = run_liandan("train", config, "--checkpoint.dir=s3://bucket/run", env=env, timeout=120)
    assert done.returncode == 2
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("liandan: error:")]
    assert errors == [done.stderr.strip().splitlines()[-1]] and len(errors) == 1, done.stderr
    assert re.search(r"s3://bucket/run\S*: cannot use the store: Could not connect", errors[0])


def test_ckpt_info_in_a_store_names_a_partial_save_and_verifies_the_complete_ones(s3, capsys):
    root = f"s3://{BUCKET}/info/checkpoints"
    manager = _manager(root, [], async_save=False)
    for step in (2, 4):
        manager.save(step, *_model_and_optimizer(step), {})
    (locate(root) / "step-00000004" / "manifest.json").unlink()  # an upload under way, or whose writer died
    assert main(["ckpt", "info", root]) == 0
    out = capsys.readouterr().out
    assert f"{root}/step-00000004\n  partial save, not a checkpoint: no manifest" in out
    assert "NOT VERIFIED" not in out
    assert out.rstrip().endswith("verified") and f"{root}/step-00000002\n  step 2," in out
