"""Data: raw documents to the token sequences the trainer reads."""

from liandan.data.corpus import DataError, Document, ReadStats, python_docs_corpus, read_documents
from liandan.data.loader import Batch, PackedLoader
from liandan.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer, train_bpe
from liandan.data.tokens import TokenArray, write_token_array

__all__ = [
    "Batch",
    "ByteTokenizer",
    "DataError",
    "Document",
    "HFTokenizer",
    "PackedLoader",
    "ReadStats",
    "TokenArray",
    "Tokenizer",
    "make_tokenizer",
    "python_docs_corpus",
    "read_documents",
    "train_bpe",
    "write_token_array",
]
