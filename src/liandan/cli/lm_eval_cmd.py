"""`liandan lm-eval RUN|CKPT [lm-eval arguments]`: lm-evaluation-harness tasks on a liandan checkpoint, without
exporting it (the [eval] extra)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from liandan.checkpoint.verify import CheckpointError
from liandan.config import ConfigError

# lm-eval's ValueErrors that are the user's: a task named that it does not know, or none at all
TASK_ERRORS = ("Tasks not found", "No tasks specified")


def add_commands(sub) -> None:
    p = sub.add_parser(
        "lm-eval",
        description="Every argument after the checkpoint goes to lm-eval's `run` as given, e.g. --tasks "
        "hellaswag --include_path my_tasks --limit 100 --batch_size 16 --device cuda; `--model liandan` and "
        "`checkpoint=` in --model_args are set here.",
    )
    p.add_argument("checkpoint", help="a checkpoint, a checkpoints directory or a run directory (its newest)")
    p.add_argument("lm_eval_args", nargs=argparse.REMAINDER, help="lm-eval arguments")
    p.set_defaults(command=cmd_lm_eval)


def cmd_lm_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    rest = list(args.lm_eval_args)
    asks_help = "-h" in rest or "--help" in rest
    if not asks_help and not any(a.split("=", 1)[0] in ("--tasks", "--config") for a in rest):
        raise ConfigError("liandan lm-eval needs --tasks, e.g. --tasks hellaswag (`lm-eval ls tasks` lists them)")
    import liandan.evaluate.lm_eval_bridge  # noqa: F401 - registers the "liandan" model (needs the extra)

    checkpoint = Path(args.checkpoint)
    if not checkpoint.exists():
        raise CheckpointError(f"no such run or checkpoint: {checkpoint}")
    if "--model" in rest or any(a.startswith("--model=") for a in rest):
        raise CheckpointError("liandan lm-eval sets --model itself; pass lm-eval's other arguments")
    model_args = f"checkpoint={checkpoint}"
    for i, arg in enumerate(rest):
        if arg == "--model_args" and i + 1 < len(rest):
            rest[i + 1] = f"{model_args},{rest[i + 1]}"
            break
        if arg.startswith("--model_args="):
            rest[i] = f"--model_args={model_args},{arg.split('=', 1)[1]}"
            break
    else:
        rest += ["--model_args", model_args]
    if "--device" not in rest and not any(a.startswith("--device=") for a in rest):
        rest += ["--device", "auto"]  # lm-eval's own default is cuda:0, even on a machine without one
    from lm_eval.__main__ import cli_evaluate

    argv, sys.argv = sys.argv, ["lm-eval", "run", "--model", "liandan", *rest]
    try:
        cli_evaluate()
    except ValueError as err:
        if not str(err).startswith(TASK_ERRORS):
            raise
        raise ConfigError(f"lm-eval: {err}") from None
    finally:
        sys.argv = argv
    return 0
