"""`liandan data run`: raw text to token stores, in stages that each write their output and a done marker, so a
crashed run resumes without redoing finished work.

    1. clean      per input file, in parallel: read -> steps (normalize, filters, language, decontamination)
                  -> clean/<task>.jsonl.zst, a rejects file with the reason for every dropped record, and
                  the document hashes and MinHash signatures dedup needs
    2. dedup      once: exact and near duplicates across all sources -> dedup/<task>.remove.npy
    3. tokenizer  once: byte-level BPE trained on an even sample of the kept documents (or a given one)
    4. tokenize   per input file, in parallel: kept documents -> a shard of the source's token store
    5. manifest   per source: stores/<source>/manifest.json with every shard's checksum
    6. inspect    the report of the final corpus, with anomaly flags

The output directory is laid out as:
    pipeline.toml    the resolved config this output was made with (a different config refuses to resume)
    clean/ dedup/ tokenizer/ stores/<source>/ report/ state/ summary.json
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

from liandan.data.corpus import DataError, Document, ReadStats
from liandan.data.executor import make_executor
from liandan.data.pipeline_config import PipelineConfig, expand_paths
from liandan.data.steps import Step, StepStats, build_step
from liandan.faults import maybe_inject
from liandan.run import atomic_file, atomic_write, replacing

# Settings that change where the work runs, never what it writes: a resumed run may change them.
_RUNTIME_KEYS = ("executor", "workers", "ray_address", "inspect", "baseline")


@dataclass(frozen=True)
class Task:
    index: int
    source: str
    path: str
    text_field: str
    txt_mode: str

    @property
    def name(self) -> str:
        return f"{self.index:05d}"


def plan_tasks(cfg: PipelineConfig) -> list[Task]:
    tasks: list[Task] = []
    for spec in cfg.inputs:
        for path in expand_paths(spec):
            tasks.append(Task(len(tasks), spec.name, str(path), spec.text_field, spec.txt_mode))
    return tasks


# -- files (not fsync'd: a crashed stage is redone from its done markers) ----------------------------------------------
def _write_json(path: Path, value: Any) -> None:
    atomic_write(path, (json.dumps(value, indent=2, ensure_ascii=False) + "\n").encode(), durable=False)


class _JsonlZstWriter:
    """Lines of JSON into a .jsonl.zst written under a temporary name and renamed when complete."""

    def __init__(self, path: Path):
        import zstandard

        self.path = path
        self._files = contextlib.ExitStack()  # renames the file into place when close() closes it
        self._file = self._files.enter_context(atomic_file(path, "wb", durable=False))
        self._stream = zstandard.ZstdCompressor(level=3).stream_writer(self._file)
        self.count = 0

    def write(self, record: dict[str, Any]) -> None:
        self._stream.write((json.dumps(record, ensure_ascii=False) + "\n").encode())
        self.count += 1

    def close(self) -> None:
        self._stream.close()  # also closes the file
        self._files.close()


def read_jsonl_zst(path: Path) -> Iterator[dict[str, Any]]:
    import zstandard

    with open(path, "rb") as raw:
        reader = io.TextIOWrapper(zstandard.ZstdDecompressor().stream_reader(raw), encoding="utf-8")
        for line in reader:
            yield json.loads(line)


def _doc_record(doc: Document) -> dict[str, Any]:
    return {"source": doc.source, "id": doc.doc_id, "text": doc.text, "meta": doc.meta}


def read_clean(path: Path) -> Iterator[Document]:
    for r in read_jsonl_zst(path):
        yield Document(r["source"], r["id"], r["text"], r["meta"])


# -- stage 1: clean --------------------------------------------------------------------------------------------
def make_steps(specs: list[dict[str, Any] | Step]) -> list[Step]:
    steps = []
    for spec in specs:
        step = build_step(spec) if isinstance(spec, dict) else copy.deepcopy(spec)
        step.stats = StepStats(step.name)
        steps.append(step)
    return steps


def clean_task(cfg: PipelineConfig, task: Task, out: Path) -> dict[str, Any]:
    from liandan.data.dedup import MinHasher, exact_hashes
    from liandan.data.readers import read_file

    stats_path = out / "clean" / f"{task.name}.stats.json"
    if stats_path.is_file():
        return json.loads(stats_path.read_text())
    (out / "clean").mkdir(parents=True, exist_ok=True)
    steps = make_steps(cfg.steps)
    kept = _JsonlZstWriter(out / "clean" / f"{task.name}.jsonl.zst")
    rejects = _JsonlZstWriter(out / "clean" / f"{task.name}.rejects.jsonl.zst")

    def on_drop(doc: Document, step: str, reason: str) -> None:
        rejects.write({"step": step, "reason": reason, **_doc_record(doc)})

    for step in steps:
        step.on_drop = on_drop
    read_stats = ReadStats()
    docs: Iterator[Document] = read_file(
        Path(task.path),
        source=task.source,
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
        batch.append(doc.text)
        if len(batch) == 1024:
            flush()
    flush()
    kept.close()
    rejects.close()
    if cfg.dedup.exact:
        _save_npy(out / "clean" / f"{task.name}.exact.npy", np.concatenate(hashes))
    if hasher is not None:
        _save_npy(out / "clean" / f"{task.name}.minhash.npy", np.concatenate(signatures))
    result = {
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
    maybe_inject("clean", task.index)
    _write_json(stats_path, result)  # last: its presence marks the task done
    return result


def _save_npy(path: Path, array: np.ndarray) -> None:
    buffer = io.BytesIO()
    np.save(buffer, array)
    atomic_write(path, buffer.getvalue(), durable=False)


def dedup_params(cfg: PipelineConfig):
    from liandan.data.dedup import NearDedupParams

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


# -- stage 2: dedup --------------------------------------------------------------------------------------------
def dedup_stage(cfg: PipelineConfig, tasks: list[Task], out: Path, counts: list[int]) -> dict[str, Any]:
    from liandan.data.dedup import ShardTexts, find_duplicates

    stats_path = out / "dedup" / "stats.json"
    if stats_path.is_file():
        return json.loads(stats_path.read_text())
    (out / "dedup").mkdir(parents=True, exist_ok=True)
    total = sum(counts)
    if cfg.dedup.exact or cfg.dedup.near:
        exact = [out / "clean" / f"{t.name}.exact.npy" for t in tasks] if cfg.dedup.exact else []
        near = [out / "clean" / f"{t.name}.minhash.npy" for t in tasks] if cfg.dedup.near else []
        texts = ShardTexts([out / "clean" / f"{t.name}.jsonl.zst" for t in tasks], counts)
        executor = make_executor(cfg.pipeline.executor, cfg.dedup.workers, cfg.pipeline.ray_address)
        try:
            result = find_duplicates(
                exact, near, dedup_params(cfg), out / "dedup" / "work", texts, cfg.dedup.workers, executor
            )
        finally:
            executor.close()
        remove, cluster_of, stats = result.remove, result.cluster_of, dict(result.stats)
    else:
        remove, cluster_of, stats = np.zeros(total, bool), np.full(total, -1, np.int64), {"documents": total}
    offsets = np.concatenate([[0], np.cumsum(counts)])
    for t, lo, hi in zip(tasks, offsets[:-1], offsets[1:]):
        _save_npy(out / "dedup" / f"{t.name}.remove.npy", remove[lo:hi])
        _save_npy(out / "dedup" / f"{t.name}.cluster.npy", cluster_of[lo:hi])
    stats["removed"] = int(remove.sum())
    _write_json(stats_path, stats)
    return stats


def kept_documents(task: Task, out: Path) -> Iterator[Document]:
    remove = np.load(out / "dedup" / f"{task.name}.remove.npy")
    for doc, removed in zip(read_clean(out / "clean" / f"{task.name}.jsonl.zst"), remove):
        if not removed:
            yield doc


# -- stage 3: tokenizer ----------------------------------------------------------------------------------------
def tokenizer_stage(cfg: PipelineConfig, tasks: list[Task], out: Path, kept: int, say: Callable[[str], None]):
    from liandan.data.tokenizer import load_tokenizer, train_bpe

    path = out / "tokenizer" / "tokenizer.json"
    if cfg.tokenizer.kind != "bpe":
        return load_tokenizer(cfg.tokenizer.kind)
    if path.is_file():
        return load_tokenizer(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    stride = max(1, kept // cfg.tokenizer.sample_documents)

    def sample() -> Iterator[str]:
        index = 0
        for task in tasks:
            for doc in kept_documents(task, out):
                if index % stride == 0:
                    yield doc.text
                index += 1

    say(f"training a {cfg.tokenizer.vocab_size}-token BPE on every {stride} of {kept:,} documents")
    tokenizer = train_bpe(sample(), cfg.tokenizer.vocab_size, cfg.tokenizer.special_tokens)
    with replacing(path, durable=False) as tmp:
        tokenizer.save(tmp)
    return tokenizer


# -- stage 4 and 5: tokenize, manifests --------------------------------------------------------------------------
def tokenize_task(task: Task, out: Path, tokenizer_spec: str) -> dict[str, Any]:
    from liandan.data.store import write_shard
    from liandan.data.tokenizer import load_tokenizer

    done = out / "state" / f"tokenize-{task.name}.json"
    if done.is_file():
        return json.loads(done.read_text())
    tokenizer = load_tokenizer(tokenizer_spec)
    store_dir = out / "stores" / task.source
    store_dir.mkdir(parents=True, exist_ok=True)
    info = write_shard(kept_documents(task, out), tokenizer, store_dir / f"shard-{task.name}")
    result = info.to_dict()
    maybe_inject("tokenize", task.index)
    _write_json(done, result)
    return result


def _tokenizer_spec(cfg: PipelineConfig, out: Path) -> str:
    if cfg.tokenizer.kind == "bpe":
        return str(out / "tokenizer" / "tokenizer.json")
    return cfg.tokenizer.kind


# -- the whole run ---------------------------------------------------------------------------------------------
@dataclass
class PipelineResult:
    output: Path
    summary: dict[str, Any]


def run_pipeline(cfg: PipelineConfig, overwrite: bool = False, say: Callable[[str], None] = print) -> PipelineResult:
    from liandan.data.store import ShardInfo, write_manifest

    out = Path(cfg.pipeline.output)
    _claim_output(cfg, out, overwrite)
    tasks = plan_tasks(cfg)
    say(f"{len(tasks)} input file(s) from {len(cfg.inputs)} source(s) -> {out}")
    executor = make_executor(cfg.pipeline.executor, cfg.pipeline.workers, cfg.pipeline.ray_address)
    try:
        cleaned = executor.map(clean_task, [(cfg, t, out) for t in tasks], "clean")
        counts = [c["documents"] for c in cleaned]
        dedup = dedup_stage(cfg, tasks, out, counts)
        kept = sum(counts) - dedup["removed"]
        if kept == 0:
            raise DataError(
                "no document survived cleaning and deduplication; see the rejects files under " + str(out / "clean")
            )
        tokenizer = tokenizer_stage(cfg, tasks, out, kept, say)
        spec = _tokenizer_spec(cfg, out)
        shards = executor.map(tokenize_task, [(t, out, spec) for t in tasks], "tokenize")
    finally:
        executor.close()
    stores = {}
    for source in [i.name for i in cfg.inputs]:
        infos = [ShardInfo.from_dict(s) for s, t in zip(shards, tasks) if t.source == source]
        write_manifest(out / "stores" / source, infos, tokenizer)
        stores[source] = {
            "path": str(out / "stores" / source),
            "documents": sum(i.documents for i in infos),
            "tokens": sum(i.tokens for i in infos),
        }
    summary = {
        "output": str(out),
        "tasks": len(tasks),
        "read": _merge_read([c["read"] for c in cleaned]),
        "steps": [s.to_dict() for s in _merge_steps(cleaned)],
        "rejected": sum(c["rejected"] for c in cleaned),
        "dedup": dedup,
        "tokenizer": {"spec": spec, "vocab_size": tokenizer.vocab_size, "fingerprint": tokenizer.fingerprint()},
        "stores": stores,
    }
    if cfg.pipeline.inspect:
        summary["report"] = _inspect(cfg, tasks, out, summary, tokenizer)
    _write_json(out / "summary.json", summary)
    return PipelineResult(out, summary)


def _claim_output(cfg: PipelineConfig, out: Path, overwrite: bool) -> None:
    """Refuse to mix the output of two different configs; a matching one resumes."""
    resolved = out / "pipeline.toml"
    ours = _output_defining(cfg.to_dict())
    if resolved.is_file() and not overwrite:
        from liandan.config import read_toml

        theirs = _output_defining(read_toml(resolved))
        if theirs != ours:
            changed = sorted(k for k in set(ours) | set(theirs) if ours.get(k) != theirs.get(k))
            raise DataError(
                f"{out} holds the output of another pipeline config (differs in: {', '.join(changed)}); "
                "use another pipeline.output, or --overwrite to start over"
            )
    elif resolved.is_file() and overwrite:
        import shutil

        for child in ("clean", "dedup", "tokenizer", "stores", "state", "report", "summary.json"):
            target = out / child
            shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "state").mkdir(exist_ok=True)
    atomic_write(resolved, cfg.to_toml().encode(), durable=False)


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


def _merge_steps(cleaned: list[dict[str, Any]]) -> list[StepStats]:
    merged: list[StepStats] = []
    for c in cleaned:
        for i, s in enumerate(c["steps"]):
            stats = StepStats.from_dict(s)
            if i == len(merged):
                merged.append(stats)
            else:
                merged[i].merge(stats)
    return merged


def _inspect(cfg: PipelineConfig, tasks: list[Task], out: Path, summary: dict[str, Any], tokenizer) -> dict[str, Any]:
    from liandan.data.inspection import inspect_sources

    def source_docs(name: str) -> Iterator[Document]:
        for t in tasks:
            if t.source == name:
                yield from kept_documents(t, out)

    report = inspect_sources(
        {i.name: source_docs(i.name) for i in cfg.inputs},
        out / "report",
        step_stats=summary["steps"],
        dedup_stats=summary["dedup"],
        tokenizer=tokenizer,
        baseline=Path(cfg.pipeline.baseline) if cfg.pipeline.baseline else None,
    )
    return {"path": str(out / "report"), "flags": [_flag_text(f) for f in report.flags]}


def _flag_text(flag: Any) -> str:
    return getattr(flag, "message", None) or str(flag)
