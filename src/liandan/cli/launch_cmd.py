"""`liandan launch CONFIG --nodes N --gpus-per-node G`: a Slurm script (printed, or submitted with --submit) or
one command per node, each starting that node's liandan supervisor (see `liandan.resilience.launch`)."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

from liandan.config import ConfigError, load_config


def add_commands(sub) -> None:
    p = sub.add_parser(
        "launch",
        description="Write what starts a run on several nodes with one liandan supervisor per node, which starts "
        "that node's ranks and restarts them after a crash or hang. Config overrides (--section.key=value) are "
        "passed on to every node.",
    )
    p.add_argument("config", help="run config (TOML)")
    p.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    p.add_argument("--gpus-per-node", type=int, required=True, help="ranks (devices) per node")
    p.add_argument("--min-nodes", type=int, default=None,
                   help="carry on with as few nodes as this after nodes are excluded (default: --nodes)")  # fmt: skip
    p.add_argument("--port", type=int, default=29400, help="rendezvous port on the first node (default 29400)")
    p.add_argument("--layout", choices=("config", "auto"), default="config",
                   help="auto: the fastest layout `liandan plan` predicts for nodes x gpus-per-node devices that the"
                        " trainer runs, applied as --parallel.* and --train.* overrides (default: the config's)")  # fmt: skip
    p.add_argument(
        "--device", default="h100", help="accelerator the planner plans for with --layout auto (default h100)"
    )
    p.add_argument("--max-cp", type=int, default=8,
                   help="with --layout auto, the largest context-parallel degree considered (default 8; 1: none)")  # fmt: skip
    how = p.add_mutually_exclusive_group()
    how.add_argument("--submit", action="store_true", help="write the Slurm script beside the run and sbatch it")
    how.add_argument("--hosts", default=None,
                     help="comma-separated hosts, one per node: print one shell command per node instead of a Slurm"
                          " script (the first host serves the rendezvous)")  # fmt: skip
    p.set_defaults(command=cmd_launch)


def cmd_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.resilience.launch import LaunchPlan
    from liandan.resilience.roles import check_launch
    from liandan.run import RunDir

    cfg = load_config(args.config, overrides)
    if args.layout == "auto":
        overrides = [
            *overrides,
            *planned_layout(cfg, args.config, overrides, args.nodes, args.gpus_per_node, args.device, args.max_cp),
        ]
        cfg = load_config(args.config, overrides)
    check_launch(cfg, args.nodes * args.gpus_per_node)  # the layout fits the world size, the data is there
    run_dir = cfg.run_dir(Path(args.config).stem)
    name = run_dir.name  # every node joins this one run directory
    plan = LaunchPlan(str(Path(args.config).resolve()), name, args.nodes, args.gpus_per_node,
                      tuple(o for o in overrides if not o.startswith("--run.name=")), args.port, args.min_nodes)  # fmt: skip
    if args.hosts is not None:
        print("\n".join(plan.node_commands([h.strip() for h in args.hosts.split(",") if h.strip()])))
        return 0
    room = RunDir.of(run_dir, cfg.checkpoint.dir)
    excluded = room.excluded_hostlist.read_text().strip() if room.excluded_hostlist.is_file() else ""
    script = plan.sbatch_script(str(Path(cfg.run.output_dir).resolve()), exclude=excluded)
    if not args.submit:
        print(script, end="")
        return 0
    path = Path(cfg.run.output_dir) / f"{name}.sbatch"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    if shutil.which("sbatch") is None:
        raise ConfigError(f"sbatch is not on PATH; the script is at {path}: submit it from a Slurm login node")
    done = subprocess.run(["sbatch", str(path)], check=False, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise ConfigError(f"sbatch {path} failed: {last}")
    print(done.stdout.strip() or f"submitted {path}", file=sys.stdout)
    return 0


def planned_layout(cfg, config: str, overrides: list[str], nodes: int, gpus_per_node: int, device: str,
                   max_cp: int = 8) -> list[str]:  # fmt: skip
    """The overrides of the fastest layout the planner ranks for nodes x gpus_per_node devices among those the
    trainer accepts (a layout it refuses, such as one it does not run yet, is passed over and said so)."""
    from liandan.common.layout import resolve_layout
    from liandan.plan.devices import resolve_device
    from liandan.plan.run_plan import plan_config
    from liandan.train.pipeline import pipeline_config_refusal

    nproc = nodes * gpus_per_node
    plan = plan_config(cfg, resolve_device(device), nproc=nproc, gpus_per_node=gpus_per_node, max_cp=max_cp)
    passed = []
    for ranked in plan.ranking:
        if not ranked.fits:
            break
        chosen = ranked.evaluated.candidate.overrides()
        try:
            candidate = load_config(config, [*overrides, *chosen])
            layout = resolve_layout(candidate.parallel, nproc)
        except ValueError as err:
            passed.append(f"{ranked.dims} ({err})")
            continue
        if layout.pp > 1 and (why := pipeline_config_refusal(candidate, layout)):
            passed.append(f"{ranked.dims} ({why})")
            continue
        for line in _first(passed):
            print(f"liandan: layout auto: passed over {line}", file=sys.stderr)
        e = ranked.evaluated
        print(f"liandan: layout auto: {e.candidate}, predicted step {e.time.total:.3g} s,"
              f" {e.worst.total / 2**30:.3g} GiB per device on {nproc} x {plan.device.name}", file=sys.stderr)  # fmt: skip
        return chosen
    why = f"; the fitting ones the trainer refuses: {'; '.join(_first(passed))}" if passed else ""
    raise ConfigError(f"no layout of {nproc} x {plan.device.name} fits this run{why}")


def _first(lines: list[str], shown: int = 5) -> list[str]:
    return lines[:shown] + ([f"{len(lines) - shown} more"] if len(lines) > shown else [])
