"""One run of the doctor on every rank of a process group: probe, gather, judge. Every rank gets the same
report, so every rank can stop (or go on) on its own, and rank 0 writes and prints it."""

from __future__ import annotations

import time
from pathlib import Path

from liandan.config import Config
from liandan.doctor import probe, verdict
from liandan.run import RunDir, append_jsonl, atomic_write_json
from liandan.run.errors import RunStopped
from liandan.run.remote import is_url
from liandan.train.distributed import DistInfo


class DoctorFailed(RunStopped):
    """The doctor found a rank out of line: not a bug, and nothing a restart on the same machines fixes."""


def checkpoint_dir(cfg: Config) -> Path:
    """Where a run of this config saves checkpoints, before there is a run directory: `checkpoint.dir`, or
    the directory the run directories go into (the same file system as `<run>/checkpoints`). Checkpoints in
    a store (`s3://...`) are not on a local disk to measure: then the run directories' disk is measured."""
    return Path(cfg.checkpoint.dir if cfg.checkpoint.dir and not is_url(cfg.checkpoint.dir) else cfg.run.output_dir)


def run_doctor(cfg: Config, info: DistInfo, checkpoints: Path, step: int = 0, parameters: int | None = None) -> dict:
    """Probe every rank, then judge: the report (see `verdict.judge`). Every rank of the group must call it.
    `step`: the training step it runs at (for injected device faults); `parameters`: the model's count, for
    the sizes of checkpoints and memory snapshots (None: planned from the config)."""
    if parameters is None:
        from liandan.doctor.environment import planned_parameters

        parameters = planned_parameters(cfg)
    settings = probe.Settings.of(cfg.doctor, info.device)
    records, seconds = probe.probe(settings, info, step, checkpoints, cfg.checkpoint.memory_dir)
    return verdict.judge(cfg, records, parameters, seconds, step)


def event_fields(report: dict) -> dict:
    """What a "doctor" (or "doctor_bisect") event records of a report; the report file has the rest."""
    if report.get("mode") == "bisect":
        return {"ok": report["ok"], "summary": report["summary"], "found": report["found"], "host": report["host"],
                "rounds": len(report["rounds"])}  # fmt: skip
    findings = report["findings"]
    return {"ok": report["ok"], "summary": report["summary"], "seconds": report["seconds"],
            "failures": [f for f in findings if f["level"] == "fail"],
            "warnings": [f for f in findings if f["level"] == "warn"]}  # fmt: skip


def record_in_run(cfg: Config, report: dict) -> Path | None:
    """`liandan doctor` with a `run.name` whose run directory exists: its report goes there too (doctor.json,
    or doctor-bisect.json) with an event in the run's events log, beside the run's own incidents. Returns the
    report's path there (None: no such run directory)."""
    if not cfg.run.name:
        return None
    room = RunDir.of(cfg.run_dir(""), cfg.checkpoint.dir)  # run.name is set: the config's name is not used
    if not room.exists():
        return None
    bisection = report.get("mode") == "bisect"
    path = room.doctor_bisection if bisection else room.doctor
    atomic_write_json(path, report)
    kind = "doctor_bisect" if bisection else "doctor"
    append_jsonl(room.events, {"time": time.time(), "kind": kind, "standalone": True, **event_fields(report),
                               "report": str(path)})  # fmt: skip
    return path
