"""Incidents as marks on a run's curves: at which step, of which category (each drawn in its own colour and
named once in a legend), and a short label. training.png and `liandan report` draw the same marks; which
events are incidents at all is the run store's one classification (`is_incident`)."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from liandan.track.store import is_incident

# category: (legend name, colour), in the order the legend lists them
CATEGORIES = {
    "restart": ("failure / restart", "#d62728"),
    "rollback": ("rollback", "#9467bd"),
    "skipped": ("skipped update", "#ff7f0e"),
    "preempted": ("preemption", "#8c564b"),
    "sdc": ("SDC rollback", "#e377c2"),
    "other": ("other incident", "#7f7f7f"),
}
_FAILURES = ("incident", "restart", "gave_up", "node_excluded", "device_fault")


@dataclass(frozen=True)
class Mark:
    step: int
    category: str  # a key of CATEGORIES
    label: str  # one line: what happened there
    back_to: int | None = None  # a rollback's target step: the steps after it were trained again

    def to_dict(self) -> dict:
        return asdict(self)


def incident_marks(events: Iterable[dict], step_times: Iterable[tuple[float, int]] = ()) -> list[Mark]:
    """The marks of a run's incidents, by step. An event without a step (a supervisor's, say) is placed at the
    last step logged before it (`step_times`: (time, step) of the metrics records); one before any step, at
    step 0. Incidents of one category at one step make one mark, their labels joined."""
    times = sorted(step_times)
    found: dict[tuple[int, str], Mark] = {}
    for event in events:
        if not is_incident(event):
            continue
        step = event.get("step")
        if not isinstance(step, int):
            step = _step_at(times, event.get("time"))
        category = _category(event)
        mark = Mark(step, category, _label(event), _back_to(event))
        same = found.get((step, category))
        if same is not None:
            if mark.label in same.label.split("; "):
                continue
            mark = Mark(step, category, f"{same.label}; {mark.label}", same.back_to or mark.back_to)
        found[(step, category)] = mark
    return sorted(found.values(), key=lambda m: (m.step, list(CATEGORIES).index(m.category)))


def _step_at(times: list[tuple[float, int]], when: object) -> int:
    if not isinstance(when, (int, float)) or not times:
        return 0
    at = bisect_right(times, (float(when), float("inf")))
    return times[at - 1][1] if at else 0


def _category(e: dict) -> str:
    kind = e.get("kind")
    if kind in _FAILURES:
        return "restart"
    if kind == "rollback":
        return "rollback"
    if kind == "sdc":
        return "sdc"
    if kind == "preempted":
        return "preempted"
    if kind == "guard" and e.get("action") == "skip":
        return "skipped"
    return "other"


def _label(e: dict) -> str:
    kind = e.get("kind")
    if kind == "incident":
        return f"{e.get('failure', 'failure')} of rank {e.get('rank', '?')}: {e.get('cause', '')}".rstrip(": ")
    if kind == "restart":
        return f"restart {e.get('attempt', '')}".strip()
    if kind == "gave_up":
        return f"gave up: {e.get('reason', '')}"
    if kind == "rollback":
        return f"rollback to step {e.get('to')} ({', '.join(e.get('detectors', ())) or 'guard'})"
    if kind == "sdc":
        back = f", back to step {e['to']}" if e.get("to") is not None else ""
        return f"silent data corruption{back}"
    if kind == "preempted":
        return f"preempted by {e.get('signal', 'a signal')}"
    if kind == "guard":
        what = {"skip": "update skipped", "warn": "guard warning", "stop": "guard stopped the run"}
        return f"{what.get(e.get('action'), 'guard')}: {e.get('detail', '')}".rstrip(": ")
    if kind == "doctor":
        return "doctor: " + str(e.get("summary", "")).removeprefix("doctor: ")
    detail = e.get("reason") or e.get("error") or e.get("detail") or ""
    detail = str(detail).strip().splitlines()[-1] if str(detail).strip() else ""
    return f"{str(kind).replace('_', ' ')}: {detail}".rstrip(": ")


def _back_to(e: dict) -> int | None:
    if e.get("kind") in ("rollback", "sdc") and isinstance(e.get("to"), int):
        return e["to"]
    return None
