"""Data: raw documents to the token sequences the trainer reads, in rooms that import only downwards:

    pipeline/   the stages of `liandan data run` and of a run's own data, executors, publishing
    inspect/    statistics and anomaly flags  |  tokens/  tokenizers, token stores, their cache, the loader
    steps/      cleaning and filtering steps
    dedup/      exact and near dedup
    documents/  Document, DataError, the readers of input files, the words of a text

The names below are re-exported on first use (PEP 562), so that `import liandan.data` imports nothing of
them: a dedup band job or a pipeline worker never loads torch, which only the loader needs.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOMES = {
    "liandan.data.documents.corpus": ("DataError", "Document", "ReadStats", "python_docs_corpus"),
    "liandan.data.documents.readers": ("read_documents",),
    "liandan.data.tokens.loader": ("Batch", "DocumentRef", "MixtureSchedule", "PackedLoader"),
    "liandan.data.tokens.store": (
        "ShardInfo",
        "TokenStore",
        "shard_path",
        "verify_store",
        "write_manifest",
        "write_shard",
    ),
    "liandan.data.tokens.tokenizer": ("ByteTokenizer", "HFTokenizer", "Tokenizer", "make_tokenizer", "train_bpe"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = [
    "Batch",
    "ByteTokenizer",
    "DataError",
    "Document",
    "DocumentRef",
    "HFTokenizer",
    "MixtureSchedule",
    "PackedLoader",
    "ReadStats",
    "ShardInfo",
    "TokenStore",
    "Tokenizer",
    "make_tokenizer",
    "python_docs_corpus",
    "read_documents",
    "shard_path",
    "train_bpe",
    "verify_store",
    "write_manifest",
    "write_shard",
]


def __getattr__(name: str) -> Any:
    module = _HOME_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'liandan.data' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
