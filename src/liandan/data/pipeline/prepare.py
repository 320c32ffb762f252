"""From the `[data]` config to the token stores a run trains on.

`[data] stores` names stores written by the data pipeline; they are opened as they are. Otherwise the run
reads `[data] paths` (or the Python documentation corpus) through the same stages as `liandan data run`
(`data_pipeline`: no cleaning steps, no dedup, no report), with its store written straight into the run's
data directory and the stages' own files under data/pipeline/, so an interrupted preparation resumes.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from liandan.config import DataSection
from liandan.data.documents.corpus import ReadStats, write_python_docs
from liandan.data.pipeline.layout import PipelineLayout
from liandan.data.pipeline.pipeline_config import (
    DedupSection,
    InputSpec,
    PipelineConfig,
    PipelineSection,
    TokenizerSection,
)
from liandan.data.tokens.store import TokenStore
from liandan.data.tokens.tokenizer import Tokenizer

STORE = "corpus"  # the one input, and so the one store, of a run's own data


def data_pipeline(cfg: DataSection, out_dir: Path) -> tuple[PipelineConfig, PipelineLayout]:
    """The pipeline that makes a run's store from `[data]`: every document of every file, in order, into one
    store at `out_dir`, tokenized by `[data] tokenizer` (a BPE trains on all of them). Each document names its
    file as its source. The cleaned documents are kept as plain .jsonl, so training needs no extra."""
    out_dir = Path(out_dir)
    layout = PipelineLayout(out_dir / "pipeline", store_dirs={STORE: out_dir}, compress=False)
    paths = list(cfg.paths) or [str(layout.python_docs)]
    pipeline = PipelineConfig(
        pipeline=PipelineSection(output=str(layout.root), workers=1, inspect=False),
        inputs=[InputSpec(name=STORE, paths=paths, text_field=cfg.text_field, provenance="file")],
        dedup=DedupSection(exact=False, near=False),
        tokenizer=TokenizerSection(kind=cfg.tokenizer, vocab_size=cfg.bpe_vocab_size, sample_documents=sys.maxsize),
    )
    pipeline.check()
    return pipeline, layout


def prepare_store(cfg: DataSection, out_dir: Path, say: Callable[[str], None] = print) -> tuple[TokenStore, Tokenizer]:
    """Tokenize the configured documents into a store at `out_dir` (with its tokenizer.json), resuming what an
    earlier call with the same `[data]` left; one with another `[data]` starts over."""
    from liandan.data.pipeline.pipeline import changed_settings, run_pipeline

    pipeline, layout = data_pipeline(cfg, out_dir)
    if not cfg.paths and not layout.python_docs.is_file():
        write_python_docs(layout.python_docs)
    source = ", ".join(cfg.paths) if cfg.paths else "the Python documentation corpus (pydoc topics + stdlib docstrings)"
    starting_over = bool(changed_settings(pipeline, layout))
    summary = run_pipeline(pipeline, overwrite=starting_over, say=say, layout=layout, progress=False).summary
    read = summary["read"]
    say(f"read {source}: {ReadStats(read['documents'], read['characters'], Counter(read['skipped'])).summary()}")
    store = summary["stores"][STORE]
    say(f"tokenized with {cfg.tokenizer} (vocabulary {summary['tokenizer']['vocab_size']}): {store['tokens']:,} tokens")
    return open_prepared(out_dir)


def open_prepared(out_dir: Path) -> tuple[TokenStore, Tokenizer]:
    store = TokenStore(out_dir)
    return store, store.tokenizer


def open_stores(
    paths: list[str], cache_dir: str = "", say: Callable[[str], None] | None = None
) -> tuple[list[TokenStore], Tokenizer]:
    """The stores of `[data] stores`, which must all share one tokenizer, and that tokenizer. A store named by
    URL is first copied into the shard cache (`[data] cache_dir`), then opened from there like any other."""
    from liandan.data.documents.corpus import DataError
    from liandan.data.tokens.cache import local_store

    if not paths:
        raise DataError("no token stores given")
    local = [local_store(p, cache_dir, say) for p in paths]
    stores = [TokenStore(local[0])]
    stores += [TokenStore(p, expect_tokenizer=stores[0].fingerprint) for p in local[1:]]
    return stores, stores[0].tokenizer
