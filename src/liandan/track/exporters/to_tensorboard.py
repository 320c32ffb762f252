"""TensorBoard event files: the metrics (and the config as text and hyperparameters) in one TensorBoard run,
the events in another beside it (`events/`): each event's text, and a scalar of 1 at an incident's step.

Steps a rollback or a restart trains again are superseded the way TensorBoard knows: a session-start record at
the first of them, after which its readers drop what was logged at or after that step. The events live in a
run of their own so that such a record never hides an incident; each new process appends a new event file."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from liandan.config import option
from liandan.track.exporters.events import TrackedEvent
from liandan.track.exporters.trackers import RunInfo, flat_config

FLUSH_S = 5  # events: a crashed worker loses at most this many seconds of them (the next one hands them on)


@dataclass
class TensorBoardOptions:
    """`[track.tensorboard]`."""

    dir: str = option(
        "", "where TensorBoard event files go: <this>/<run name>; empty means <run directory>/tensorboard"
    )


class TensorBoardTracker:
    name = "tensorboard"
    buffered = False  # its writers are flushed as metrics and events come

    def __init__(self, info: RunInfo, state: dict):
        from torch.utils.tensorboard import SummaryWriter

        t: TensorBoardOptions = info.track.options["tensorboard"]
        directory = Path(t.dir) / info.name if t.dir else info.room.tensorboard
        self.where = f"tensorboard ({directory})"
        self.metric_writer = None
        if info.worker:  # the supervisor writes events only
            # purge_step: what an earlier attempt logged after the step this one resumes from is superseded
            self.metric_writer = SummaryWriter(str(directory), purge_step=info.first_step + 1, flush_secs=FLUSH_S)
            self._write_config(info)
        self.event_writer = SummaryWriter(str(directory / "events"), flush_secs=FLUSH_S)

    def _write_config(self, info: RunInfo) -> None:
        from torch.utils.tensorboard.summary import hparams

        self.metric_writer.add_text("config", "```toml\n" + info.config_toml + "\n```", info.first_step)
        for summary in hparams(flat_config(info.config), {"loss": 0.0}):  # the metric named, not its value
            self.metric_writer.file_writer.add_summary(summary)

    def metrics(self, step: int, values: dict[str, float], wall_time: float) -> None:
        for key, value in values.items():
            self.metric_writer.add_scalar(key, value, step, wall_time)
        self.metric_writer.flush()  # a step its process logged stays logged, as in metrics.jsonl

    def rewind(self, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        start = SessionLog(status=SessionLog.START)
        self.metric_writer.file_writer.add_event(Event(step=step, wall_time=time.time(), session_log=start))

    def event(self, event: TrackedEvent) -> None:
        self.event_writer.add_text(f"events/{event.kind}", event.text, event.step, event.time)
        if event.marker:
            self.event_writer.add_scalar(f"incidents/{event.marker}", 1.0, event.step, event.time)
        if event.values and self.metric_writer is not None:
            for key, value in event.values.items():
                self.metric_writer.add_scalar(key, value, event.step, event.time)

    def flush(self) -> None:
        for writer in (self.metric_writer, self.event_writer):
            if writer is not None:
                writer.flush()

    def close(self, outcome: str | None) -> None:
        for writer in (self.metric_writer, self.event_writer):
            if writer is not None:
                writer.close()
