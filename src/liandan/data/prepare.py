"""From the `[data]` config to a token array on disk: read, (train a) tokenizer, tokenize.

This is the minimal path the trainer uses until the full data pipeline produces token stores; the trainer
only ever sees the resulting `TokenArray` through `PackedLoader`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from liandan.config import DataSection
from liandan.data.corpus import Document, ReadStats, python_docs_corpus, read_documents
from liandan.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer
from liandan.data.tokens import TokenArray, write_token_array


def load_documents(cfg: DataSection, stats: ReadStats) -> list[Document]:
    if cfg.paths:
        return list(read_documents(cfg.paths, cfg.text_field, stats))
    return list(python_docs_corpus(stats))


def prepare_tokens(cfg: DataSection, out_dir: Path, say: Callable[[str], None] = print) -> tuple[TokenArray, Tokenizer]:
    """Write `out_dir/tokenizer.json` and the token array under `out_dir/tokens/`."""
    stats = ReadStats()
    docs = load_documents(cfg, stats)
    source = ", ".join(cfg.paths) if cfg.paths else "the Python documentation corpus (pydoc topics + stdlib docstrings)"
    say(f"read {source}: {stats.summary()}")
    tokenizer = make_tokenizer(cfg.tokenizer, (d.text for d in docs), cfg.bpe_vocab_size)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out_dir / "tokenizer.json")
    array = write_token_array(docs, tokenizer, out_dir / "tokens")
    say(f"tokenized with {cfg.tokenizer} (vocabulary {tokenizer.vocab_size}): {len(array):,} tokens")
    return array, tokenizer


def open_prepared(out_dir: Path) -> tuple[TokenArray, Tokenizer]:
    array = TokenArray(out_dir / "tokens")
    if array.meta["tokenizer"] == ByteTokenizer().fingerprint():
        return array, ByteTokenizer()
    return array, HFTokenizer.load(out_dir / "tokenizer.json")
