"""The hardware doctor: before a run (`liandan doctor`, and the preflight of every `liandan train`), every
rank checks its devices against float64 and against the other ranks, times its matrix products, memory and
disk, and tests the collectives among all ranks and in pairs; a rank out of line is named with its host.
`liandan doctor --bisect` narrows a suspect set of ranks down to the faulty one in halves, and `liandan doctor
--resume` checks that a resumed run is the run that never stopped (`resume.py`)."""

from liandan.doctor.runner import DoctorFailed, checkpoint_dir, run_doctor
from liandan.doctor.verdict import render

__all__ = ["DoctorFailed", "checkpoint_dir", "render", "run_doctor"]
