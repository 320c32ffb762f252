"""`liandan doctor --resume CONFIG`: the resume oracle's options and its report (`liandan.doctor.resume`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_resume_option(parser: argparse.ArgumentParser) -> None:
    """The resume oracle's options on the `doctor` command."""
    from liandan.doctor.resume import DEFAULT_STEPS

    group = parser.add_argument_group("resume oracle")
    group.add_argument(
        "--resume",
        metavar="CONFIG",
        help="train CONFIG a few steps, resume it from a checkpoint (also in other layouts) and compare the"
        " losses and weights with the run that never stopped; config overrides follow as --section.key=value",
    )
    group.add_argument(
        "--layouts",
        metavar="L1,L2,...",
        help="comma-separated layouts to train and resume in: 1, ddpN, fsdpN, tpN, epN, ppN, cpN, or combinations"
        " such as fsdp2+tp2 (default: 1 and every 2-process layout the config trains in)",
    )
    group.add_argument(
        "--resume-steps",
        type=int,
        default=DEFAULT_STEPS,
        metavar="S",
        help=f"steps of each run (default {DEFAULT_STEPS})",
    )
    group.add_argument(
        "--resume-at", type=int, metavar="K", help="the step checkpointed and resumed from (default: half way)"
    )
    group.add_argument(
        "--save-in",
        default="each",
        metavar="each|first",
        help="each: every layout saves a checkpoint that it and the next layout resume (3 runs a layout);"
        " first: only the first layout saves one, which every layout resumes (one run a layout, and one)",
    )
    group.add_argument(
        "--resume-dir", metavar="DIR", help="keep the runs here (a new or empty directory; default: a temporary one)"
    )
    # --json, the report file, is an option of every mode of `doctor` (cli/doctor_cmd.py)


def cmd_resume(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.doctor.resume import OracleError, ResumeOracle, parse_layouts, write_report

    layouts = parse_layouts(args.layouts) if args.layouts is not None else None
    workdir = Path(args.resume_dir) if args.resume_dir else None
    oracle = ResumeOracle(args.resume, overrides, layouts, args.resume_steps, args.resume_at, workdir, args.save_in)
    try:
        report = oracle.run()
    except OracleError as err:
        print(f"liandan: error: {err}", file=sys.stderr)
        return err.exit_code
    print("\n".join(report.table()))
    if report.workdir:
        print(f"runs kept in {report.workdir}")
    if getattr(args, "json", None):
        write_report(report, Path(args.json))
    if report.passed:
        print(report.summary())
        return 0
    print(f"liandan doctor: {report.summary()}", file=sys.stderr)
    return 1
