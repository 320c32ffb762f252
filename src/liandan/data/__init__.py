"""Data: raw documents to the token sequences the trainer reads."""

from liandan.data.corpus import DataError, Document, ReadStats, python_docs_corpus, read_documents
from liandan.data.loader import Batch, DocumentRef, MixtureSchedule, PackedLoader
from liandan.data.store import ShardInfo, TokenStore, shard_path, verify_store, write_manifest, write_shard
from liandan.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer, train_bpe

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
