"""The incident timeline of a run, from its events.jsonl: failures, restarts, recoveries, checkpoint trouble."""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path

from liandan.checkpoint.verify import CheckpointError

SHOWN = ("incident", "restart", "recovered", "gave_up", "resumed", "checkpoint_failed", "checkpoint_rejected",
         "nonfinite_loss", "node_excluded", "node_refused", "preempted", "supervisor_end")  # fmt: skip


def read_events(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "events.jsonl"
    if not path.is_file():
        raise CheckpointError(f"no events.jsonl in {run_dir}: not a run directory")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def timeline(run_dir: Path) -> list[str]:
    events = read_events(run_dir)
    start = events[0]["time"] if events else 0.0
    lines = []
    for e in events:
        if e["kind"] not in SHOWN:
            continue
        when = datetime.fromtimestamp(e["time"], timezone.utc).strftime("%H:%M:%S")
        lines.append(f"{when} +{e['time'] - start:8.1f}s  {_describe(e)}")
    summary_path = Path(run_dir) / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        if "goodput" in s:
            lines.append(f"goodput {100 * s['goodput']:.1f}%: {s['kept_step_seconds']:.1f}s of kept steps in "
                         f"{s['supervisor_wall_seconds']:.1f}s, {s['restarts']} restart(s)"
                         + (f"; gave up: {s['gave_up']}" if s.get("gave_up") else ""))  # fmt: skip
    return lines


def _describe(e: dict) -> str:
    kind = e["kind"]
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
    if kind == "gave_up":
        return f"GAVE UP: {e['reason']}"
    if kind == "resumed" and e.get("source") == "memory":
        return f"resumed at step {e['step']} from the in-memory snapshot ({e['path']})"
    if kind == "resumed":
        return f"resumed at step {e['step']} from {Path(e['path']).name} (saved as {e.get('from_layout')})"
    if kind == "supervisor_end":
        return f"run ended: {e['restarts']} restart(s), goodput {100 * e['goodput']:.1f}%"
    detail = e.get("error") or e.get("loss") or ""
    return f"{kind.replace('_', ' ')} step {e.get('step', '?')}: {detail}"
