"""From the `[data]` config to the token stores a run trains on.

`[data] stores` names stores written by the data pipeline; they are opened as they are. Otherwise the run
reads `[data] paths` (or the Python documentation corpus), makes its tokenizer and writes a one-shard store
into its own data directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from liandan.config import DataSection
from liandan.data.corpus import DataError, Document, ReadStats, python_docs_corpus, read_documents
from liandan.data.store import TokenStore, shard_path, write_manifest, write_shard
from liandan.data.tokenizer import Tokenizer, make_tokenizer


def load_documents(cfg: DataSection, stats: ReadStats) -> list[Document]:
    if cfg.paths:
        return list(read_documents(cfg.paths, cfg.text_field, stats))
    return list(python_docs_corpus(stats))


def prepare_store(cfg: DataSection, out_dir: Path, say: Callable[[str], None] = print) -> tuple[TokenStore, Tokenizer]:
    """Tokenize the configured documents into a one-shard store at `out_dir` (with its tokenizer.json)."""
    stats = ReadStats()
    docs = load_documents(cfg, stats)
    source = ", ".join(cfg.paths) if cfg.paths else "the Python documentation corpus (pydoc topics + stdlib docstrings)"
    say(f"read {source}: {stats.summary()}")
    if not docs:
        raise DataError(f"{source} holds no documents to train on")
    tokenizer = make_tokenizer(cfg.tokenizer, (d.text for d in docs), cfg.bpe_vocab_size)
    shard = write_shard(docs, tokenizer, shard_path(out_dir, 0))
    write_manifest(out_dir, [shard], tokenizer)
    say(f"tokenized with {cfg.tokenizer} (vocabulary {tokenizer.vocab_size}): {shard.tokens:,} tokens")
    return TokenStore(out_dir), tokenizer


def open_prepared(out_dir: Path) -> tuple[TokenStore, Tokenizer]:
    store = TokenStore(out_dir)
    return store, store.tokenizer


def open_stores(
    paths: list[str], cache_dir: str = "", say: Callable[[str], None] | None = None
) -> tuple[list[TokenStore], Tokenizer]:
    """The stores of `[data] stores`, which must all share one tokenizer, and that tokenizer. A store named by
    URL is first copied into the shard cache (`[data] cache_dir`), then opened from there like any other."""
    from liandan.data.storage import local_store

    if not paths:
        raise DataError("no token stores given")
    local = [local_store(p, cache_dir, say) for p in paths]
    stores = [TokenStore(local[0])]
    stores += [TokenStore(p, expect_tokenizer=stores[0].fingerprint) for p in local[1:]]
    return stores, stores[0].tokenizer
