"""Where every file of a pipeline's output lives. Only this module spells those names; the stages, the
resume logic, the summary and the tests ask a `PipelineLayout`.

    pipeline.toml                   the resolved config this output was made with
    inputs/python-docs.jsonl        the Python documentation corpus, written out when a run trains on it
    clean/<task>-<input>.jsonl.zst  kept documents with their metadata (.jsonl when not compressed), named
                                    by the task and its input file (00001-wiki-part-3)
    clean/<task>-<input>.rejects.jsonl.zst  every dropped record: step, reason, text
    clean/<task>.exact.npy          exact-duplicate hashes; clean/<task>.minhash.npy: MinHash signatures
    dedup/<task>.remove.npy         which documents dedup removes; dedup/<task>.cluster.npy: their clusters
    dedup/work/                     the global phase's scratch files
    tokenizer/tokenizer.json        the trained byte-level BPE
    stores/<source>/                one token store per source: shard-<task>.bin, .docs.jsonl, manifest.json
    report/                         report.html, report.md, report.json
    state/<stage>.json              a whole stage's done marker (its result); state/<stage>-<task>.json: a task's
    summary.json                    the run's totals, written last
    pipeline.lock                   held by the `liandan data run` writing here (never removed)

A task is one input file, named by its index (`00000`). `store_dirs` puts a source's store somewhere else
than stores/<source>/ (a run's own data directory, say); `compress = False` writes the cleaned documents
as plain .jsonl, which needs no zstandard.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass, field
from pathlib import Path

CONFIG = "pipeline.toml"
SUMMARY = "summary.json"
PYTHON_DOCS = "python-docs.jsonl"


@dataclass(frozen=True)
class Task:
    """One input file, the unit of parallel work."""

    index: int
    source: str  # the input: its documents form one token store
    path: str
    text_field: str
    txt_mode: str
    document_source: str  # what its documents name as their source (the input, or the file)

    @property
    def name(self) -> str:
        return f"{self.index:05d}"

    @property
    def label(self) -> str:
        """The task's name with its input file's: what the cleaned shards a person opens are named by
        (`00001-wiki-part-3`)."""
        stem = posixpath.basename(self.path.rstrip("/")).split(".")[0]
        return f"{self.name}-" + (re.sub(r"[^\w-]+", "_", stem).strip("_")[:60] or "input")


@dataclass(frozen=True)
class PipelineLayout:
    root: Path
    store_dirs: dict[str, Path] = field(default_factory=dict)
    compress: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> Path:
        return self.root / CONFIG

    @property
    def summary(self) -> Path:
        return self.root / SUMMARY

    @property
    def lock(self) -> Path:
        return self.root / "pipeline.lock"

    @property
    def python_docs(self) -> Path:
        return self.root / "inputs" / PYTHON_DOCS

    # -- clean --------------------------------------------------------------------------------------------------
    @property
    def clean_dir(self) -> Path:
        return self.root / "clean"

    def _jsonl(self, stem: str) -> Path:
        return self.clean_dir / (f"{stem}.jsonl.zst" if self.compress else f"{stem}.jsonl")

    def kept(self, task: Task) -> Path:
        return self._jsonl(task.label)

    def rejects(self, task: Task) -> Path:
        return self._jsonl(f"{task.label}.rejects")

    @property
    def rejects_glob(self) -> str:
        """The pattern every task's rejects file matches."""
        return str(self._jsonl("*.rejects"))

    def exact_hashes(self, task: Task) -> Path:
        return self.clean_dir / f"{task.name}.exact.npy"

    def minhashes(self, task: Task) -> Path:
        return self.clean_dir / f"{task.name}.minhash.npy"

    # -- dedup --------------------------------------------------------------------------------------------------
    @property
    def dedup_dir(self) -> Path:
        return self.root / "dedup"

    @property
    def dedup_work(self) -> Path:
        return self.dedup_dir / "work"

    def removals(self, task: Task) -> Path:
        return self.dedup_dir / f"{task.name}.remove.npy"

    def clusters(self, task: Task) -> Path:
        return self.dedup_dir / f"{task.name}.cluster.npy"

    # -- tokenizer, stores, report --------------------------------------------------------------------------------
    @property
    def tokenizer(self) -> Path:
        return self.root / "tokenizer" / "tokenizer.json"

    def store(self, source: str) -> Path:
        return Path(self.store_dirs[source]) if source in self.store_dirs else self.root / "stores" / source

    def shard(self, task: Task) -> Path:
        from liandan.data.tokens.store import shard_path

        return shard_path(self.store(task.source), task.index)

    def shard_files(self, task: Task) -> list[Path]:
        from liandan.data.tokens.store import provenance_path

        return [self.shard(task), provenance_path(self.shard(task))]

    def manifest_files(self, source: str) -> list[Path]:
        from liandan.data.tokens.store import MANIFEST, TOKENIZER_FILE

        return [self.store(source) / MANIFEST, self.store(source) / TOKENIZER_FILE]

    @property
    def report_dir(self) -> Path:
        return self.root / "report"

    # -- done markers ----------------------------------------------------------------------------------------------
    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    def done(self, stage: str, task: Task | None = None) -> Path:
        return self.state_dir / (f"{stage}.json" if task is None else f"{stage}-{task.name}.json")

    def starting_over(self, sources: list[str]) -> list[Path]:
        """What `--overwrite` removes: every stage's output, but the inputs written out here."""
        parts = [self.clean_dir, self.dedup_dir, self.tokenizer.parent, self.root / "stores", self.report_dir]
        parts += [self.state_dir, self.summary]
        for source in sources:
            if source in self.store_dirs:
                store = self.store(source)
                parts += self.manifest_files(source) + sorted(store.glob("shard-*"))
        return parts

    def relative(self, path: Path) -> str:
        """`path` as the plan shows it: relative to the output where it lies inside."""
        try:
            return str(Path(path).relative_to(self.root))
        except ValueError:
            return str(path)
