"""Weights & Biases: one W&B run per liandan run, resumed by every process that exports (its id is kept in
trackers.json). Offline by default: the files go under <run directory>/wandb, for `wandb sync` later.

Metrics are plotted against the run's own `step` (a metric of every row), so rows that a rollback or a restart
trains again are logged again at their step: W&B keeps both, the later row is the one the run kept. An
incident is a row with a marker (`incidents/<kind>` = 1) and its text (`incident`), a tag of the run, and, for
the severe ones, an alert (sent on when the run is online or synced)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from liandan.config import option
from liandan.track.exporters.events import TrackedEvent
from liandan.track.exporters.trackers import RunInfo


@dataclass
class WandbOptions:
    """`[track.wandb]`."""

    project: str = option("liandan", "Weights & Biases project")
    entity: str = option("", "Weights & Biases entity (team or user); empty means the default of the login")
    mode: Literal["offline", "online"] = option(
        "offline", "offline writes under <run directory>/wandb, for `wandb sync` later; online needs a login"
    )


class WandbTracker:
    name = "wandb"
    buffered = True  # its service writes the run's file every few seconds

    def __init__(self, info: RunInfo, state: dict[str, Any]):
        import wandb

        self.wandb = wandb
        t: WandbOptions = info.track.options["wandb"]
        state.setdefault("id", uuid.uuid4().hex[:16])
        self.state = state
        self.tags: set[str] = set(state.get("tags", []))
        info.room.path.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=t.project, entity=t.entity or None, id=state["id"], name=info.name,
            resume="allow", mode=t.mode, dir=str(info.room.path), config=info.config, allow_val_change=True,
            tags=sorted(self.tags) or None,
            # its own console capture would wrap the streams the supervisor relays
            settings=wandb.Settings(console="off", silent=True),
        )  # fmt: skip
        files = f", in {info.room.wandb}" if t.mode == "offline" else ""
        self.where = f"wandb ({t.mode}, run {state['id']}{files})"
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self.run.log({"step": step, **values})

    def rewind(self, step: int) -> None:
        pass  # rows are kept; the later one at a step is the run's

    def event(self, event: TrackedEvent) -> None:
        if event.values:
            self.run.log({"step": event.step, **event.values})
        if not event.marker:
            return
        self.run.log({"step": event.step, f"incidents/{event.marker}": 1.0, "incident": event.text})
        if event.marker not in self.tags:
            self.tags.add(event.marker)
            self.state["tags"] = sorted(self.tags)
            self.run.tags = tuple(sorted(self.tags))
        if event.severe:
            level = (
                self.wandb.AlertLevel.ERROR if event.kind in ("gave_up", "device_fault") else self.wandb.AlertLevel.WARN
            )
            self.run.alert(title=f"{event.kind} at step {event.step}", text=event.text, level=level)

    def flush(self) -> None:
        pass  # every row is handed to W&B's service as it is logged

    def close(self, outcome: str | None) -> None:
        self.run.finish(exit_code=1 if outcome in ("failed", "killed") else 0)
