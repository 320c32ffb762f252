"""The incident timeline of a run, from its events.jsonl: failures, restarts, recoveries, checkpoint trouble,
what the loss-spike guard did (rollbacks, skipped updates, warnings), what the preflight doctor found, silent
data corruption found and the stragglers named by the training health checks."""

from __future__ import annotations

import math
from datetime import datetime, timezone
from pathlib import Path

from liandan.checkpoint.verify import CheckpointError, step_of
from liandan.run import RunDir
from liandan.track.triage import triage

SHOWN = ("incident", "restart", "recovered", "gave_up", "resumed", "checkpoint_failed", "checkpoint_rejected",
         "train_stopped", "stale_saves_removed", "nonfinite_loss", "node_excluded", "node_refused", "preempted",
         "preemption_plan", "supervisor_end", "guard", "rollback", "too_good", "doctor", "doctor_bisect", "sdc",
         "straggler", "device_fault")  # fmt: skip


def read_events(run_dir: Path) -> list[dict]:
    """The run's events; a line a crash (or a full disk) left half-written is skipped."""
    room = RunDir(Path(run_dir))
    if not room.events.is_file():
        raise CheckpointError(f"no {room.events.name} in {run_dir}: not a run directory")
    return room.read_events()


def timeline(run_dir: Path, triaged: bool = False) -> list[str]:
    """One line per incident of the run; with `triaged`, each fault is followed by an indented line that
    classifies it as data, hardware, code or unknown, with its evidence and a next step
    (`liandan.track.triage`). A record missing a field, or with a time that is no number (a hand-edited or
    foreign file), is still listed, as far as it says anything, as the dashboard lists it."""
    events = [e for e in read_events(run_dir) if isinstance(e, dict)]
    start = next((t for e in events if (t := _seconds(e.get("time"))) is not None), 0.0)
    # The guard logs its verdict first; a rollback's or a loss drop's own record then says more about it.
    told = {(e.get("step"), "rollback" if e["kind"] == "rollback" else "drop") for e in events
            if e.get("kind") in ("rollback", "too_good")}  # fmt: skip
    drops = {
        e.get("step"): e.get("detail", "")
        for e in events
        if e.get("kind") == "guard" and "drop" in (e.get("detectors") or ())
    }
    lines = []
    for e in events:
        if e.get("kind") not in SHOWN or e["kind"] == "guard" and _told_elsewhere(e, told):
            continue
        if e["kind"] == "doctor" and e.get("ok") and not e.get("warnings"):  # a clean preflight is no incident
            continue
        if e["kind"] == "too_good":
            e = {**e, "detail": drops.get(e.get("step"), "")}
        seconds = _seconds(e.get("time"))
        if seconds is None:
            when = "??:??:??  (no time)"
        else:
            when = f"{datetime.fromtimestamp(seconds, timezone.utc).strftime('%H:%M:%S')} +{seconds - start:8.1f}s"
        lines.append(f"{when}  {_describe_safely(e)}")
        found = triage(e) if triaged else None
        if found is not None:
            lines.append(f"{' ' * len(when)}  -> {found.line()}")
    s = RunDir(Path(run_dir)).read_summary()
    if "goodput" in s:
        try:
            launches = s.get("supervisor_launches", 1)
            over = f" over {launches} launches" if launches > 1 else ""
            lines.append(f"goodput {100 * s['goodput']:.1f}%: {s['kept_step_seconds']:.1f}s of kept steps in "
                         f"{s['supervisor_wall_seconds']:.1f}s{over}, {s['restarts']} restart(s)"
                         + (f"; gave up: {s['gave_up']}" if s.get("gave_up") else ""))  # fmt: skip
        except (KeyError, TypeError, ValueError):
            lines.append(f"goodput {s['goodput']!r} (the summary's other figures are missing or not numbers)")
    return lines


def _seconds(value: object) -> float | None:
    """An event's time as seconds since the epoch; None for one that is no finite number."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and abs(seconds) < 1e11 else None


def _describe_safely(e: dict) -> str:
    try:
        return _describe(e)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as err:
        missing = f"no {err.args[0]!r}" if isinstance(err, KeyError) else str(err).splitlines()[0]
        return f"{str(e['kind']).replace('_', ' ')} step {e.get('step', '?')}: (an incomplete record: {missing})"


def _told_elsewhere(e: dict, told: set[tuple[int, str]]) -> bool:
    if e.get("action") == "rollback":
        return (e.get("step"), "rollback") in told
    return e.get("action") == "warn" and e.get("detectors") == ["drop"] and (e.get("step"), "drop") in told


def _describe(e: dict) -> str:
    kind = e["kind"]
    if kind in ("guard", "rollback", "too_good"):
        return _describe_guard(e)
    if kind == "doctor_bisect":
        return f"{'doctor bisection' if e.get('ok') else 'DOCTOR BISECTION'}: {e['summary'].removeprefix('doctor: ')}"
    if kind == "doctor":
        before = "(liandan doctor)" if e.get("standalone") else f"before step {e.get('step', 0) + 1}"
        said = e["summary"].removeprefix("doctor: ")
        if not e.get("ok"):
            return f"DOCTOR STOPPED the run {before}: {said}"
        return f"doctor warning {before}: {said}"
    if kind in ("sdc", "straggler", "device_fault"):
        return _describe_health(e)
    if kind == "incident":
        seen = f" (seen by {e['reported_by']})" if e.get("reported_by") not in (None, e["host"]) else ""
        return (
            f"{e['failure'].upper():5s} step {e['step']} rank {e['rank']} on {e['host']}{seen}: {e['cause']}; "
            f"lost {e['steps_lost']} step(s), {e['seconds_lost']:.1f}s; resumes from step {e['resume_step']}"
        )
    if kind == "restart":
        return f"restart {e['attempt']}" + (
            f" after {e['after_seconds']:.1f}s backoff" if e["after_seconds"] else " at once"
        )
    if kind == "node_excluded" and e.get("reason"):
        return f"NODE EXCLUDED: {e['node']}: {e['reason']}"
    if kind == "node_excluded":
        return f"NODE EXCLUDED: {e['node']} after {e['failures']} failures attributed to it"
    if kind == "node_refused":
        return f"node {e['node']} refused to join: excluded ({e.get('reason')})"
    if kind == "recovered":
        return f"recovered: step {e['step']} done {e['seconds']:.1f}s after the failure"
    if kind == "preempted":
        at = f" at step {e['step']}" if e.get("step") is not None else ""
        if "outcome" in e:  # the supervisor's record
            return f"PREEMPTED by {e['signal']}{at}: {e['outcome']}; resumes from step {e['resume_step']}"
        saved = f"checkpoint {Path(e['checkpoint']).name} saved" if e.get("checkpoint") else "no checkpoint saved"
        return f"PREEMPTED by {e['signal']}{at}: {saved}"
    if kind == "preemption_plan":
        what = (f"abandon step {e['step']}, save step {e['fallback_step']}" if e["plan"] == "fall back"
                else f"finish step {e['step']} and save it")  # fmt: skip
        fits = "" if e["fits"] else " although nothing fits"
        return (f"preemption plan by {e['signal']}: {what}{fits} (finishing {e['finish_s']:.1f}s, grace left"
                f" {e['grace_left_s']:.1f}s)")  # fmt: skip
    if kind == "gave_up":
        return f"GAVE UP: {e['reason']}"
    if kind == "resumed" and e.get("source") == "memory":
        return f"resumed at step {e['step']} from the in-memory snapshot ({e['path']})"
    if kind == "resumed":
        return f"resumed at step {e['step']} from {Path(e['path']).name} (saved as {e.get('from_layout')})"
    if kind == "supervisor_end":
        return f"run ended: {e['restarts']} restart(s), goodput {100 * e['goodput']:.1f}%"
    if kind == "checkpoint_rejected":  # events before the step was recorded name it only in the path
        step = e.get("step")
        if step is None and e.get("path"):
            step = step_of(Path(e["path"]))
        return f"checkpoint rejected step {'?' if step is None else step}: {e.get('error', '')}"
    if kind == "stale_saves_removed":
        names = ", ".join(Path(p).name for p in e["paths"])
        return f"removed half-done checkpoint saves of an earlier process: {names}"
    # One line per event: an error's traceback stays in the record, its last line says what happened.
    detail = [line for line in str(e.get("error") or e.get("loss") or "").splitlines() if line.strip()]
    return f"{kind.replace('_', ' ')} step {e.get('step', '?')}: {detail[-1].strip() if detail else ''}"


def _describe_guard(e: dict) -> str:
    kind = e["kind"]
    if kind == "rollback":
        first, end = e["skipped"]
        skipped = f"skipped data steps {first}..{end - 1}" if end > first else "skipped no data"
        lr = ""
        if e.get("lr_scale", 1.0) != 1.0:
            until = f" until step {e['lr_until']}" if e.get("lr_until") is not None else ""
            lr = f"; learning rate now x{e['lr_scale']:g} of its schedule{until}"
        source = e.get("from", "memory")
        where = "" if source == "memory" else f" (checkpoint {Path(source).name})"
        return (f"ROLLBACK at step {e['step']}: {', '.join(e['detectors'])} from step {e['began']}; back to step"
                f" {e['to']}{where}, {skipped}, {e['steps_redone']} step(s) redone{lr}; {_verdict(e)};"
                f" report {_report_name(e['report'])}")  # fmt: skip
    if kind == "too_good":
        tokens = ", ".join(repr(t) for t in e.get("tokens", [])) or "none near zero loss"
        seen = f": {e['detail']}" if e.get("detail") else ""
        return (
            f"TOO GOOD TO BE TRUE? step {e['step']}{seen}; easiest tokens {tokens}; report {_report_name(e['report'])}"
        )
    what = {"skip": "update skipped", "warn": "guard warning", "stop": "GUARD STOPPED the run",
            "rollback": "rollback begun"}.get(e["action"], e["action"])  # fmt: skip
    return f"{what} at step {e['step']}: {e['detail']}"


def _describe_health(e: dict) -> str:
    kind = e["kind"]
    if kind == "straggler":
        return (f"STRAGGLER rank {e['rank']} on {e['host']} at step {e['step']}: {e['phase']} takes"
                f" {1000 * e['seconds']:.1f} ms per step, the others' median {1000 * e['median_seconds']:.1f} ms,"
                f" in {e['windows']} windows of {e['window_steps']} steps in a row")  # fmt: skip
    if kind == "device_fault":
        marked = "excluded" if e.get("excluded") else "recorded as a suspect"
        return f"DEVICE FAULT: node {e['node']} {marked}: {e.get('reason', '')}"
    named = ", ".join(f"rank {r} on {h}" for r, h in zip(e["ranks"], e["hosts"], strict=True))
    named = named or e.get("ambiguous") or "no rank named"
    back = f"rolled back to step {e['to']}" if e.get("to") is not None else "nothing in memory to roll back to"
    stopped = "; the device failed its golden test: run stopped" if e.get("persistent") else ""
    return f"SILENT DATA CORRUPTION at step {e['step']}: {named} ({', '.join(e['checks'])}): {e['detail']}; {back}{stopped}"


def _verdict(e: dict) -> str:
    """The rollback's diagnosis in a few words: the report has the whole of it."""
    culprits = e.get("culprit_data_steps") or []
    if culprits:
        said = f"bad data: data step(s) {', '.join(str(s) for s in culprits)} ({e.get('documents', 0)} document(s))"
    else:
        said = "no culprit batch"
    if e.get("reproduced") is not None:
        said += ", reproduced on replay" if e["reproduced"] else ", did not come back on replay"
    if e.get("layers_first"):
        first = e["layers_first"][0]
        said += f", moved first: {first['layer']} {first['statistic']}"
    return said


def _report_name(path: str) -> str:
    """A report's path within its run directory: the timeline is read with the run directory at hand."""
    path = Path(path)
    return f"{path.parent.name}/{path.name}"


def goodput(run_dir: Path, current: tuple[float, float], current_id: str) -> tuple[float, float, int]:
    """(kept step seconds, wall seconds, launches) over every supervisor launch of the run, the `current` one
    (start, now) included: a resumed run's kept steps were trained by earlier launches too, so they count
    against those launches' wall time as well, and the ratio never exceeds 1. Earlier launches come from
    their supervisor_start events; one that ended without a supervisor_end (killed) ends at its last record.
    Launches that overlap (one supervisor per node) are one period of wall time."""
    events = _read_events_tolerantly(run_dir)
    records = RunDir(Path(run_dir)).read_metrics()
    starts = sorted((e["time"], e.get("supervisor")) for e in events if e.get("kind") == "supervisor_start"
                    and e.get("supervisor") != current_id and e["time"] < current[0])  # fmt: skip
    ends = {e.get("supervisor"): e["time"] for e in events if e.get("kind") == "supervisor_end"}
    seen = sorted([e["time"] for e in events] + [r["time"] for r in records if "time" in r])
    intervals = [current]
    for (start, launch), next_start in zip(starts, [t for t, _ in starts[1:]] + [current[0]]):
        end = ends.get(launch)
        if end is None:
            end = max((t for t in seen if start <= t < next_start), default=start)
        intervals.append((start, end))
    periods: list[list[float]] = []
    for start, end in sorted(intervals):
        if periods and start <= periods[-1][1]:
            periods[-1][1] = max(periods[-1][1], end)
        else:
            periods.append([start, end])
    wall = sum(end - start for start, end in periods)
    kept = sum(r.get("step_time_s", 0.0) for r in records
               if any(start <= r.get("time", -1.0) <= end for start, end in periods))  # fmt: skip
    return kept, wall, len(periods)


def _read_events_tolerantly(run_dir: Path) -> list[dict]:
    """events.jsonl without the line a crash (or a full disk) may have left half-written, nor one whose time
    is no number."""
    return [event for event in RunDir(Path(run_dir)).read_events() if _seconds(event.get("time")) is not None]
