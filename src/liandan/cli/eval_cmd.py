"""`liandan eval RUN|CKPT --tasks ...`: score a checkpoint on tasks (every prompt format: mean, min, max,
spread), the held-out loss of each data source of its run in bits per byte, and each task's contamination in
the run's training stores. One process, or `--nproc N` local processes that split the items between them
(each holds the whole model; the counts are gathered, so the scores are the same). `[eval]` keys of the run's
config apply, and `--eval.key=value` overrides them. A progress bar (plain lines where stderr is not a
terminal) goes to stderr while it works; the results go to stdout.

`--against [BASE]` measures the alignment tax (`liandan.evaluate.tax`): the base checkpoint (by default the
`checkpoint.init_from` the run started from) is scored first on the same tasks, formats and items, both models
on the base run's held-out sources, and the two compared.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from liandan.config import ConfigError, load_config
from liandan.run.files import atomic_write_json, check_output


def add_commands(sub) -> None:
    p = sub.add_parser("eval")
    p.add_argument("path", help="a run directory (its newest checkpoint), a checkpoints directory or a step directory")
    p.add_argument("--tasks", help="comma-separated task names (gsm8k, cloze_en, cloze_zh) or task files;"
                   " default: [eval] tasks of the run's config")  # fmt: skip
    p.add_argument("--limit", type=int, help="items per task (default: [eval] limit); 0 takes all")
    p.add_argument("--data-dir", help="what {data_dir} stands for in task files (default: [eval] data_dir)")
    p.add_argument("--nproc", type=int, default=1, help="local processes to split the items over")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--record", action="store_true", help="also append the results to the run's events.jsonl")
    p.add_argument("--against", nargs="?", const="", metavar="BASE",
                   help="also score the base model (a run or checkpoint; default: the run's checkpoint.init_from)"
                   " on the same tasks and both on its run's held-out sources, and compare: the alignment tax")  # fmt: skip
    p.add_argument("--report-to", help=argparse.SUPPRESS)  # a worker of --nproc hands its report back here
    p.set_defaults(command=cmd_eval)


def run_dir_of(path: Path) -> Path | None:
    """The run directory a checkpoint path belongs to (the nearest ancestor holding config.toml), if any."""
    return next((p for p in (path, *path.parents[:3]) if (p / "config.toml").is_file()), None)


def cmd_eval(args: argparse.Namespace, overrides: list[str]) -> int:
    path = Path(args.path)
    if not path.exists():
        raise ConfigError(f"liandan eval: no such run or checkpoint: {path}")
    if args.nproc < 1:
        raise ConfigError(f"--nproc = {args.nproc} must be at least 1")
    run = run_dir_of(path)
    if args.record and run is None:  # said before the work, not after it
        raise ConfigError(f"--record: {args.path} is not in a run directory (no config.toml above it)")
    if args.json:
        check_output(args.json)
    extra = [*([f"--eval.tasks={json.dumps(args.tasks.split(','))}"] if args.tasks else []),
             *([f"--eval.limit={args.limit}"] if args.limit is not None else [])]  # fmt: skip
    cfg = load_config(run / "config.toml" if run else None, [*overrides, *extra])
    from liandan.evaluate.tasks import load_tasks

    baseline = None
    if args.against is not None:
        from liandan.evaluate.tax import baseline_checkpoint

        baseline = baseline_checkpoint(args.against, path, cfg if run else None)
        base_run = run_dir_of(baseline)
        if not cfg.eval.tasks and base_run is not None:  # the base model's own benchmarks
            cfg.eval.tasks = load_config(base_run / "config.toml", []).eval.tasks

    if args.data_dir is not None:
        if not Path(args.data_dir).is_dir():
            raise ConfigError(f"--data-dir: no such directory: {args.data_dir}")
        cfg.eval.data_dir = str(Path(args.data_dir).resolve())
    # bad task files fail here, before any worker starts; a relative data_dir may be the run config's
    tasks = load_tasks(cfg.eval.tasks, cfg.eval.data_dir, run)
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        return _launch(args, overrides, baseline)
    report = evaluate_here(path, run, cfg, tasks, baseline)
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if args.report_to:
        atomic_write_json(Path(args.report_to), report)
        return 0
    return _tell(report, args, run)


def evaluate_here(
    path: Path, run: Path | None, cfg: Any, tasks: list[Any], baseline: Path | None = None
) -> dict[str, Any]:
    """This process's part: alone, or one of `--nproc` workers that split the items and gather the counts.
    With a `baseline` checkpoint, that one first, then `path` with its held-out loss on the baseline run's
    sources; the report is then the tuned checkpoint's with "baseline" (its own report) and "tax" added."""
    import torch.distributed as dist

    from liandan.evaluate.runner import Split
    from liandan.train.distributed import init_distributed, shutdown_distributed

    info = init_distributed(cfg.run.device, cfg.parallel.backend, cfg.resilience.collective_timeout_s)
    try:
        split = None
        if info.world_size > 1:

            def gather(part: list) -> list[list]:
                parts: list[Any] = [None] * info.world_size
                dist.all_gather_object(parts, part)
                return parts

            split = Split(info.rank, info.world_size, gather)
        if baseline is None:
            return _evaluate(path, run, cfg, tasks, info, split)[0]
        from liandan.checkpoint.verify import CheckpointError
        from liandan.evaluate.tax import compare

        try:
            before, source = _evaluate(baseline, run_dir_of(baseline), cfg, tasks, info, split, contamination=False)
        except CheckpointError as err:  # unreadable: a file that fails its checksum, no tokenizer to be found
            raise CheckpointError(f"liandan eval --against: the base model {baseline}: {err}") from None
        notes = []
        if source is None:
            notes.append(f"{baseline}: no held-out sources (no run of its own, or [eval] heldout_sequences = 0):"
                         " bits per byte not compared")  # fmt: skip
        elif not before["heldout"]:
            notes.append(f"{baseline}: its run holds no documents out ([data] val_fraction = 0): bits per byte"
                         " not compared")  # fmt: skip
        after, _ = _evaluate(path, run, cfg, tasks, info, split, heldout_from=source, notes=notes)
        return {**after, "baseline": before, "tax": compare(before, after, notes)}
    finally:
        shutdown_distributed()


def _evaluate(
    path: Path, run: Path | None, cfg: Any, tasks: list[Any], info: Any, split: Any, *, contamination: bool = True,
    heldout_from: Any = None, notes: list[str] | None = None,
) -> tuple[dict[str, Any], Any]:  # fmt: skip
    """One checkpoint's report, and the held-out windows it was scored on ((loader, tokenizer, document mask),
    or None). `heldout_from`: windows of another run to score instead of its own (the base run's); `notes`
    gets why they could not be."""
    import torch

    from liandan.evaluate.heldout import heldout_losses
    from liandan.evaluate.loading import load_for_eval
    from liandan.evaluate.progress import EvalProgress
    from liandan.evaluate.runner import run_task, task_requests

    model, tokenizer, run_cfg = load_for_eval(path, device=info.device)
    e = cfg.eval
    total = sum(task_requests(task, e.limit, e.formats, split) for task in tasks)
    progress = EvalProgress(total, show=info.rank == 0)
    try:
        with torch.no_grad():
            results = [run_task(model, tokenizer, task, limit=e.limit, max_len=model.args.max_seq_len,
                                batch_size=e.batch_size, split=split, formats=e.formats,
                                max_new_tokens=e.max_new_tokens, progress=progress) for task in tasks]  # fmt: skip
        heldout, found, step = [], [], _step_of(path)
        # an imported checkpoint has no run config, and so no training stores to hold out from or compare with
        loader = _loader(run_cfg, run) if run is not None and run_cfg is not None else None
        source = (loader, tokenizer, run_cfg.train.mask == "document") if loader is not None else None
        if heldout_from is not None:
            from liandan.evaluate.tax import foreign_ids

            why = foreign_ids(heldout_from[1], tokenizer)
            if why is not None and notes is not None:
                notes.append(f"{path}: {why}: bits per byte on the base run's sources not compared")
            source = heldout_from if why is None else None
        if source is not None and e.heldout_sequences:
            progress.stage("held-out loss per source")
            heldout = heldout_losses(model, source[0], source[1], sequences=e.heldout_sequences,
                                     batch_size=e.batch_size, document_mask=source[2], device=info.device,
                                     split=split)  # fmt: skip
        if loader is not None and contamination and e.contamination and tasks and info.rank == 0:
            from liandan.evaluate.contamination import overlaps

            progress.stage("contamination in the training stores")
            found = overlaps(tasks, loader.stores, tokenizer, limit=e.limit, ngram=e.ngram)
    finally:
        progress.close()
    report = {
        "checkpoint": str(path), "step": step,
        "tasks": [{"task": r.task, "kind": r.kind, "n": r.n, "scores": r.scores,
                   "summary": {m: r.summary(m) for m in r.metrics}, "line": r.spread_line(),
                   "notes": r.notes, "events": r.events(step)} for r in results],
        "heldout": [{**h.event(step), "line": h.line()} for h in heldout],
        "contamination": [{**c.event(), "line": c.line()} for c in found],
    }  # fmt: skip
    return report, source if e.heldout_sequences else None


def _step_of(path: Path) -> int:
    from liandan.checkpoint.info import read_meta, resolve_checkpoint

    return int(read_meta(resolve_checkpoint(path)).get("step", 0))


def _loader(run_cfg: Any, run: Path) -> Any:
    """The run's own data loader, for its held-out windows (the same split training left out)."""
    from liandan.data.pipeline.prepare import open_prepared, open_stores
    from liandan.data.tokens.loader import PackedLoader
    from liandan.run import RunDir

    if run_cfg.data.stores:
        stores, _ = open_stores(run_cfg.data.stores, run_cfg.data.cache_dir)
    elif RunDir(run).data_manifest.is_file():
        stores = [open_prepared(RunDir(run).data)[0]]
    else:
        return None
    t = run_cfg.train
    return PackedLoader(stores, t.seq_len, t.global_batch, run_cfg.run.seed, run_cfg.data.val_fraction,
                        weights=run_cfg.data.weights or None, split_seed=run_cfg.data.split_seed)  # fmt: skip


def _launch(args: argparse.Namespace, overrides: list[str], baseline: Path | None) -> int:
    from liandan.resilience.roles import report_error
    from liandan.train.distributed import launch_local

    with tempfile.TemporaryDirectory(prefix="liandan-eval-") as scratch:
        report_path = Path(scratch) / "report.json"
        worker = ["eval", args.path, f"--report-to={report_path}", *overrides]
        worker += [f"--tasks={args.tasks}"] if args.tasks else []
        worker += [f"--limit={args.limit}"] if args.limit is not None else []
        worker += [f"--data-dir={args.data_dir}"] if args.data_dir is not None else []
        worker += [f"--against={baseline}"] if baseline is not None else []
        code, message = launch_local(args.nproc, "liandan.cli", worker)
        if message or code:
            report_error(message or f"liandan eval: a worker failed (exit {code})")
            return 2 if code == 2 else 1
        return _tell(json.loads(report_path.read_text()), args, run_dir_of(Path(args.path)))


def _tell(report: dict[str, Any], args: argparse.Namespace, run: Path | None) -> int:
    if "baseline" in report:
        _print_results(report["baseline"], "baseline")
    _print_results(report, "checkpoint")
    if "tax" in report:
        from liandan.evaluate.tax import lines

        print("\n".join(lines(report["tax"])))
    if args.json:
        atomic_write_json(Path(args.json), report)
    if args.record and run is not None:
        from liandan.run import RunDir
        from liandan.track.logger import JsonlLogger

        logger = JsonlLogger(RunDir.from_saved_config(run))
        try:
            for task in report["tasks"]:
                for fields in task["events"]:
                    logger.log_event("eval_task", **fields, by="liandan eval")
            if "tax" in report:  # the held-out here is on the base run's sources: it is told in the comparison
                logger.log_event("eval_tax", **report["tax"], by="liandan eval")
            else:
                for h in report["heldout"]:
                    logger.log_event("eval_heldout", **{k: v for k, v in h.items() if k != "line"}, by="liandan eval")
        finally:
            logger.close()
    return 0


def _print_results(report: dict[str, Any], what: str) -> None:
    print(f"{what} {report['checkpoint']} (step {report['step']})")
    for task in report["tasks"]:
        for fmt, by_metric in task["scores"].items():
            print(f"  {task['task']} [{fmt}]: " + ", ".join(f"{m} {v:.3f}" for m, v in by_metric.items()))
        print(task["line"])
        for note in task.get("notes", []):
            print(f"  note: {note}")
    for line in [h["line"] for h in report["heldout"]] + [c["line"] for c in report["contamination"]]:
        print(line)
