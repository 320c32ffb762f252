"""Exporters: a run's metrics, events and resolved config, also to TensorBoard, Weights & Biases and MLflow
(`[track] exporters`, docs/tracking.md). The run's own files stay the source of truth: a tracker that fails is
dropped with a one-line warning and training goes on.

Metrics come through `log_metrics`, from rank 0's logger. Events come from events.jsonl itself rather than
through `log_event`: the trainer, its callbacks and the supervisor all write there, and only some of them
through the logger. The exporters keep a cursor into events.jsonl (in trackers.json) and hand on the events
after it whenever they are called. So a restarted worker first hands on what the supervisor recorded between
its attempts (the incident, the restart), and the supervisor, when it ends, hands on what came after its last
worker (gave_up, supervisor_end; after a preemption the next launch's first worker does, time being short).
An event is handed on at least once: one given to the trackers just before a crash, with the cursor not yet
saved, is given again by the next worker.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from liandan import plugins
from liandan.config import Config, TrackSection
from liandan.run import JsonlTail, RunDir, atomic_write_json, parse_line, read_json
from liandan.track.exporters.events import TrackedEvent, outcome_of, tracked_event
from liandan.track.exporters.trackers import RunInfo, Tracker, open_tracker


def exporter_modules(track: TrackSection, name: str) -> tuple[str, ...]:
    """The modules exporter `name` imports, its own first (those of its extra): a missing one is a missing
    extra (`liandan[<exporter>]`). MLflow needs its SQLite store's only for a SQLite URI (the default)."""
    modules = plugins.EXTRAS.get(plugins.find("exporter", name).extra, ())
    uri = getattr(track.options.get(name), "uri", "")
    if name == "mlflow" and uri and not uri.startswith("sqlite:"):
        modules = modules[:1]
    return modules


__all__ = ["Exporters", "TrackedEvent", "check_exporters", "hand_on_events", "open_exporters"]


def check_exporters(track: TrackSection) -> None:
    """Raise ModuleNotFoundError, named after the exporter's own module (which the CLI reports as the extra to
    install, in one line), when a library of an exporter that `track` asks for is not installed."""
    for name in track.exporters:
        modules = exporter_modules(track, name)
        for module in modules:
            if importlib.util.find_spec(module) is None:
                raise ModuleNotFoundError(f"No module named '{module}' (track.exporters: {name})", name=modules[0])


def warn(message: str) -> None:
    print(f"liandan: warning: {message}", file=sys.stderr, flush=True)


class Exporters:
    """The trackers of `[track] exporters` as one MetricsLogger."""

    def __init__(self, room: RunDir, trackers: list[Tracker], state: dict[str, Any], first_step: int | None,
                 say: Callable[[str], None] = warn):  # fmt: skip
        self.room, self.trackers, self.state, self.say = room, trackers, state, say
        self.events = JsonlTail(room.events)
        self.events.offset = int(state.get("events_offset", 0))
        self.last_step = first_step  # the newest step whose metrics the trackers have
        self.event_step = 0  # the newest step an event named: the step of one that names none, in the supervisor
        self.outcome: str | None = None
        self.closed = False
        self.delivered_step: int | None = None
        self.delivered_offset = self.events.offset
        self._replay()
        # what every tracker still open has been given: where one that fails from now on missed things
        self.delivered_step, self.delivered_offset = self.last_step or 0, self.events.offset

    def describe(self) -> str:
        return ", ".join(t.where for t in self.trackers) or "no tracker"

    # -- MetricsLogger --------------------------------------------------------------------------------------
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
        if self.last_step is not None and step <= self.last_step:  # a rollback: these steps are trained again
            self._each("rewind", step)
        self.last_step = step
        self._hand_on_events()
        values = numbers(metrics)
        self._each("metrics", step, values, time.time())
        self.delivered_step = step

    def log_event(self, kind: str, **fields: Any) -> None:
        self._hand_on_events()  # the run's logger has just written it to events.jsonl

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._hand_on_events(final=True)
        self._each("close", self.outcome)
        for tracker in self.trackers:  # closed cleanly: what it was given is written
            own = self.state.setdefault(tracker.name, {})
            if tracker.buffered or "kept_step" in own:
                own.update(kept_step=self.last_step or 0, kept_offset=self.events.offset)
        self._save_state()

    # -- trackers that buffer -----------------------------------------------------------------------------
    def _replay(self) -> None:
        """A tracker that buffers (W&B writes its file every few seconds) loses what it had not written when its
        process is killed. So nothing it was given counts until it closes cleanly: each process first gives it
        again what the run's files kept since its last clean close (the metrics up to the step this process
        resumes from, all of them in the supervisor; the events already handed on). The steps after the
        resume step come from this process itself. A tracker that failed in an earlier process gets what it
        missed the same way."""
        for tracker in list(self.trackers):
            own = self.state.setdefault(tracker.name, {})
            if not (tracker.buffered or "kept_step" in own):
                continue
            kept_step, kept_offset = int(own.get("kept_step", 0)), int(own.get("kept_offset", 0))
            newest = None
            for record in self.room.read_metrics():
                step = record.get("step")
                if isinstance(step, int) and kept_step < step and (self.last_step is None or step <= self.last_step):
                    values = numbers({k: v for k, v in record.items() if k not in ("step", "time")})
                    if not self._call(tracker, "metrics", step, values, record.get("time") or time.time()):
                        break
                    newest = step
            for record in records_between(self.room.events, kept_offset, self.events.offset):
                event = tracked_event(record, newest or kept_step)
                if event is not None and not self._call(tracker, "event", event):
                    break
            if newest is not None and self.last_step is None:  # the supervisor: its events' default step
                self.event_step = newest

    # -- events -------------------------------------------------------------------------------------------
    def _hand_on_events(self, final: bool = False) -> None:
        records = self.events.read(final=final)
        if not records:
            return
        for record in records:
            event = tracked_event(record, self.last_step if self.last_step is not None else self.event_step)
            if event is None:
                continue
            self.event_step = event.step
            self.outcome = outcome_of(event, self.outcome)
            self._each("event", event)
        self._each("flush")
        self.delivered_offset = self.events.offset
        self._save_state()

    def _save_state(self) -> None:
        self.state["events_offset"] = self.events.offset
        try:
            atomic_write_json(self.room.trackers, self.state, durable=False)
        except OSError as err:  # the trackers may be given some events again: the files lose nothing
            self.say(f"cannot save the exporters' state in {self.room.trackers}: {type(err).__name__}: {err}")

    # -- failures -----------------------------------------------------------------------------------------
    def _each(self, method: str, *args: Any) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, method, *args)

    def _call(self, tracker: Tracker, method: str, *args: Any) -> bool:
        try:
            getattr(tracker, method)(*args)
        except Exception as err:  # noqa: BLE001 - a tracker's trouble (its server, its disk, its bugs) never stops training
            self._drop(tracker, err)
            return False
        return True

    def _drop(self, tracker: Tracker, err: BaseException) -> None:
        self.trackers.remove(tracker)
        own = self.state.setdefault(tracker.name, {})
        if not tracker.buffered and self.delivered_step is not None:  # one that buffers counts from its last close
            own.update(kept_step=self.delivered_step, kept_offset=self.delivered_offset)
        self.say(f"the {tracker.name} exporter failed and is off from now on ({one_line(err)}); training goes on"
                 f" and {self.room.metrics.name} and {self.room.events.name} keep everything")  # fmt: skip
        with contextlib.suppress(Exception):
            tracker.close("failed")


def open_exporters(room: RunDir, cfg: Config, first_step: int | None,
                   say: Callable[[str], None] = warn) -> Exporters | None:  # fmt: skip
    """The exporters of `cfg.track` for the run in `room`, or None when it names none. `first_step`: the step
    a worker trains on from (its resume step); None for the supervisor, which only hands on events. A tracker
    that cannot be opened is left out with a one-line warning; a library that is missing raises
    ModuleNotFoundError (a missing extra)."""
    names = cfg.track.exporters
    if not names:
        return None
    check_exporters(cfg.track)
    state = read_json(room.trackers, {})
    state = state if isinstance(state, dict) else {}
    info = RunInfo(room, room.path.name, cfg.track, cfg.to_dict(), cfg.to_toml(), first_step)
    trackers = []
    for name in names:
        own = state.setdefault(name, {})
        try:
            trackers.append(open_tracker(name, info, own))
        except Exception as err:  # a tracker that cannot start (its server, its store) stops nothing
            missing = isinstance(err, ModuleNotFoundError) and (err.name or "").split(".")[0] in exporter_modules(
                cfg.track, name
            )
            if missing:  # its own library: a missing extra, said as such
                raise
            say(f"the {name} exporter could not start ({one_line(err)}); training goes on without it")
    exporters = Exporters(room, trackers, state, first_step, say)
    exporters._save_state()  # the tracker run ids, before anything can crash
    return exporters


def hand_on_events(room: RunDir, cfg: Config, say: Callable[[str], None] = warn) -> None:
    """Give the trackers the events no worker gave them: the supervisor's, recorded after its last worker
    ended. Nothing is opened when there are none."""
    if not cfg.track.exporters or not room.events.is_file():
        return
    state = read_json(room.trackers, {})
    offset = state.get("events_offset", 0) if isinstance(state, dict) else 0
    if room.events.stat().st_size <= offset:
        return
    exporters = open_exporters(room, cfg, None, say)
    if exporters is not None:
        exporters.close()


def records_between(path: Path, start: int, end: int) -> list[dict[str, Any]]:
    """The records of the JSON-lines file `path` from byte `start` to byte `end`."""
    if end <= start:
        return []
    try:
        with path.open("rb") as handle:
            handle.seek(start)
            data = handle.read(end - start)
    except OSError:
        return []
    lines = data.decode("utf-8", errors="replace").splitlines()
    return [record for line in lines if (record := parse_line(line)) is not None]


def numbers(values: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a record (bools and strings are not metrics)."""
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__
