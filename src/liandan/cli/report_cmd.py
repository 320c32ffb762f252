"""`liandan report RUN...`: one self-contained HTML file of one or several runs, to share, and PNGs beside it."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_commands(sub) -> None:
    p = sub.add_parser("report")
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    p.add_argument(
        "-o", "--output", metavar="FILE.html", help="where to write it (default: RUN/report.html for one run, "
        "./report.html for several)"
    )  # fmt: skip
    p.set_defaults(command=cmd_report)


def cmd_report(args: argparse.Namespace, overrides: list[str]) -> int:
    written = make_report([Path(run) for run in args.runs], Path(args.output) if args.output else None)
    print(f"report: {written[0]}")
    for png in written[1:]:
        print(f"  {png}")
    return 0


def make_report(runs: list[Path], out: Path | None = None) -> list[Path]:
    """Write the report of `runs` with their incident timelines; returns the files written, the HTML first."""
    from liandan.resilience.incidents import timeline
    from liandan.run import RunDir
    from liandan.track.report import check_runs, default_output, write_report

    runs = check_runs(runs)
    # A run whose events.jsonl is not there yet (it has only started) has no incidents to tell.
    lines = [timeline(run, triaged=True) if RunDir(run).events.is_file() else [] for run in runs]
    return write_report(list(zip(runs, lines, strict=True)), out or default_output(runs))
