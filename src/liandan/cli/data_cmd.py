"""`liandan data run | inspect | info | steps | chat`: the data pipeline from the command line."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import tempfile
from pathlib import Path

from liandan.config import ConfigError
from liandan.run.files import check_output
from liandan.run.remote import is_url


def add_commands(sub) -> None:
    data = sub.add_parser("data")
    actions = data.add_subparsers(title="actions", metavar="ACTION")
    data.set_defaults(command=lambda args, overrides: (data.print_help(), 0)[1])

    p = actions.add_parser("run", help="run a pipeline TOML (resumes an interrupted run)")
    p.add_argument("pipeline", help="pipeline config (TOML), e.g. configs/data/shared-en-zh.toml")
    p.add_argument("--executor", choices=["local", "ray"], help="override pipeline.executor")
    p.add_argument("--workers", type=int, help="override pipeline.workers")
    p.add_argument("--overwrite", action="store_true", help="discard earlier output made with another config")
    p.add_argument(
        "--dry-run", action="store_true", help="print the stages, what each reads and writes and what is done; run none"
    )
    p.set_defaults(command=cmd_run)

    p = actions.add_parser("inspect", help="statistics and anomaly flags of raw or cleaned text files")
    p.add_argument("paths", nargs="+", help=".txt/.jsonl/.parquet files or URLs (optionally .gz/.zst); one source each")
    p.add_argument("--out", required=True, help="directory or URL for report.html, report.md and report.json")
    p.add_argument("--text-field", default="text", help="field holding the text in .jsonl/.parquet records")
    p.add_argument("--txt-mode", choices=["file", "paragraph", "line"], default="paragraph", help="documents of a .txt")
    p.add_argument("--baseline", help="an earlier report.json: flag statistics that shifted since")
    p.add_argument("--tokenizer", help="a tokenizer.json, for token-length statistics")
    p.add_argument("--languages", help="languages every source should hold, e.g. en,zh: flag other languages' shares")
    p.set_defaults(command=cmd_inspect)

    p = actions.add_parser("info", help="what a token store holds; --verify checks every checksum")
    p.add_argument("store", help="a token store directory (with manifest.json), or its URL (fetched into the cache)")
    p.add_argument("--verify", action="store_true", help="read every shard and compare its checksum")
    p.set_defaults(command=cmd_info)

    p = actions.add_parser("steps", help="the registered pipeline steps and their options")
    p.set_defaults(command=cmd_steps)

    p = actions.add_parser("chat", help="chat records (.jsonl) -> a token store with a loss mask, for fine-tuning")
    p.add_argument("paths", nargs="+", help=".jsonl files (optionally .gz/.zst), directories or globs")
    p.add_argument("--out", required=True, help="the store's directory (its rejects.jsonl goes beside the shards)")
    p.add_argument("--tokenizer", default="bpe", help="bpe (trained on the conversations) or a tokenizer.json")
    p.add_argument("--bpe-vocab-size", type=int, default=4096, help="vocabulary size when training a BPE")
    p.add_argument("--template", choices=["chatml", "tokenizer"], default="chatml",
                   help="chatml (built in), or the chat_template beside --tokenizer's tokenizer.json")  # fmt: skip
    p.add_argument("--pairs", action="store_true",
                   help="the records are preference pairs (prompt, chosen, rejected): a store for DPO")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace a store already at --out")
    p.set_defaults(command=cmd_chat)


def cmd_run(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.pipeline.pipeline import plan, run_pipeline
    from liandan.data.pipeline.pipeline_config import load_pipeline

    if args.executor:
        overrides = [*overrides, f"--pipeline.executor={args.executor}"]
    if args.workers is not None:
        overrides = [*overrides, f"--pipeline.workers={args.workers}"]
    cfg = load_pipeline(args.pipeline, overrides)
    if args.dry_run:
        print("\n".join(plan(cfg)))
        return 0
    result = run_pipeline(cfg, overwrite=args.overwrite)
    print_summary(result.summary)
    return 0


def print_summary(s: dict) -> None:
    from rich.table import Table

    from liandan.run.console import make_console

    console = make_console()
    read = s["read"]
    skipped = sum(read["skipped"].values())
    console.print(
        f"read {read['documents']:,} documents ({read['characters']:,} characters); {skipped:,} malformed records rejected"
    )
    table = Table(title="steps")
    for column in ("step", "in", "out", "dropped (top reasons)"):
        table.add_column(column)
    for step in s["steps"]:
        top = sorted(step["dropped"].items(), key=lambda kv: -kv[1])[:3]
        table.add_row(
            step["name"],
            f"{step['documents_in']:,}",
            f"{step['documents_out']:,}",
            ", ".join(f"{k} {v:,}" for k, v in top),
        )
    console.print(table)
    by_source = s.get("drops_by_source", [])
    by_file = s.get("drops_by_file", [])
    for title, rows, key in (("dropped per source", by_source, "source"), ("dropped per input file", by_file, "path")):
        if key == "path" and len(by_file) == len(by_source):
            continue  # one file per source: the same table again
        console.print(_drops_table(title, rows, key))
    d = s["dedup"]
    console.print(
        f"dedup: {d.get('removed', 0):,} of {d.get('documents', 0):,} documents removed"
        + "".join(
            f", {k.replace('_', ' ')} {v:,}"
            for k, v in d.items()
            if k in ("exact_duplicates", "near_duplicates", "clusters")
        )
    )
    console.print(f"tokenizer: {s['tokenizer']['spec']} (vocabulary {s['tokenizer']['vocab_size']:,})")
    for name, store in s["stores"].items():
        console.print(f"store {name}: {store['documents']:,} documents, {store['tokens']:,} tokens -> {store['path']}")
    if "report" in s:
        flags = s["report"]["flags"]
        console.print(f"report: {s['report']['path']}/report.html ({len(flags)} anomaly flag(s))")
        for flag in flags:
            console.print(f"  [yellow]flag[/yellow] {flag}")
    published = s.get("published", {}).get("stores", {})
    # absolute: the command that trains is seldom run from where this one was
    where = [published.get(name, v["path"]) for name, v in s["stores"].items()]
    stores = json.dumps([p if is_url(p) else str(Path(p).resolve()) for p in where], ensure_ascii=False)
    console.print(f"train on it: --data.stores='{stores}'", soft_wrap=True)


def cmd_inspect(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.documents.corpus import ReadStats
    from liandan.data.documents.readers import read_file
    from liandan.data.inspect.inspection import inspect_sources
    from liandan.data.tokens.tokenizer import HFTokenizer

    if overrides:
        raise ConfigError(f"unrecognised argument '{overrides[0]}'")
    if not is_url(args.out):  # said before the sources are read, not after
        check_output(args.out, directory=True, makes_parents=True)
    from liandan.data.documents.readers import files_in_directory
    from liandan.data.steps.langid import check_language_codes

    languages = [code.strip() for code in (args.languages or "").split(",") if code.strip()]
    try:  # a code the identifier never answers with would flag every source's whole text as foreign
        languages = check_language_codes("--languages", languages)
    except ValueError as err:
        raise ConfigError(str(err)) from None

    names = []
    for name in args.paths:  # a directory stands for the data files directly in it, each a source
        local = not is_url(name) and Path(name).is_dir()
        names += [str(p) for p in files_in_directory(Path(name), name)] if local else [name]
    sources, read_stats = {}, {}
    for name in names:
        path = name if is_url(name) else Path(name)
        source = name.rstrip("/").rsplit("/", 1)[-1].split(".")[0]
        if source in sources:
            source = name
        read_stats[source] = ReadStats()
        sources[source] = read_file(
            path, source=source, text_field=args.text_field, txt_mode=args.txt_mode, stats=read_stats[source]
        )
    tokenizer = HFTokenizer.load(args.tokenizer) if args.tokenizer else None
    baseline = Path(args.baseline) if args.baseline else None
    with _report_dir(args.out) as out:
        report = inspect_sources(
            sources,
            out,
            tokenizer=tokenizer,
            baseline=baseline,
            read_stats=read_stats,
            expected_languages={source: languages for source in sources} if languages else None,
        )
    say_skipped(read_stats)
    print(f"report: {args.out.rstrip('/')}/report.html ({len(report.flags)} anomaly flag(s))")
    for flag in report.flags:
        print(f"  flag: {flag.line()}")
    return 0


def say_skipped(read_stats: dict) -> None:
    """A line for each source (name -> ReadStats) whose reader skipped records, with the reasons counted."""
    for source, counts in read_stats.items():
        if counts.skipped:
            print(f"{source}: {sum(counts.skipped.values())} record(s) skipped:"
                  f" {counts.summary().split('skipped: ')[1]}")  # fmt: skip


@contextlib.contextmanager
def _report_dir(out: str):
    """Where the report is written: `out` itself, or for a URL a local directory published there when done."""
    if not is_url(out):
        yield Path(out)
        return
    from liandan.data.pipeline.publish import REPORT_MARKER, publish

    with tempfile.TemporaryDirectory(prefix="liandan-report-") as local:
        yield Path(local)
        publish(Path(local), out, REPORT_MARKER)


def cmd_info(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.tokens.cache import local_store
    from liandan.data.tokens.store import TokenStore, verify_store

    local = local_store(args.store, say=print)  # a store URL is checked against its manifest as it is fetched
    store = TokenStore(local)
    print(
        f"store {args.store}: {store.num_documents:,} documents, {store.num_tokens:,} tokens in {len(store.shards)} shard(s)"
    )
    print(f"tokenizer {store.fingerprint} (vocabulary {store.vocab_size:,}, end-of-document id {store.eos_id})")
    if store.loss_mask is not None:
        targets = sum(int(shard.loss_mask.sum()) for shard in store.shards)
        print(f"loss mask ({store.loss_mask.get('template', '?')} template): {targets:,} of the tokens are targets"
              f" ({targets / max(1, store.num_tokens):.1%}); {store.loss_mask.get('means', '')}")  # fmt: skip
    if args.verify:
        problems = verify_store(local)
        for problem in problems:
            print(f"  problem: {problem}")
        print("verified: every checksum matches" if not problems else f"{len(problems)} problem(s)")
        return 0 if not problems else 1
    return 0


def _drops_table(title: str, rows: list[dict], key: str):
    from rich.table import Table

    table = Table(title=title)
    for column in (key if key == "source" else "file", "read", "kept", "dropped", "top reasons"):
        table.add_column(column)
    for row in rows:
        share = 1 - row["kept"] / row["read"] if row["read"] else 0.0
        top = ", ".join(f"{k} {v:,}" for k, v in list(row["dropped"].items())[:3])
        table.add_row(row[key], f"{row['read']:,}", f"{row['kept']:,}", f"{share:.0%}", top)
    return table


def cmd_steps(args: argparse.Namespace, overrides: list[str]) -> int:
    from liandan.data.steps.base import step_class
    from liandan.plugins import names

    for name in sorted(names("data_step")):
        cls = step_class(name)
        print(f"{name:20s} {first_sentence(cls.__doc__ or '')}")
        for param in list(inspect.signature(cls.__init__).parameters.values())[1:]:
            default = "" if param.default is inspect.Parameter.empty else f" = {param.default!r}"
            print(f"    {param.name}{default}")
    return 0


def first_sentence(doc: str) -> str:
    """A docstring's first sentence, whole however its lines are wrapped (its first paragraph if it has no
    sentence end)."""
    paragraph = " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())
    depth = 0  # "(Rae et al. 2021)" ends no sentence
    for at, char in enumerate(paragraph):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char in ".!?" and depth <= 0 and paragraph[at + 1 : at + 2] in ("", " "):
            return paragraph[: at + 1]
    return paragraph


def cmd_chat(args: argparse.Namespace, overrides: list[str]) -> int:
    """Write a fine-tuning store (of preference pairs with --pairs), as a run with `train.objective = "sft"`
    (or "dpo") writes its own from `[data] paths`; a run then trains on it with `[data] stores`."""
    from liandan.config import DataSection
    from liandan.data.pipeline.chat import prepare_chat_store

    # the bound `data.bpe_vocab_size` and `tokenizer.vocab_size` have, before a BPE is trained with it
    lowest = next(f for f in dataclasses.fields(DataSection) if f.name == "bpe_vocab_size").metadata["min"]
    if args.bpe_vocab_size < lowest:
        raise ConfigError(f"--bpe-vocab-size = {args.bpe_vocab_size} is too small; it must be >= {lowest}")
    out = check_output(args.out, directory=True, makes_parents=True)
    if (out / "manifest.json").is_file() and not args.overwrite:
        raise ConfigError(f"{out} already holds a token store; pass --overwrite to replace it")
    cfg = DataSection(paths=list(args.paths), tokenizer=args.tokenizer, bpe_vocab_size=args.bpe_vocab_size,
                      chat_template=args.template)  # fmt: skip
    if args.pairs:
        from liandan.data.pipeline.preferences import prepare_preference_store

        prepare_preference_store(cfg, out, say=print)
    else:
        prepare_chat_store(cfg, out, say=print)
    objective = "dpo" if args.pairs else "sft"
    print(f"wrote {out}: train on it with --train.objective={objective} --data.stores='[\"{out}\"]'")
    return 0
