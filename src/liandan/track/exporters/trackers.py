"""What every tracker is opened with and what it does. Each tracker lives in its own module, imported only
when a run names it: their libraries are optional extras."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Protocol

from liandan import plugins
from liandan.config import TrackSection
from liandan.run import RunDir
from liandan.track.exporters.events import TrackedEvent


@dataclass(frozen=True)
class RunInfo:
    room: RunDir
    name: str  # the run's name: its directory's
    track: TrackSection
    config: dict[str, dict[str, Any]]  # the resolved config, by section
    config_toml: str
    first_step: int | None  # the step a worker trains on from; None: the supervisor, handing on events only

    @property
    def worker(self) -> bool:
        return self.first_step is not None


class Tracker(Protocol):
    name: str
    buffered: bool  # it may lose what it was given when its process is killed (see Exporters._replay)
    where: str  # where its run is, for the user

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None: ...

    def rewind(self, step: int) -> None:
        """What was logged from `step` on is superseded: those steps are being trained again (a rollback)."""

    def event(self, event: TrackedEvent) -> None: ...

    def flush(self) -> None: ...

    def close(self, outcome: str | None) -> None:
        """`outcome`: finished, failed or killed; None when the run goes on (a worker of a supervised run that
        stops for its supervisor to decide)."""


def open_tracker(name: str, info: RunInfo, state: dict[str, Any]) -> Tracker:
    """Open the tracker `name` (an exporter plug-in: its class, called with the run and its state); `state` is
    its part of trackers.json (its run id), which it may update."""
    return plugins.load("exporter", name, what="track.exporters")(info, state)


def flat_config(config: dict[str, dict[str, Any]]) -> dict[str, str | int | float | bool]:
    """`section.key` -> value, as hyperparameter tables want them: lists as JSON text."""
    flat: dict[str, str | int | float | bool] = {}
    for section, values in config.items():
        for key, value in values.items():
            if isinstance(value, dict):  # a plug-in's table: model.llama.dim
                flat.update(flat_config({f"{section}.{key}": value}))
            else:
                flat[f"{section}.{key}"] = value if isinstance(value, (str, int, float, bool)) else json.dumps(value)
    return flat
