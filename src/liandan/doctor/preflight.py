"""The doctor as the preflight of `liandan train`: the "doctor" callback runs it on every rank once the
process group, the run directory and the model are up, before the first step of each launch (a restart
checks its machines again). It is a callback, not a call in the trainer, because the doctor sits above the
trainer in the layers and needs what only a set-up trainer has: the process group, the run directory and its
events log, and the model's exact parameter count for the sizes of checkpoints and snapshots.

A failure stops the run before it trains: the report goes to `doctor.json`, a "doctor" event to the events
log (`liandan incidents` shows it), and `DoctorFailed`, a `RunStopped`, ends every rank with exit code 2,
which the supervisor does not retry (the same machines would fail the same way).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from liandan.config import Config
from liandan.doctor.runner import DoctorFailed, event_fields, run_doctor
from liandan.doctor.verdict import finding_line
from liandan.run.remote import is_url
from liandan.train.callbacks import Callback

if TYPE_CHECKING:
    from liandan.train.context import TrainContext


class DoctorPreflight(Callback):
    order = 0  # before any other callback's on_train_start: nothing should happen on a machine that fails

    def on_train_start(self, ctx: TrainContext) -> None:
        where = ctx.room.checkpoints
        if is_url(where):  # a store: the disk measured is the run directory's (see `checkpoint_dir`)
            where = ctx.room.path
        params = ctx.module.params
        total = params.total if params else sum(p.numel() for part in ctx.module.model_parts for p in part.parameters())
        report = run_doctor(ctx.cfg, ctx.dist, where, ctx.step, total)
        if ctx.dist.is_main:
            ctx.room.write_doctor(report)
            ctx.files.log_event("doctor", step=ctx.step, **event_fields(report), report=str(ctx.room.doctor))
            for f in report["findings"]:
                ctx.say(finding_line(f))
            ctx.say(report["summary"])
        if not report["ok"]:
            raise DoctorFailed(f"{report['summary']}; the run stopped before step {ctx.step + 1}"
                               f" (report: {ctx.room.doctor}; skip with --doctor.preflight=false)")  # fmt: skip


def doctor_callback(cfg: Config) -> Callback | None:
    return DoctorPreflight() if cfg.doctor.preflight else None
