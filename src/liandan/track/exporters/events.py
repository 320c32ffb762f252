"""What the trackers are given of one record of events.jsonl: a line of text, the marker of an incident, the
numbers it carries (a validation loss, a forecast)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# The events that are incidents: each gets a marker (a scalar of 1 at its step) besides its text. A guard
# event's marker names its action (guard_skip: a skipped update; guard_rollback, guard_warn, guard_stop).
INCIDENTS = frozenset({
    "incident", "restart", "recovered", "gave_up", "resumed", "checkpoint_failed", "checkpoint_rejected",
    "train_stopped", "stale_saves_removed", "nonfinite_loss", "node_excluded", "node_refused", "preempted",
    "guard", "rollback", "too_good", "sdc", "straggler", "device_fault", "doctor",
})  # fmt: skip
# Incidents someone should hear of at once: a W&B alert (which an online run sends on).
SEVERE = frozenset({"incident", "gave_up", "device_fault", "sdc", "train_stopped", "preempted", "node_excluded"})
# How the run stands after an event: what a tracker's run is closed as.
OUTCOMES = {"train_start": None, "resumed": None, "train_end": "finished", "train_stopped": "failed",
            "gave_up": "failed", "device_fault": "failed", "preempted": "killed"}  # fmt: skip
LEAD_FIELDS = ("summary", "detail", "reason", "error", "cause")
LEFT_OUT = frozenset({"time", "kind", "step", "evidence", "supervisor"})
MAX_TEXT = 2000


@dataclass(frozen=True)
class TrackedEvent:
    kind: str
    step: int  # the event's step, or the newest step the trackers have when it names none
    time: float
    text: str
    marker: str | None  # the incident's marker, None for an event that is no incident
    severe: bool = False
    values: dict[str, float] = field(default_factory=dict)  # metrics it carries, by name


def tracked_event(record: dict[str, Any], current_step: int) -> TrackedEvent | None:
    kind = record.get("kind")
    if not isinstance(kind, str):
        return None
    step = record.get("step")
    step = step if isinstance(step, int) and not isinstance(step, bool) else current_step
    when = record.get("time")
    when = float(when) if isinstance(when, (int, float)) else 0.0
    return TrackedEvent(kind, step, when, describe(record), marker_of(record), kind in SEVERE, values_of(record))


def marker_of(record: dict[str, Any]) -> str | None:
    kind = record["kind"]
    if kind not in INCIDENTS:
        return None
    if kind == "doctor" and record.get("ok") and not record.get("warnings"):  # a clean preflight
        return None
    if kind == "guard":
        return f"guard_{record.get('action') or 'warn'}"
    return kind


def values_of(record: dict[str, Any]) -> dict[str, float]:
    kind = record["kind"]
    if kind == "eval":
        names = {"loss": "val_loss"}
    elif kind == "forecast":
        names = {"final_loss": "forecast/final_loss", "low": "forecast/low", "high": "forecast/high"}
    else:
        return {}
    return {name: float(record[key]) for key, name in names.items() if _number(record.get(key))}


def outcome_of(event: TrackedEvent, before: str | None) -> str | None:
    return OUTCOMES.get(event.kind, before)


def describe(record: dict[str, Any]) -> str:
    """One line: the kind and step, what the event says of itself, then its other plain fields."""
    kind, step = record["kind"], record.get("step")
    lead_key = next((k for k in LEAD_FIELDS if isinstance(record.get(k), str) and record[k]), None)
    head = kind + (f" at step {step}" if step is not None else "")
    if lead_key:
        head += f": {record[lead_key]}"
    rest = [f"{k}={_short(v)}" for k, v in record.items()
            if k not in LEFT_OUT and k != lead_key and (_plain(v) or _plain_list(v))]  # fmt: skip
    text = head + (f" ({', '.join(rest)})" if rest else "")
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _plain_list(value: Any) -> bool:
    return isinstance(value, list) and len(value) <= 8 and all(_plain(v) for v in value)


def _short(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= 200 else text[:197] + "..."
