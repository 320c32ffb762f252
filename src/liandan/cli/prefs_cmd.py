"""`liandan prefs RUN|CKPT --task gsm8k --out prefs.jsonl`: preference pairs from verifiable answers. k replies
per question are sampled from the checkpoint's model as a chat (its own template), graded against the task's
reference answer with its `answer_regex`, and a correct reply paired with an incorrect one as a preference
record that `train.objective = "dpo"` reads (`liandan.evaluate.preferences`). The summary goes to stdout and
to a JSON file beside the output; the progress to stderr."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from liandan.config import ConfigError
from liandan.run.files import check_output


def add_commands(sub) -> None:
    p = sub.add_parser("prefs")
    p.add_argument("path", help="a run directory (its newest checkpoint), a checkpoints directory or a step directory")
    p.add_argument("--task", required=True, help="a generation task with an answer_regex (gsm8k) or a task file")
    p.add_argument("--out", required=True, help="the preference file to write (.jsonl); its summary goes beside it")
    p.add_argument("-k", "--samples", type=int, default=4, help="replies sampled per question (default 4)")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature (default 0.8)")
    p.add_argument("--top-k", type=int, default=None, help="draw from the k likeliest tokens only (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling: one seed, one file (default 0)")
    p.add_argument("--pairs-per-prompt", type=int, default=1, help="pairs written per question at most (default 1)")
    p.add_argument("--items", default="train",
                   help="which of the task's items: train (all but every 5th), heldout (every 5th) or all"
                        " (default train)")  # fmt: skip
    p.add_argument("--limit", type=int, default=0, help="the first N items of the split only (default 0: all)")
    p.add_argument(
        "--reference-as-chosen",
        action="store_true",
        help="a question with no correct reply takes the task's reference answer as its chosen reply",
    )
    p.add_argument("--max-new-tokens", type=int, default=0,
                   help="tokens per reply at most (default: the task's max_new_tokens; capped to half the model's"
                        " window when that is fewer)")  # fmt: skip
    p.add_argument("--batch-size", type=int, default=32, help="replies generated together (default 32)")
    p.add_argument("--chat-template", help="chatml, or a Hugging Face tokenizer directory whose chat template to"
                                           " use, instead of the one the checkpoint's run recorded")  # fmt: skip
    p.add_argument("--data-dir", help="what {data_dir} stands for in task files (default: ../shared/data)")
    p.add_argument("--device", default=None, help="where the model runs (default: cuda when there is one, else cpu)")
    p.add_argument("--tokenizer", help="a tokenizer.json, instead of the one the checkpoint records")
    p.set_defaults(command=cmd_prefs)


def cmd_prefs(args: argparse.Namespace, overrides: list[str]) -> int:
    if overrides:
        raise ConfigError(f"liandan prefs takes no config overrides: {' '.join(overrides)}")
    _check(args)
    path, out = Path(args.path), Path(args.out)
    if not path.exists():
        raise ConfigError(f"liandan prefs: no such run or checkpoint: {path}")
    task = _task(args)
    from liandan.checkpoint.info import resolve_checkpoint
    from liandan.evaluate.loading import evaluation_device, load_for_eval
    from liandan.evaluate.preferences import (
        PrefsSummary,
        SamplingSettings,
        sample_preferences,
        template_of_checkpoint,
        write_preferences,
    )
    from liandan.evaluate.progress import EvalProgress
    from liandan.evaluate.runner import generation_room
    from liandan.evaluate.tasks import split_items

    device = evaluation_device(args.device)
    model, tokenizer, config = load_for_eval(path, tokenizer=args.tokenizer, device=device)
    checkpoint = resolve_checkpoint(path)
    template, notes = template_of_checkpoint(checkpoint, config, tokenizer, args.chat_template)
    for note in notes:
        print(note, file=sys.stderr)
    asked = args.max_new_tokens or task.max_new_tokens
    settings = SamplingSettings(
        samples=args.samples, temperature=args.temperature, top_k=args.top_k, seed=args.seed,
        max_new_tokens=generation_room(asked, model.args.max_seq_len), pairs_per_prompt=args.pairs_per_prompt,
        reference_as_chosen=args.reference_as_chosen, batch_size=args.batch_size,
    )  # fmt: skip
    indices = split_items(len(task.items), args.items)
    indices = indices[: args.limit] if args.limit else indices
    summary = PrefsSummary(task.name, args.items, settings={
        "checkpoint": str(checkpoint), "template": template.name, "limit": args.limit,
        **vars(settings),
    })  # fmt: skip
    if settings.max_new_tokens < asked:
        print(f"note: max_new_tokens {asked} capped at {settings.max_new_tokens}, half the model's window",
              file=sys.stderr)  # fmt: skip
    records = sample_preferences(
        model, tokenizer, template, task, indices, settings, summary,
        progress=lambda total: EvalProgress(total, name="prefs", unit="samples drawn"),
    )  # fmt: skip
    sidecar = write_preferences(out, records, summary)
    for line in summary.lines():
        print(line)
    print(f"wrote {out} and {sidecar}")
    if summary.pairs:
        print(_dpo_command(args, out, checkpoint, template))
    elif not args.reference_as_chosen:
        print("no pair: no question had both a correct and an incorrect reply; --reference-as-chosen pairs the"
              " reference answer against the incorrect ones")  # fmt: skip
    return 0


def _dpo_command(args: argparse.Namespace, out: Path, checkpoint: Path, template) -> str:
    """The line that trains on the pairs: DPO renders them with data.chat_template, and a model's template is
    read beside data.tokenizer, so that names the template's directory rather than the run's copy."""
    from liandan.checkpoint.info import read_meta
    from liandan.evaluate.loading import checkpoint_tokenizer

    if template.name == "chatml":
        tokenizer_file = args.tokenizer or checkpoint_tokenizer(checkpoint, read_meta(checkpoint), None)
        flags = f" --data.tokenizer={tokenizer_file}" if tokenizer_file else ""
    else:
        flags = f" --data.tokenizer={template.directory / 'tokenizer.json'} --data.chat_template=tokenizer"
    return (f"train on them: liandan train CONFIG --train.objective=dpo --data.paths='[\"{out}\"]'"
            f" --checkpoint.init_from={checkpoint}{flags}")  # fmt: skip


def _check(args: argparse.Namespace) -> None:
    from liandan.evaluate.tasks import ITEM_SPLITS

    if args.samples < 2:
        raise ConfigError(f"--samples = {args.samples}: a pair needs two replies, sample at least 2")
    if not math.isfinite(args.temperature):
        raise ConfigError(f"--temperature = {args.temperature}: must be a finite number above 0")
    if args.temperature <= 0:
        raise ConfigError(f"--temperature = {args.temperature}: must be above 0 (at 0 every sample is the same)")
    if args.top_k is not None and args.top_k < 2:
        raise ConfigError(f"--top-k = {args.top_k}: must be at least 2 (1 draws the same reply every time)")
    for name in ("pairs_per_prompt", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be at least 1")
    for name in ("limit", "max_new_tokens"):
        if getattr(args, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} = {getattr(args, name)} must be at least 0")
    if args.items not in ITEM_SPLITS:
        raise ConfigError(f"--items {args.items}: choose one of {', '.join(ITEM_SPLITS)}")
    if not args.out.endswith(".jsonl"):
        raise ConfigError(f"--out {args.out}: the preference file is written as .jsonl; name it *.jsonl")
    check_output(args.out)


def _task(args: argparse.Namespace):
    from liandan.evaluate.tasks import DEFAULT_DATA_DIR, load_tasks

    if args.data_dir is not None and not Path(args.data_dir).is_dir():
        raise ConfigError(f"--data-dir: no such directory: {args.data_dir}")
    (task,) = load_tasks([args.task], args.data_dir or DEFAULT_DATA_DIR)
    if task.kind != "generation" or task.answer_regex is None:
        raise ConfigError(f"task {task.name} ({task.file}): liandan prefs grades replies with a generation task's"
                          " answer_regex, and this one has none")  # fmt: skip
    return task
