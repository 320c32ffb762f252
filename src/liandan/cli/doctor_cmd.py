"""`liandan doctor`: check the machines of a run before it trains (every rank's devices against float64 and
against each other, throughput, memory and disk, collectives among all ranks and in pairs, the environment),
or bisect a set of suspect ranks down to the faulty one. It runs as one process, as `--nproc N` local
processes (launched as `liandan train --nproc N` launches its workers), or as each process of a launch by
torchrun or srun.

Its options are all in `doctor_options`; each mode (the checks, `--bisect`) is one branch of `cmd_doctor`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from liandan.cli import doctor_resume_cmd
from liandan.config import ConfigError, load_config
from liandan.run.files import atomic_write_json, check_output

HIDDEN = argparse.SUPPRESS


def add_commands(sub) -> None:
    p = sub.add_parser("doctor")
    doctor_options(p)
    p.set_defaults(command=cmd_doctor)


def doctor_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", nargs="?", help="run config (TOML) whose [doctor], [checkpoint] and [model] apply;"
                   " omit for the defaults")  # fmt: skip
    p.add_argument("--nproc", type=int, default=1, help="local processes to check (one per device)")
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON to PATH")
    p.add_argument("--bisect", metavar="RANKS_OR_HOSTS", help="comma-separated suspect ranks or host names: halve"
                   " them until the faulty rank is found (log2(n) rounds of golden matrix products)")  # fmt: skip
    # A worker launched by `--nproc` leaves its report here for the launcher, which prints it.
    p.add_argument("--report-to", help=HIDDEN)
    doctor_resume_cmd.add_resume_option(p)


def cmd_doctor(args: argparse.Namespace, overrides: list[str]) -> int:
    # The modes: the checks (default), --bisect and --resume. Another mode adds its option in doctor_options
    # and its branch here, before the checks' own set-up.
    if args.resume is not None:
        if args.config is not None:
            raise ConfigError(f"liandan doctor --resume CONFIG takes one config; '{args.config}' is one too many")
        return doctor_resume_cmd.cmd_resume(args, overrides)
    cfg = load_config(args.config, overrides)
    from liandan.common.layout import local_nproc_refusal

    refusal = local_nproc_refusal(args.nproc)
    if refusal:
        raise ConfigError(refusal)
    if args.json:
        check_output(args.json)
    from liandan.doctor.bisect import parse_suspects

    suspects = parse_suspects(args.bisect) if args.bisect is not None else None
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args, cfg, overrides, suspects)
    report = _run_here(cfg, suspects)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0 if args.report_to or report["ok"] else 1
    if args.report_to:
        atomic_write_json(Path(args.report_to), report)
        return 0
    return _tell(report, args.json, cfg)


def _run_here(cfg, suspects: list[str] | None) -> dict:
    """This process's part: one rank alone, or one of a process group started by a launcher."""
    from liandan.doctor import checkpoint_dir, run_doctor
    from liandan.doctor.bisect import bisect
    from liandan.doctor.probe import Settings
    from liandan.train.distributed import init_distributed, shutdown_distributed

    info = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.resilience.collective_timeout_s)
    try:
        if suspects is not None:  # its rounds are printed from the report, by rank 0 or the launcher
            report = bisect(Settings.of(cfg.doctor, info.device), info, suspects)
            return {"mode": "bisect", **report}
        return {"mode": "check", **run_doctor(cfg, info, checkpoint_dir(cfg))}
    finally:
        shutdown_distributed()


def _launch(args: argparse.Namespace, cfg, overrides: list[str], suspects: list[str] | None) -> int:
    """`nproc` local workers under torchrun; rank 0 hands the report back through a file."""
    from liandan.resilience.roles import report_error
    from liandan.train.distributed import launch_local

    for item in suspects or []:  # what can be told before anything starts
        if item.isdigit() and int(item) >= args.nproc:
            raise ConfigError(f"--bisect: rank {item} is not among the {args.nproc} rank(s) of --nproc {args.nproc}")
    with tempfile.TemporaryDirectory(prefix="liandan-doctor-") as scratch:
        path = Path(scratch) / "report.json"
        worker = ["doctor", *([args.config] if args.config else []), f"--report-to={path}", *overrides]
        if args.bisect is not None:
            worker.append(f"--bisect={args.bisect}")
        code, message = launch_local(args.nproc, "liandan.cli", worker)
        if message:
            report_error(message)
            return 2 if code == 2 else 1
        return _tell(json.loads(path.read_text()), args.json, cfg)


def _tell(report: dict, json_path: str | None, cfg) -> int:
    """Print the table (or the bisection's rounds), write the JSON (and into the run directory `run.name`
    names, if there is one), and say the verdict: exit 1 when a rank is out of line."""
    from liandan.doctor import render
    from liandan.doctor.bisect import render as render_bisection
    from liandan.doctor.runner import record_in_run

    if json_path:
        atomic_write_json(Path(json_path), report)
    recorded = record_in_run(cfg, report)
    if recorded is not None:
        print(f"report and event recorded in the run directory: {recorded}")
    lines = render_bisection(report) if report["mode"] == "bisect" else render(report)
    print("\n".join(lines[:-1]))
    if report["ok"]:
        print(report["summary"])
        return 0
    print(f"liandan: {report['summary']}", file=sys.stderr)
    return 1
