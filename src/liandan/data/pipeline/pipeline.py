"""`liandan data run`: raw text to token stores, as a list of stages (`liandan.data.pipeline.stages`) that each write
their output and a done marker, so a crashed run resumes without redoing finished work.

    clean      per input file, in parallel: read -> steps (normalize, filters, language, decontamination)
               -> the kept documents, a rejects file with the reason for every dropped record, and the
               document hashes and MinHash signatures dedup needs
    dedup      once: exact and near duplicates across all sources -> which documents each task removes
    tokenizer  once, when the config trains one: byte-level BPE on an even sample of the kept documents
    tokenize   per input file, in parallel: kept documents -> a shard of the source's token store
    manifest   once: each store's manifest.json with every shard's checksum
    inspect    once, unless switched off: the report of the final corpus, with anomaly flags

Where each file goes is `liandan.data.pipeline.layout.PipelineLayout`'s business; `pipeline_stages(cfg)` is the list.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from liandan.data.documents.corpus import DataError, Document, ReadStats
from liandan.data.pipeline.drops import drop_reasons, drops_by
from liandan.data.pipeline.executor import make_executor
from liandan.data.pipeline.layout import PipelineLayout, Task
from liandan.data.pipeline.pipeline_config import PipelineConfig, expand_paths
from liandan.data.pipeline.stages import Stage, StageContext, describe, run_stages
from liandan.data.steps.base import Step, StepStats, build_step, merge_step_stats
from liandan.faults import maybe_inject
from liandan.run import atomic_file, atomic_write, replacing
from liandan.run.lock import lock_output_dir

# Settings that change where the work runs, never what it writes: a resumed run may change them.
_RUNTIME_KEYS = ("executor", "workers", "ray_address", "inspect", "baseline", "publish")


def plan_tasks(cfg: PipelineConfig) -> list[Task]:
    tasks: list[Task] = []
    for spec in cfg.inputs:
        for path in expand_paths(spec):
            named = spec.name if spec.provenance == "input" else str(path)
            tasks.append(Task(len(tasks), spec.name, str(path), spec.text_field, spec.txt_mode, named))
    return tasks


# -- files (not fsync'd: a crashed stage is redone from its done markers) ----------------------------------------------
class _JsonlWriter:
    """Lines of JSON into a .jsonl (zstd-compressed when the name ends in .zst), written under a temporary name
    and renamed when complete."""

    def __init__(self, path: Path):
        self.path = path
        self._files = contextlib.ExitStack()  # renames the file into place when close() closes it
        self._file = self._files.enter_context(atomic_file(path, "wb", durable=False))
        self._stream = self._file
        if path.name.endswith(".zst"):
            import zstandard

            self._stream = zstandard.ZstdCompressor(level=3).stream_writer(self._file)
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self._stream.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self.count += 1

    def close(self) -> None:
        if self._stream is not self._file:
            self._stream.close()  # also closes the file
        self._files.close()


def read_jsonl_zst(path: Path) -> Iterator[dict[str, Any]]:
    """The records of a .jsonl or .jsonl.zst that the pipeline wrote."""
    with open(path, "rb") as raw:
        if path.name.endswith(".zst"):
            import zstandard

            stream: Any = zstandard.ZstdDecompressor().stream_reader(raw)
        else:
            stream = raw
        for line in io.TextIOWrapper(stream, encoding="utf-8"):
            yield json.loads(line)


def _doc_record(doc: Document) -> dict[str, Any]:
    return {"source": doc.source, "id": doc.doc_id, "text": doc.text, "meta": doc.meta}


def read_clean(path: Path) -> Iterator[Document]:
    for r in read_jsonl_zst(path):
        yield Document(r["source"], r["id"], r["text"], r["meta"])


def _save_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    atomic_write(path, buffer.getvalue(), durable=False)


def kept_documents(layout: PipelineLayout, task: Task) -> Iterator[Document]:
    remove = np.load(layout.removals(task))
    for doc, removed in zip(read_clean(layout.kept(task)), remove):
        if not removed:
            yield doc


def make_steps(specs: list[dict[str, Any] | Step]) -> list[Step]:
    steps = []
    for spec in specs:
        step = build_step(spec) if isinstance(spec, dict) else copy.deepcopy(spec)
        step.stats = StepStats(step.name)
        steps.append(step)
    return steps


def dedup_params(cfg: PipelineConfig):
    from liandan.data.dedup.dedup import NearDedupParams

    d = cfg.dedup
    return NearDedupParams(
        threshold=d.threshold,
        ngram=d.ngram,
        num_perm=d.num_perm,
        bands=d.bands,
        rows=d.rows,
        seed=cfg.pipeline.seed,
        verify=d.verify,
    )


def tokenizer_spec(cfg: PipelineConfig, layout: PipelineLayout) -> str:
    """What `load_tokenizer` takes: the trained BPE's file, `byte`, or the given tokenizer.json."""
    return str(layout.tokenizer) if cfg.tokenizer.kind == "bpe" else cfg.tokenizer.kind


# -- the stages ------------------------------------------------------------------------------------------------
class CleanStage(Stage):
    name = "clean"
    about = "read, run the steps, keep or reject each document; hashes and signatures for dedup"
    per_task = True

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [task.path]  # a local path or a URL, shown as given

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        layout, dedup = ctx.layout, ctx.cfg.dedup
        paths = [layout.kept(task), layout.rejects(task)]
        return paths + [layout.exact_hashes(task)] * dedup.exact + [layout.minhashes(task)] * dedup.near

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        from liandan.data.dedup.dedup import MinHasher, exact_hashes
        from liandan.data.documents.readers import read_file

        cfg, layout = ctx.cfg, ctx.layout
        layout.clean_dir.mkdir(parents=True, exist_ok=True)
        steps = make_steps(cfg.steps)
        kept = _JsonlWriter(layout.kept(task))
        rejects = _JsonlWriter(layout.rejects(task))

        def on_drop(doc: Document, step: str, reason: str) -> None:
            rejects.write({"step": step, "reason": reason, **_doc_record(doc)})

        for step in steps:
            step.on_drop = on_drop
        read_stats = ReadStats()
        docs: Iterator[Document] = read_file(
            task.path,
            source=task.document_source,
            text_field=task.text_field,
            txt_mode=task.txt_mode,
            stats=read_stats,
            on_reject=lambda r: rejects.write({"step": "read", **r}),
        )
        for step in steps:
            docs = step(docs)
        hasher = MinHasher(dedup_params(cfg)) if cfg.dedup.near else None
        hashes, signatures, batch = [], [], []

        def flush() -> None:
            if cfg.dedup.exact:
                hashes.append(exact_hashes(batch))
            if hasher is not None:
                signatures.append(hasher.signatures(batch))
            batch.clear()

        for doc in docs:
            kept.write(_doc_record(doc))
            if kept.count == 1:
                maybe_inject("clean-midway", task.index)  # a task killed while its files are half written
            batch.append(doc.text)
            if len(batch) == 1024:
                flush()
        flush()
        kept.close()
        rejects.close()
        if cfg.dedup.exact:
            _save_npy(layout.exact_hashes(task), np.concatenate(hashes))
        if hasher is not None:
            _save_npy(layout.minhashes(task), np.concatenate(signatures))
        return {
            "task": asdict(task),
            "documents": kept.count,
            "rejected": rejects.count,
            "read": {
                "documents": read_stats.documents,
                "characters": read_stats.characters,
                "skipped": dict(read_stats.skipped),
            },
            "steps": [s.stats.to_dict() for s in steps],
        }


class DedupStage(Stage):
    name = "dedup"
    about = "exact and near duplicates across all sources; each cluster keeps its first document"

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        layout, dedup = ctx.layout, ctx.cfg.dedup
        paths = []
        for t in ctx.tasks:
            paths += [layout.exact_hashes(t)] * dedup.exact + [layout.minhashes(t)] * dedup.near
            paths += [layout.kept(t)] * (dedup.near and dedup.verify)
        return paths

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        layout = ctx.layout
        return [p for t in ctx.tasks for p in (layout.removals(t), layout.clusters(t))] + [layout.dedup_work]

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        from liandan.data.dedup.dedup import ShardTexts, find_duplicates

        cfg, layout, tasks = ctx.cfg, ctx.layout, ctx.tasks
        layout.dedup_dir.mkdir(parents=True, exist_ok=True)
        counts = [c["documents"] for c in ctx.results["clean"]]
        total = sum(counts)
        if cfg.dedup.exact or cfg.dedup.near:
            exact = [layout.exact_hashes(t) for t in tasks] if cfg.dedup.exact else []
            near = [layout.minhashes(t) for t in tasks] if cfg.dedup.near else []
            texts = ShardTexts([layout.kept(t) for t in tasks], counts)
            executor = make_executor(cfg.pipeline.executor, cfg.dedup.workers, cfg.pipeline.ray_address)
            try:
                result = find_duplicates(
                    exact, near, dedup_params(cfg), layout.dedup_work, texts, cfg.dedup.workers, executor
                )
            finally:
                executor.close()
            remove, cluster_of, stats = result.remove, result.cluster_of, dict(result.stats)
        else:
            remove, cluster_of, stats = np.zeros(total, bool), np.full(total, -1, np.int64), {"documents": total}
        offsets = np.concatenate([[0], np.cumsum(counts)])
        for t, lo, hi in zip(tasks, offsets[:-1], offsets[1:]):
            _save_npy(layout.removals(t), remove[lo:hi])
            _save_npy(layout.clusters(t), cluster_of[lo:hi])
        stats["removed"] = int(remove.sum())
        if stats["removed"] == total:
            raise DataError(
                f"no document survived cleaning and deduplication ({drop_reasons(ctx.results['clean'], stats)});"
                f" every dropped record is in {layout.rejects_glob}"
            )
        return stats


class TokenizerStage(Stage):
    name = "tokenizer"
    about = "train a byte-level BPE on an even sample of the kept documents"

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [p for t in ctx.tasks for p in (ctx.layout.kept(t), ctx.layout.removals(t))]

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [ctx.layout.tokenizer]

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        from liandan.data.tokens.tokenizer import train_bpe

        cfg, layout = ctx.cfg, ctx.layout
        kept = ctx.results["dedup"]["documents"] - ctx.results["dedup"]["removed"]
        stride = max(1, kept // cfg.tokenizer.sample_documents)

        def sample() -> Iterator[str]:
            index = 0
            for t in ctx.tasks:
                for doc in kept_documents(layout, t):
                    if index % stride == 0:
                        yield doc.text
                    index += 1

        every = "every document" if stride == 1 else f"every {stride} of"
        ctx.say(f"training a {cfg.tokenizer.vocab_size}-token BPE on {every} {kept:,} documents")
        tokenizer = train_bpe(sample(), cfg.tokenizer.vocab_size, cfg.tokenizer.special_tokens)
        layout.tokenizer.parent.mkdir(parents=True, exist_ok=True)
        with replacing(layout.tokenizer, durable=False) as tmp:
            tokenizer.save(tmp)
        return {"documents": kept, "stride": stride, "fingerprint": tokenizer.fingerprint()}


class TokenizeStage(Stage):
    name = "tokenize"
    about = "the kept documents of each input file -> one shard of its source's token store"
    per_task = True

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        trained = [ctx.layout.tokenizer] if ctx.cfg.tokenizer.kind == "bpe" else []
        return [ctx.layout.kept(task), ctx.layout.removals(task), *trained]

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return ctx.layout.shard_files(task)

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        from liandan.data.tokens.store import write_shard
        from liandan.data.tokens.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(tokenizer_spec(ctx.cfg, ctx.layout))
        info = write_shard(kept_documents(ctx.layout, task), tokenizer, ctx.layout.shard(task))
        return info.to_dict()


class ManifestStage(Stage):
    name = "manifest"
    about = "each store's manifest.json (every shard's checksum) and its tokenizer"

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [p for t in ctx.tasks for p in ctx.layout.shard_files(t)]

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [p for i in ctx.cfg.inputs for p in ctx.layout.manifest_files(i.name)]

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        from liandan.data.tokens.store import ShardInfo, write_manifest
        from liandan.data.tokens.tokenizer import load_tokenizer

        spec = tokenizer_spec(ctx.cfg, ctx.layout)
        tokenizer = load_tokenizer(spec)
        shards = ctx.results["tokenize"]
        stores = {}
        for source in [i.name for i in ctx.cfg.inputs]:
            infos = [ShardInfo.from_dict(s) for s, t in zip(shards, ctx.tasks) if t.source == source]
            store = ctx.layout.store(source)
            write_manifest(store, infos, tokenizer)
            stores[source] = {
                "path": str(store),
                "documents": sum(i.documents for i in infos),
                "tokens": sum(i.tokens for i in infos),
            }
        tokenizer_info = {"spec": spec, "vocab_size": tokenizer.vocab_size, "fingerprint": tokenizer.fingerprint()}
        return {"stores": stores, "tokenizer": tokenizer_info}


class InspectStage(Stage):
    name = "inspect"
    about = "statistics and anomaly flags of the final corpus (report.html, .md, .json)"

    def inputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [p for t in ctx.tasks for p in (ctx.layout.kept(t), ctx.layout.removals(t))]

    def outputs(self, ctx: StageContext, task: Task | None = None) -> list[Path]:
        return [ctx.layout.report_dir]

    def run(self, ctx: StageContext, task: Task | None = None) -> dict[str, Any]:
        from liandan.data.inspect.inspection import inspect_sources
        from liandan.data.pipeline.pipeline_config import expected_languages
        from liandan.data.tokens.tokenizer import load_tokenizer

        cfg, layout = ctx.cfg, ctx.layout

        def source_docs(name: str) -> Iterator[Document]:
            for t in ctx.tasks:
                if t.source == name:
                    yield from kept_documents(layout, t)

        report = inspect_sources(
            {i.name: source_docs(i.name) for i in cfg.inputs},
            layout.report_dir,
            step_stats=[s.to_dict() for s in merge_step_stats([c["steps"] for c in ctx.results["clean"]])],
            dedup_stats=ctx.results["dedup"],
            tokenizer=load_tokenizer(tokenizer_spec(cfg, layout)),
            baseline=Path(cfg.pipeline.baseline) if cfg.pipeline.baseline else None,
            expected_languages=expected_languages(cfg),
        )
        return {"path": str(layout.report_dir), "flags": [f.line() for f in report.flags]}


def pipeline_stages(cfg: PipelineConfig) -> list[Stage]:
    """The stages this config runs, in order."""
    stages: list[Stage] = [CleanStage(), DedupStage()]
    if cfg.tokenizer.kind == "bpe":
        stages.append(TokenizerStage())
    stages += [TokenizeStage(), ManifestStage()]
    if cfg.pipeline.inspect:
        stages.append(InspectStage())
    return stages


# -- the whole run ---------------------------------------------------------------------------------------------
@dataclass
class PipelineResult:
    output: Path
    summary: dict[str, Any]


def plan(cfg: PipelineConfig, layout: PipelineLayout | None = None) -> list[str]:
    """The stage list with what each reads and writes and how much of it an earlier run finished."""
    layout = layout or PipelineLayout(Path(cfg.pipeline.output))
    return describe(pipeline_stages(cfg), StageContext(cfg, layout, plan_tasks(cfg)))


def run_pipeline(
    cfg: PipelineConfig,
    overwrite: bool = False,
    say: Callable[[str], None] = print,
    layout: PipelineLayout | None = None,
    progress: bool = True,
) -> PipelineResult:
    """Run the stages of `cfg` into `layout` (by default laid out under `pipeline.output`), resuming what an
    earlier run of the same config left."""
    layout = layout or PipelineLayout(Path(cfg.pipeline.output))
    # two runs into one output would remove and rename each other's files midway
    lock = lock_output_dir(layout.root, layout.lock, "liandan data run", "pipeline.output")
    try:
        return _run_claimed(cfg, layout, overwrite, say, progress)
    finally:
        lock.release()


def _run_claimed(
    cfg: PipelineConfig, layout: PipelineLayout, overwrite: bool, say: Callable[[str], None], progress: bool
) -> PipelineResult:
    _claim_output(cfg, layout, overwrite)
    tasks = plan_tasks(cfg)
    stages = pipeline_stages(cfg)
    say(f"{len(tasks)} input file(s) from {len(cfg.inputs)} source(s) -> {layout.root}")
    say("stages: " + " -> ".join(s.name for s in stages))
    ctx = StageContext(cfg, layout, tasks, say=say)
    executor = make_executor(cfg.pipeline.executor, cfg.pipeline.workers, cfg.pipeline.ray_address, progress)
    try:
        results = run_stages(stages, ctx, executor)
    finally:
        executor.close()
    cleaned, manifest = results["clean"], results["manifest"]
    summary = {
        "output": str(layout.root),
        "stages": [s.name for s in stages],
        "tasks": len(tasks),
        "read": _merge_read([c["read"] for c in cleaned]),
        "steps": [s.to_dict() for s in merge_step_stats([c["steps"] for c in cleaned])],
        "rejected": sum(c["rejected"] for c in cleaned),
        "drops_by_source": drops_by(cleaned, "source"),
        "drops_by_file": drops_by(cleaned, "path"),
        "dedup": results["dedup"],
        "tokenizer": manifest["tokenizer"],
        "stores": manifest["stores"],
    }
    if "inspect" in results:
        summary["report"] = results["inspect"]
    if cfg.pipeline.publish:
        from liandan.data.pipeline.publish import publish_outputs

        report = layout.report_dir if "inspect" in results else None
        stores_out = {name: Path(info["path"]) for name, info in manifest["stores"].items()}
        summary["published"] = publish_outputs(cfg.pipeline.publish, stores_out, report, say)
    atomic_write(layout.summary, (json.dumps(summary, indent=2, ensure_ascii=False) + "\n").encode(), durable=False)
    return PipelineResult(layout.root, summary)


def changed_settings(cfg: PipelineConfig, layout: PipelineLayout) -> list[str]:
    """The config sections in which `cfg` differs from the one the output at `layout` was made with (none when
    there is no output yet); settings of where the work runs do not count."""
    if not layout.config.is_file():
        return []
    from liandan.config import read_toml

    ours, theirs = _output_defining(cfg.to_dict()), _output_defining(read_toml(layout.config))
    return sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))


def _claim_output(cfg: PipelineConfig, layout: PipelineLayout, overwrite: bool) -> None:
    """Refuse to mix the output of two different configs; a matching one resumes."""
    import shutil

    if layout.config.is_file() and not overwrite:
        changed = changed_settings(cfg, layout)
        if changed:
            raise DataError(
                f"{layout.root} holds the output of another pipeline config (differs in: {', '.join(changed)}); "
                "use another pipeline.output, or --overwrite to start over"
            )
    elif layout.config.is_file() and overwrite:
        for target in layout.starting_over([i.name for i in cfg.inputs]):
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    layout.state_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(layout.config, cfg.to_toml().encode(), durable=False)


def _output_defining(raw: dict[str, Any]) -> dict[str, Any]:
    raw = copy.deepcopy(raw)
    for key in _RUNTIME_KEYS:
        raw.get("pipeline", {}).pop(key, None)
    return raw


def _merge_read(reads: list[dict[str, Any]]) -> dict[str, Any]:
    from collections import Counter

    skipped: Counter = Counter()
    for r in reads:
        skipped.update(r["skipped"])
    return {
        "documents": sum(r["documents"] for r in reads),
        "characters": sum(r["characters"] for r in reads),
        "skipped": dict(sorted(skipped.items())),
    }
