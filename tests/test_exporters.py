"""The exporters to TensorBoard, Weights & Biases (offline) and MLflow (SQLite): a real supervised 2-rank run
with a rank killed part-way (the session's incident run), read back with each library's own reader; and the
config errors, a missing library and a tracker that fails while training."""

import json
import os
import struct
import sys

import pytest

from helpers import (
    INCIDENT_KILL_STEP,
    INCIDENT_RESUME_STEP,
    INCIDENT_RUN,
    INCIDENT_STEPS,
    read_run,
    tiny_config,
    tracker_env,
    write_corpus,
)
from liandan.config import ConfigError, load_config
from liandan.run import RunDir, read_json
from liandan.track import JsonlLogger
from liandan.track.exporters.events import describe, marker_of


@pytest.fixture(scope="module")
def tracked_run(incident_run):
    """`liandan train --nproc=2` under the supervisor with every exporter on; rank 1 is killed after step 45
    and the run resumes from the checkpoint of step 40 (helpers.INCIDENT_*)."""
    assert "warning:" not in incident_run.stderr, incident_run.stderr[-3000:]  # no tracker failed
    return read_run(incident_run.path)


def _losses(run) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in run.metrics}


@pytest.mark.slow
def test_tensorboard_holds_the_kept_curve_the_incidents_and_the_config(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from tensorboard.util import tensor_util

    run = tracked_run
    [incident] = run.of_kind("incident")
    assert incident["step"] == INCIDENT_KILL_STEP and incident["resume_step"] == INCIDENT_RESUME_STEP
    room = RunDir(run.path)
    metrics = EventAccumulator(str(room.tensorboard), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    # the killed attempt's steps 41-45 and the steps the guard rolled back are superseded by those trained again:
    # exactly the kept curve
    curve = {e.step: e.value for e in metrics.Scalars("loss")}
    assert list(curve) == list(range(1, INCIDENT_STEPS + 1))
    assert curve == pytest.approx(_losses(run), rel=1e-6)
    configs = metrics.Tensors("config/text_summary")
    assert [c.step for c in configs] == [0, INCIDENT_RESUME_STEP]  # each process says which config it trains with
    assert f"steps = {INCIDENT_STEPS}".encode() in tensor_util.make_ndarray(configs[-1].tensor_proto).item()
    content = metrics.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    session = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info
    assert session.hparams["train.steps"].number_value == INCIDENT_STEPS
    assert session.hparams["track.exporters"].string_value == '["tensorboard", "wandb", "mlflow"]'

    events = EventAccumulator(str(room.tensorboard / "events"), size_guidance={"scalars": 0, "tensors": 0}).Reload()
    [text] = events.Tensors("events/incident/text_summary")
    said = tensor_util.make_ndarray(text.tensor_proto).item().decode()
    assert (
        text.step == INCIDENT_KILL_STEP and "signal SIGKILL" in said and f"resume_step={INCIDENT_RESUME_STEP}" in said
    )
    assert [e.step for e in events.Scalars("incidents/incident")] == [INCIDENT_KILL_STEP]
    assert [e.step for e in events.Scalars("incidents/restart")] == [INCIDENT_KILL_STEP]
    assert [e.step for e in events.Scalars("incidents/resumed")] == [INCIDENT_RESUME_STEP]
    # the supervisor's last word, handed on by the supervisor itself once its workers had ended
    assert len(events.Tensors("events/supervisor_end/text_summary")) == 1
    assert read_json(room.trackers)["events_offset"] == room.events.stat().st_size


def _wandb_records(run_dir):
    """Every record of the run's offline W&B files, oldest first, parsed with W&B's own protocol buffers. The
    files are LevelDB-style logs: a 7-byte header, then 32 KiB blocks of chunks (crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(RunDir(run_dir).wandb.glob("offline-run-*/*.wandb"), key=lambda p: p.parent.name)
    assert files
    records = []
    for path in files:
        data = path.read_bytes()
        ident, magic, _version = struct.unpack("<4sHB", data[:7])
        assert (ident, magic) == (b":W&B", 0xBEE1)
        pos, pending = 7, b""
        while pos + 7 <= len(data):
            if 32768 - pos % 32768 < 7:  # too little room for a chunk header: the block is padded
                pos += 32768 - pos % 32768
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if kind == 0:
                break
            chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):  # a whole record, or the last chunk of one
                records.append(wandb_internal_pb2.Record.FromString(pending))
    return records


def _wandb_rows(records) -> list[dict]:
    return [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item} for r in records
            if r.WhichOneof("record_type") == "history"]  # fmt: skip


@pytest.mark.slow
def test_wandb_offline_files_hold_the_metrics_the_incidents_and_the_config(tracked_run):
    run = tracked_run
    records = _wandb_records(run.path)
    state = read_json(RunDir(run.path).trackers)["wandb"]
    starts = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert {s.run_id for s in starts} == {state["id"]}  # every process resumed the one W&B run
    config = {item.key: json.loads(item.value_json) for item in starts[0].config.update}
    assert config["train"]["steps"] == INCIDENT_STEPS and config["track"]["wandb"]["mode"] == "offline"
    rows = _wandb_rows(records)
    last = {}
    for row in rows:
        if "loss" in row:
            last[row["step"]] = row["loss"]
    assert last == pytest.approx(_losses(run), rel=1e-6)  # the later row of a step trained twice is the kept one
    [incident] = [row for row in rows if "incidents/incident" in row]
    assert incident["step"] == INCIDENT_KILL_STEP and "signal SIGKILL" in incident["incident"]
    assert {"incident", "restart", "resumed"} <= set(starts[-1].tags)
    alerts = [r.alert for r in records if r.WhichOneof("record_type") == "alert"]
    assert [a.title for a in alerts] == [f"incident at step {INCIDENT_KILL_STEP}"]


@pytest.mark.slow
def test_mlflow_holds_the_metrics_the_incidents_and_the_params(tracked_run):
    from mlflow.tracking import MlflowClient

    run = tracked_run
    state = read_json(RunDir(run.path).trackers)["mlflow"]
    assert state["uri"] == f"sqlite:///{run.path.parent.resolve() / 'mlflow.db'}"
    client = MlflowClient(state["uri"])
    found = client.get_run(state["run_id"])
    assert found.info.status == "FINISHED" and found.info.run_name == INCIDENT_RUN
    assert found.data.params["train.steps"] == str(INCIDENT_STEPS) and found.data.params["model.llama.dim"] == "64"
    history = sorted(client.get_metric_history(state["run_id"], "loss"), key=lambda m: m.timestamp)
    last = {m.step: m.value for m in history}
    assert last == pytest.approx(_losses(run), rel=1e-6)
    assert [m.step for m in client.get_metric_history(state["run_id"], "incidents/incident")] == [INCIDENT_KILL_STEP]
    last_incident = [e for e in run.events if marker_of(e)][-1]
    assert found.data.tags["liandan.last_incident"] == describe(last_incident)
    assert {a.path for a in client.list_artifacts(state["run_id"])} >= {"config.toml", "events.jsonl"}


def test_an_unknown_exporter_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"track.exporters: unknown exporter 'tensorbord' \(did you mean 'tensorboard'"
    ):
        load_config(None, ['--track.exporters=["tensorbord"]'])
    with pytest.raises(ConfigError, match="track.exporters names wandb more than once"):
        load_config(None, ["--track.exporters=wandb,wandb"])
    with pytest.raises(ConfigError, match="track.wandb.mode = 'cloud' is not allowed"):
        load_config(None, ["--track.wandb.mode=cloud"])


def test_a_missing_library_names_its_extra(tmp_path, monkeypatch, capsys):
    from liandan.cli.main import main

    config = tmp_path / "c.toml"
    config.write_text(tiny_config(tmp_path / "runs", write_corpus(tmp_path), "--track.exporters=wandb").to_toml())
    monkeypatch.setitem(sys.modules, "wandb", None)  # Python's own way to make a module unimportable
    assert main(["train", str(config)]) == 2
    assert (
        capsys.readouterr().err
        == "liandan: error: liandan train needs the [wandb] extra: pip install 'liandan[wandb]'\n"
    )
    assert not (tmp_path / "runs").exists()  # said before anything started


def test_a_failing_tracker_warns_once_and_the_others_go_on(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from liandan.track.exporters import open_exporters

    for key, value in tracker_env(tmp_path).items():
        monkeypatch.setenv(key, value)
    room = RunDir(tmp_path / "runs" / "run")
    room.path.mkdir(parents=True)
    cfg = load_config(None, ["--track.exporters=wandb,tensorboard"])
    files, said = JsonlLogger(room), []
    exporters = open_exporters(room, cfg, first_step=0, say=said.append)
    [wandb, tensorboard] = exporters.trackers
    for step in (1, 2):
        files.log_metrics(step, {"loss": 3.0 - step})
        exporters.log_metrics(step, {"loss": 3.0 - step})
    wandb.run.finish()  # from outside: W&B refuses whatever comes next
    for step in (3, 4):
        files.log_event("guard", step=step, action="skip", detectors=["grad"], detail="gradient norm 1e4")
        exporters.log_event("guard", step=step, action="skip")
        files.log_metrics(step, {"loss": 3.0 - step})
        exporters.log_metrics(step, {"loss": 3.0 - step})
    exporters.close()
    files.close()
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith("the wandb exporter failed and is off from now on (")
    assert exporters.trackers == [tensorboard]
    metrics = EventAccumulator(str(room.tensorboard)).Reload()
    assert [e.step for e in metrics.Scalars("loss")] == [1, 2, 3, 4]
    events = EventAccumulator(str(room.tensorboard / "events")).Reload()
    assert [e.step for e in events.Scalars("incidents/guard_skip")] == [3, 4]
    assert os.path.getsize(room.events) == read_json(room.trackers)["events_offset"]
    # the next process (a restart at step 4) gives W&B what it missed, from the run's files
    exporters = open_exporters(room, cfg, first_step=4, say=said.append)
    exporters.close()
    assert len(said) == 1 and [t.name for t in exporters.trackers] == ["wandb", "tensorboard"]
    rows = _wandb_rows(_wandb_records(room.path))
    assert sorted({row["step"] for row in rows if "loss" in row}) == [1, 2, 3, 4]
    assert [row["step"] for row in rows if "incidents/guard_skip" in row] == [3, 4]


def test_tensorboard_keeps_what_a_rollback_trained_again(tmp_path):
    """Steps 3 and 4 are trained again after a rollback: TensorBoard's reader shows the new values only, as
    metrics.jsonl does, and the rollback's own marker survives."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from liandan.track.exporters import open_exporters

    room = RunDir(tmp_path / "run")
    room.path.mkdir()
    files = JsonlLogger(room)
    exporters = open_exporters(room, load_config(None, ["--track.exporters=tensorboard"]), first_step=0)
    for step, loss in [(1, 5.0), (2, 4.0), (3, 9.0), (4, 8.0)]:
        exporters.log_metrics(step, {"loss": loss})
    files.log_event("rollback", step=4, to=2, detail="spike")
    for step, loss in [(3, 3.5), (4, 3.0), (5, 2.5)]:
        exporters.log_metrics(step, {"loss": loss})
    exporters.close()
    files.close()
    metrics = EventAccumulator(str(room.tensorboard)).Reload()
    assert [(e.step, e.value) for e in metrics.Scalars("loss")] == [(1, 5.0), (2, 4.0), (3, 3.5), (4, 3.0), (5, 2.5)]
    events = EventAccumulator(str(room.tensorboard / "events")).Reload()
    assert [e.step for e in events.Scalars("incidents/rollback")] == [4]
