"""`liandan train` as a function: which part this process plays in a run, and playing it.

A process that trains plays one of three roles, decided from its config, `--nproc` and who started it
(`launch.how_started`):

- supervise: started by a person or a script (`resilience.supervise`, the default): the supervisor starts
  `nproc` workers, each `python -m liandan.cli train` with the same config, and restarts them after crashes
  and hangs (`supervisor.py`);
- launch: unsupervised, `nproc` > 1: torchrun's ranks, started here with one agreed run name;
- train: this process is a rank (a worker of the supervisor, of torchrun or of srun) or the only process:
  it trains.

`run_training` is what `liandan train` runs; from Python it starts the same supervised, multi-process run:

    from liandan.resilience.roles import run_training
    exit_code = run_training("configs/tiny.toml", nproc=2, overrides=["--train.steps=100"])
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Literal

from liandan.common.layout import batch_split_refusal, local_nproc_refusal, resolve_layout
from liandan.config import Config, ConfigError, load_config
from liandan.resilience.launch import Start, how_started
from liandan.run.errors import DEVICE_FAULT_EXIT, RunStopped
from liandan.run.worker_env import CRASHED, NNODES, WorkerEnv

Role = Literal["supervise", "launch", "train"]
ERROR_PREFIX = "liandan: error: "


def user_errors() -> tuple[type[BaseException], ...]:
    """The errors that are the user's, not bugs (a bad config, a missing file or checkpoint, an unknown or
    uninstallable plug-in, a run that stopped by its own rules): one line, no traceback. None of their modules
    imports torch."""
    from liandan.checkpoint.verify import CheckpointError
    from liandan.data.documents.corpus import DataError
    from liandan.plugins import PluginError

    return (ConfigError, DataError, CheckpointError, PluginError, RunStopped)


def choose_role(cfg: Config, nproc: int, start: Start) -> Role:
    """The part of a process that `start` describes: only one started by a person or a script supervises or
    launches; the ranks of a launcher train."""
    if start.how != "here":
        return "train"
    if cfg.resilience.supervise:
        return "supervise"
    return "launch" if nproc > 1 else "train"


def run_training(
    config: str | Path,
    nproc: int = 1,
    overrides: Sequence[str] = (),
    *,
    prepare: Callable[[Config, Start], None] | None = None,
) -> int:
    """Train from the run config file `config` with `--section.key=value` `overrides`, on `nproc` local
    processes, in whichever role this process has (see the module); returns the process's exit code, as
    `liandan train CONFIG --nproc=N OVERRIDES` exits. Workers re-read `config` and `overrides`.

    `prepare(cfg, start)` runs in every process that trains once it knows who started it, before any
    worker starts: the place to check what the workers would fail on. Every trainer attaches liandan's own
    callbacks (plug-ins) itself; `[train] callbacks` modules are imported here by default, and `liandan train`
    also checks the evaluation task files (`liandan.cli.main.prepare_training`)."""
    overrides = list(overrides)
    cfg = load_config(config, overrides)
    name = Path(config).stem
    from liandan.model.spec import check_model_config

    check_model_config(cfg)  # the family and its tensor-parallel split, before anything starts
    from liandan.track.exporters import check_exporters

    check_exporters(cfg.track)  # a tracker's library that is missing: the extra to install
    source = cfg.checkpoint.init_from
    if source and "://" not in source and not Path(source).exists():  # before any data is tokenized
        raise ConfigError(f"checkpoint.init_from = {source}: no such file or directory")
    refusal = local_nproc_refusal(nproc)
    if refusal:
        raise ConfigError(refusal)
    if not os.environ.get("WORLD_SIZE") and not os.environ.get(NNODES):  # all ranks here: known now
        try:
            layout = resolve_layout(cfg.parallel, nproc)
        except ValueError as err:  # an impossible layout: the same line the workers would give
            raise ConfigError(str(err)) from None
        refusal = batch_split_refusal(cfg.train.global_batch, cfg.train.micro_batch, layout.dp_size)
        if refusal is None and layout.pp > 1:
            from liandan.train.pipeline import pipeline_config_refusal

            refusal = pipeline_config_refusal(cfg, layout)
        if refusal:  # before any worker starts or any data is tokenized
            raise ConfigError(refusal)
    # torchrun or srun started one process per rank, or the supervisor started this worker; with $LIANDAN_NNODES
    # srun starts one supervisor per node instead
    start = how_started(nproc, os.environ)
    if start.note and os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0":
        print(start.note, file=sys.stderr)
    (prepare or _import_config_callbacks)(cfg, start)
    role = choose_role(cfg, nproc, start)
    if role == "supervise":
        return supervise(os.fspath(config), cfg, name, nproc, overrides)
    if role == "launch":
        return launch(os.fspath(config), cfg, name, nproc, overrides)
    return train_here(cfg, name, supervised=start.how == "worker")


def _import_config_callbacks(cfg: Config, start: Start) -> None:
    from liandan.train.callbacks import import_callback_modules

    import_callback_modules(cfg.train.callbacks)


def supervise(config: str, cfg: Config, name: str, nproc: int, overrides: list[str]) -> int:
    """Run the workers under the supervisor, which restarts them after crashes and hangs."""
    from liandan.resilience.supervisor import Supervisor

    check_launch(cfg, nproc)
    run_dir = cfg.run_dir(name)
    worker = [
        sys.executable,
        "-m",
        "liandan.cli",
        "train",
        config,
        f"--nproc={nproc}",
        *overrides,
        f"--run.name={run_dir.name}",
    ]
    run_dir.mkdir(parents=True, exist_ok=True)
    return Supervisor(cfg, worker, run_dir, nproc=nproc).run()


def check_launch(cfg: Config, nproc: int) -> None:
    """What a launcher checks before it starts `nproc` ranks: the layout fits them, the data is there."""
    try:
        resolve_layout(cfg.parallel, nproc)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    from liandan.data.documents.corpus import DataError
    from liandan.data.documents.storage import is_file
    from liandan.run.remote import is_url, locate

    for path in cfg.data.paths:
        # a URL's object too, so a missing one stops the launch, not the workers; a directory is its data files
        if not is_file(locate(path)) and not (not is_url(path) and Path(path).is_dir()):
            raise DataError(f"data file not found: {path}")


def launch(config: str, cfg: Config, name: str, nproc: int, overrides: list[str]) -> int:
    """Check what can be checked here, then start `nproc` workers under torchrun with one agreed run name."""
    from liandan.train.distributed import launch_local

    check_launch(cfg, nproc)
    if not cfg.run.name:
        overrides = [*overrides, f"--run.name={cfg.run_name(name)}"]
    code, message = launch_local(nproc, "liandan.cli", ["train", config, *overrides])
    if message:
        report_error(message)
    return 0 if code == 0 else (code if code in (2, DEVICE_FAULT_EXIT) else 1)


def train_here(cfg: Config, name: str, supervised: bool) -> int:
    """Train in this process: the only one, or one rank of many (`supervised`: a worker of the supervisor)."""
    from liandan.train import Trainer
    from liandan.train.preemption import Preempted, PreemptionGuard

    # SIGTERM, SIGINT: save at the end of the step, then exit 128 + signal (the trainer attaches the guard's
    # callback, "preemption", while it is installed)
    guard = PreemptionGuard().install()
    try:
        trainer = Trainer(cfg, config_name=name)  # with every registered callback the config asks for
        try:
            result = trainer.train()
        except Exception as err:
            if supervised and not isinstance(err, (*user_errors(), OSError)):
                _crash_now()
            raise
        finally:
            trainer.close()
    except Preempted as stop:
        leave_process_group()
        if int(os.environ.get("RANK", "0")) == 0 and not supervised:  # it says so itself
            resumes = "there" if stop.checkpoint else "from the newest checkpoint"
            print(f"liandan: {stop}; the next run resumes {resumes}", file=sys.stderr)
        return stop.exit_code
    finally:
        guard.close()
    _report(result)
    return 0


def report_error(message: str) -> None:
    """Say a user error in one line. A worker under `--nproc` leaves it for its launcher, which says it once;
    otherwise rank 0 speaks for all, and so does a worker whose launcher's file had no room for it (a full
    disk)."""
    worker = WorkerEnv.from_env()
    if worker.error_dir is not None:
        from liandan.train.distributed import report_worker_error

        if report_worker_error(message):
            return
    if int(os.environ.get("RANK", "0")) == 0 or worker.error_dir is not None:
        print(f"{ERROR_PREFIX}{message}", file=sys.stderr)


def leave_process_group() -> None:
    """End this process's part in its process group, if it has one: a worker that exits inside a live gloo
    group aborts noisily. A process that never imported torch.distributed has none."""
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _crash_now() -> None:
    """A supervised worker that hit a bug: print the traceback and end at once. An orderly exit would wait for
    its peers in a process group that is about to be torn down anyway (a second or more), and the supervisor
    restarts the ranks only when it sees this one end."""
    import time
    import traceback

    from liandan.run.layout import rank_file

    errors = WorkerEnv.from_env().error_dir
    if errors is not None:  # when it failed, for the supervisor to tell a first failure from its consequences
        with contextlib.suppress(OSError):
            rank_file(errors, int(os.environ.get("RANK", "0")), CRASHED).write_text(repr(time.time()))
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


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
