"""MLflow: one MLflow run per liandan run, resumed by every process that exports (its id is kept in
trackers.json, with the tracking URI it belongs to). By default the tracking store is one SQLite database for
every run of the directory of run directories (`sqlite:///<that directory>/mlflow.db`, artifacts beside it in
mlflow-artifacts/), so `mlflow ui --backend-store-uri` on it compares them.

The config goes in as parameters (`section.key`; a key whose value changed between launches keeps its first
value, as MLflow allows no other, and config.toml, an artifact, has the newest) and as config.toml. Metrics
keep every value logged: a step that a rollback or a restart trained again has two, the later one is the run's.
An incident is a metric `incidents/<kind>` of 1 at its step, and the tag `liandan.last_incident`; at the end
the whole events.jsonl is an artifact."""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from liandan.config import option
from liandan.track.exporters.events import TrackedEvent
from liandan.track.exporters.trackers import RunInfo, flat_config

STATUS = {"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}
MAX_PARAM = 6000  # MLflow's longest parameter value
MAX_TAG = 5000


@dataclass
class MlflowOptions:
    """`[track.mlflow]`."""

    uri: str = option("", "MLflow tracking URI (sqlite:///path.db, http://host:5000, ...); empty means "
                      "sqlite:///<directory of run directories>/mlflow.db")  # fmt: skip
    experiment: str = option("liandan", "MLflow experiment the run is filed under")


class MlflowTracker:
    name = "mlflow"
    buffered = False  # every call is written when it returns

    def __init__(self, info: RunInfo, state: dict[str, Any]):
        from mlflow.entities import Metric
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.room = info.room
        uri = info.track.options["mlflow"].uri or f"sqlite:///{info.room.path.parent.resolve() / 'mlflow.db'}"
        with _quietly():  # its database migrations log at INFO and its ORM warns of its own deprecations
            self.client = MlflowClient(uri)
            run_id = state.get("run_id") if state.get("uri") == uri else None
            if run_id is not None and not self._exists(run_id):
                run_id = None
            if run_id is None:
                run_id = self._create_run(info, uri)
            elif info.worker:
                self.client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self.where = f"mlflow ({uri}, run {run_id})"
        state.update(uri=uri, run_id=run_id)
        if info.worker:
            self._log_config(info)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return False
        return True

    def _create_run(self, info: RunInfo, uri: str) -> str:
        name = info.track.options["mlflow"].experiment
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            experiment_id = self.client.create_experiment(name, artifact_location=_artifact_location(uri))
        tags = {"liandan.run_dir": str(info.room.path.resolve())}
        return self.client.create_run(experiment_id, run_name=info.name, tags=tags).info.run_id

    def _log_config(self, info: RunInfo) -> None:
        from mlflow.entities import Param

        logged = self.client.get_run(self.run_id).data.params
        params = [Param(k, str(v)[:MAX_PARAM]) for k, v in flat_config(info.config).items() if k not in logged]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 parameters a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])
        self.client.log_text(self.run_id, info.config_toml, "config.toml")

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None:
        ms = int(wall_time * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, ms, step) for k, v in values.items()])

    def rewind(self, step: int) -> None:
        pass  # values are kept; the later one at a step is the run's

    def event(self, event: TrackedEvent) -> None:
        ms = int(event.time * 1000)
        values = dict(event.values)
        if event.marker:
            values[f"incidents/{event.marker}"] = 1.0
            self.client.set_tag(self.run_id, "liandan.last_incident", event.text[:MAX_TAG])
        if values:
            self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, ms, event.step) for k, v in values.items()])

    def flush(self) -> None:
        pass  # every call is written when it returns

    def close(self, outcome: str | None) -> None:
        if self.room.events.is_file():
            self.client.log_artifact(self.run_id, str(self.room.events))
        if outcome is not None:
            self.client.set_terminated(self.run_id, STATUS[outcome], end_time=int(time.time() * 1000))


def _artifact_location(uri: str) -> str | None:
    """Beside a SQLite database (MLflow's default would be ./mlruns, under whatever directory the run started
    in); a server's own otherwise."""
    if not uri.startswith("sqlite:///"):
        return None
    return (Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlflow-artifacts").as_uri()


@contextlib.contextmanager
def _quietly():
    loggers = [logging.getLogger(name) for name in ("mlflow", "alembic")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
