"""`liandan` command line. User mistakes end as one line on stderr and a non-zero exit, never a traceback.

The parser knows every command, but imports a command's module only when that command runs: `liandan --help`
and the read-only commands start without importing what the others need (torch above all). Training itself
is `liandan.resilience.roles.run_training`; the `train` command parses its arguments and calls it."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from liandan import __version__, plugins
from liandan.config import ConfigError, describe, load_config
from liandan.resilience.roles import leave_process_group, report_error, user_errors

if TYPE_CHECKING:
    from liandan.config import Config
    from liandan.resilience.launch import Start

# The commands of the modules beside this one (`liandan.cli.<module>`, each with `add_commands(sub)`), in the
# order `liandan --help` lists them after train, demo, config and incidents, with the line it shows for each.
# A module's commands follow one another.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("doctor_cmd", "check every rank's devices, collectives, disk and environment; name a bad rank and its host"),
    "skipped": ("guard_cmd", "the batches the loss-spike guard skipped in a run, and their documents"),
    "launch": ("launch_cmd", "a Slurm script or per-node commands that run one liandan supervisor per node"),
    "report": ("report_cmd", "one self-contained HTML file (and PNGs) of runs: curves with incidents marked, timelines"),
    "data": ("data_cmd", "clean, deduplicate, inspect and tokenize raw text into token stores"),
    "tokenizer": ("tokenizer_cmd", "a tokenizer's bytes, characters and words per token, per source and language"),
    "ckpt": ("checkpoints", "inspect checkpoints"),
    "export": ("checkpoints", "write a checkpoint's model as Hugging Face Llama or one safetensors file"),
    "import": ("checkpoints", "turn Hugging Face Llama weights into a checkpoint to train from"),
    "eval": ("eval_cmd", "score a checkpoint on tasks under several prompt formats, held-out bits per byte per source, and contamination"),
    "generate": ("generate_cmd", "continue a prompt with a checkpoint's model: sampled (temperature, top-k, seed) or greedy"),
    "prefs": ("prefs_cmd", "preference pairs for DPO from a checkpoint's sampled answers, graded against a task's reference answers"),
    "plan": ("plan_cmd", "parameters, FLOPs, memory per device, the smallest layout that fits, run time and cost"),
    "fit": ("fit_cmd", "fit a scaling law L(N, D) = E + A/N^α + B/D^β (and L(C)) to runs, with bootstrap intervals"),
    "optimal": ("fit_cmd", "compute-optimal parameters and tokens for a FLOP budget (or tokens for a size) under a scaling law"),
    "forecast": ("forecast_cmd", "forecast a run's final loss from its partial loss curve (learning-rate-annealing scaling law)"),
    "sweep": ("sweep_cmd", "search hyperparameters with Optuna: each trial a training run, bad ones pruned early"),
    "mix": ("mix_cmd", "which data to train on: proxy runs over mixture weights, a fitted law, each source's value, recommended weights"),
    "check-transfer": ("transfer_cmd", "whether learning rates tuned at one width hold at others: a coordinate check across widths"),
    "runs": ("runs_cmd", "list the runs of a project directory (status, tokens, losses, goodput, incidents, forecast)"),
    "dash": ("dash_cmd", "a live web dashboard of the runs in a project directory (needs the [dash] extra)"),
    "lm-eval": ("lm_eval_cmd", "run lm-evaluation-harness tasks on a checkpoint (lm-eval's own arguments follow the checkpoint)"),
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # a process of its own (the tests call main with their arguments and their captures)
        sys.stdout, sys.stderr = QuietWhenGone(sys.stdout), QuietWhenGone(sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(_command_word(argv))
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "command"):
        parser.print_help()
        return 0
    try:
        overrides = _overrides(extra)
        return args.command(args, overrides)
    except user_errors() as err:
        report_error(describe_error(err))
        leave_process_group()  # a worker that exits inside a live gloo group aborts noisily
        return getattr(err, "exit_code", 2)
    except ModuleNotFoundError as err:
        extra = plugins.extra_of(err.name)
        if extra is None:
            raise
        report_error(f"liandan {args.command_name} needs the [{extra}] extra: pip install 'liandan[{extra}]'")
        leave_process_group()
        return 2
    except OSError as err:  # full disk, permissions, unreadable files: the user's environment, not a bug
        report_error(describe_error(err))
        return 1
    except KeyboardInterrupt:
        report_error("interrupted")
        return 130


class QuietWhenGone:
    """sys.stdout or sys.stderr, going quiet once whatever read it has gone (the program it was piped to, or
    the one that started this process, ended) instead of raising BrokenPipeError into a run that is training:
    what a run says it also keeps in its files. The stream's descriptor then points at os.devnull, so that
    what is still buffered, and the processes this one starts, write there without error too."""

    def __init__(self, stream: Any):
        self._stream, self._gone = stream, False

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._go_quiet()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._go_quiet()

    def _go_quiet(self) -> None:
        self._gone = True
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def describe_error(err: BaseException) -> str:
    """The one line a user error or an OS error is printed as: never empty. An OS error names its type and,
    where it has one, the path (an OSError of a write to an open file has none: the writers add it)."""
    if isinstance(err, OSError):
        what = err.strerror or str(err).strip() or "no message"
        where = "".join(f": {name}" for name in (err.filename, err.filename2) if name)
        return f"{type(err).__name__}: {what}{where}"
    return str(err).strip() or f"{type(err).__name__} (no message)"


def _overrides(extra: list[str]) -> list[str]:
    for item in extra:
        if not (item.startswith("--") and "=" in item and "." in item.split("=", 1)[0]):
            raise ConfigError(f"unrecognised argument '{item}'; overrides look like --section.key=value")
    return extra


def _command_word(argv: Sequence[str]) -> str | None:
    """The command `argv` names: its first word that is no option (liandan's own options take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


class _Commands:
    """The subparsers, as a command module sees them: each command gets its line of the list from COMMANDS."""

    def __init__(self, sub: argparse._SubParsersAction):
        self.sub = sub

    def add_parser(self, name: str, **kwargs) -> argparse.ArgumentParser:
        return self.sub.add_parser(name, help=COMMANDS[name][1], **kwargs)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, to which any word that starts with a minus and a digit is a value, not an option:
    `--flops -1e21` and `--predict-n -7B` reach the command's own check of the number (argparse takes only
    -1 and -1.5 for negative numbers). No liandan option looks like a number. Its subparsers are of this class
    too (argparse makes them of the parser's own)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-\.?\d")


def _parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every command, with the arguments of `command`'s: its module is the only one imported."""
    parser = _Parser(
        prog="liandan",
        description="Pretrain a language model from raw text. Config keys can be overridden as --section.key=value.",
    )
    parser.add_argument("--version", action="version", version=f"liandan {__version__}")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND", dest="command_name")

    p = sub.add_parser("train", help="train a model from a TOML run config")
    p.add_argument("config", help="run config (TOML), e.g. configs/tiny.toml")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="local processes to start (the supervisor starts them; torchrun when resilience.supervise = false)",
    )
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

    chosen = COMMANDS[command][0] if command in COMMANDS else None
    for name, (module, help_line) in COMMANDS.items():
        if module != chosen:
            sub.add_parser(name, help=help_line, add_help=False)  # listed; never parsed in this process
        elif name not in sub.choices:  # the chosen module's first command: it adds them all
            importlib.import_module(f"liandan.cli.{module}").add_commands(_Commands(sub))
    return parser


def cmd_incidents(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.resilience.incidents import timeline

    lines = timeline(Path(args.run), triaged=True)
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
    from liandan.resilience.roles import run_training

    return run_training(args.config, args.nproc, overrides, prepare=prepare_training)


def prepare_training(cfg: Config, start: Start) -> None:
    """What `liandan train` does in every process that trains before any worker starts: register the
    callbacks (a module that cannot be imported fails before any worker) and, in the process that starts the
    others or trains alone, check the evaluation task files (so does a bad task file)."""
    register_callbacks(cfg.train.callbacks)
    if cfg.eval.every and cfg.eval.tasks and start.how == "here":
        from liandan.evaluate.tasks import load_tasks

        load_tasks(cfg.eval.tasks, cfg.eval.data_dir)


def register_callbacks(modules: Sequence[str] = ()) -> None:
    """Register the callbacks of the `modules` a run's config names (`[train] callbacks`); liandan's own are
    plug-ins every trainer attaches itself. Every process that trains passes here: `liandan train` alone, and
    each supervised or torchrun worker, which runs `python -m liandan.cli train` with the same config."""
    from liandan.train.callbacks import import_callback_modules

    import_callback_modules(modules)


def cmd_demo(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.cli.demo import run_demo

    return run_demo(args.data, args.steps, Path(args.output_dir), overrides)


if __name__ == "__main__":
    sys.exit(main())
