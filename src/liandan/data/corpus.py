"""Reading raw text documents: the user's .txt/.jsonl files, or the built-in corpus that ships with Python.

This is the minimal reader the trainer needs; malformed records are counted and skipped with the reason,
never fatal and never silent.
"""

from __future__ import annotations

import ast
import json
import sysconfig
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """A user-facing data problem (missing file, nothing readable); the CLI prints it as one line."""


@dataclass
class Document:
    source: str
    doc_id: str
    text: str
    # What the pipeline learned about the document on the way (language, scores, ...): JSON-serializable.
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReadStats:
    documents: int = 0
    characters: int = 0
    skipped: Counter = field(default_factory=Counter)

    def summary(self) -> str:
        skipped = ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) or "none"
        return f"{self.documents} documents, {self.characters:,} characters; skipped: {skipped}"


def read_documents(paths: list[str], text_field: str = "text", stats: ReadStats | None = None) -> Iterator[Document]:
    """Documents from .txt (one document per file) and .jsonl (one per line) files, in the order given."""
    stats = stats if stats is not None else ReadStats()
    for name in paths:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"data file not found: {path}")
        if path.suffix == ".jsonl":
            yield from _read_jsonl(path, text_field, stats)
        elif path.suffix in (".txt", ".md", ".text", ""):
            raw = path.read_bytes()
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                stats.skipped[f"invalid UTF-8 in {path.name} at byte {err.start}"] += 1
                continue
            if text.strip():
                stats.documents += 1
                stats.characters += len(text)
                yield Document(str(path), path.stem, text)
            else:
                stats.skipped["empty document"] += 1
        else:
            raise DataError(f"unsupported data file type '{path.suffix}' for {path}; use .txt or .jsonl")


def _read_jsonl(path: Path, text_field: str, stats: ReadStats) -> Iterator[Document]:
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, 1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                stats.skipped["invalid UTF-8"] += 1
                continue
            except json.JSONDecodeError:
                stats.skipped["malformed JSON"] += 1
                continue
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                stats.skipped[f"no string field '{text_field}'"] += 1
                continue
            if not text.strip():
                stats.skipped["empty document"] += 1
                continue
            stats.documents += 1
            stats.characters += len(text)
            doc_id = str(record.get("id", f"{path.stem}:{number}"))
            yield Document(str(path), doc_id, text)


# Parts of the standard library that are tests, demos or GUI code rather than prose-bearing modules.
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__"}


def python_docs_corpus(stats: ReadStats | None = None) -> Iterator[Document]:
    """Real English prose that every Python installation carries: the language reference topics of
    `pydoc_data` and the docstrings of the standard library (parsed, never imported). Deterministic for a
    given Python version."""
    stats = stats if stats is not None else ReadStats()
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data
        topics = {}
    for name in sorted(topics):
        yield _counted(Document("pydoc_data.topics", name, topics[name]), stats)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if _SKIP_DIRS.intersection(rel.parts):
            continue
        text = _module_docstrings(path)
        if text:
            yield _counted(Document("python-stdlib", ".".join(rel.with_suffix("").parts), text), stats)


def _counted(doc: Document, stats: ReadStats) -> Document:
    stats.documents += 1
    stats.characters += len(doc.text)
    return doc


def _module_docstrings(path: Path, min_chars: int = 80) -> str:
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError, OSError):
        return ""
    kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    parts = [doc for node in ast.walk(tree) if isinstance(node, kinds) and (doc := ast.get_docstring(node))]
    return "\n\n".join(p for p in parts if len(p) >= min_chars)
