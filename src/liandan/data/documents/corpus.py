"""Raw text documents: the `Document` type, `DataError`, the counts of a read, and the built-in corpus that
ships with Python. Reading the user's files is `liandan.data.documents.readers`, which builds on these types.
"""

from __future__ import annotations

import ast
import sysconfig
from collections import Counter, deque
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


def write_python_docs(path: Path) -> ReadStats:
    """The Python documentation corpus as a .jsonl of {"id", "text"} records, so the pipeline reads it as it
    reads any file. Written whole or not at all."""
    import json

    from liandan.run import atomic_file

    stats = ReadStats()
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "w", durable=False) as handle:
        for doc in python_docs_corpus(stats):
            handle.write(json.dumps({"id": doc.doc_id, "text": doc.text}, ensure_ascii=False) + "\n")
    return stats


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
    parts = [doc for node in _statements(tree) if isinstance(node, kinds) and (doc := ast.get_docstring(node))]
    return "\n\n".join(p for p in parts if len(p) >= min_chars)


# What can hold a statement: a definition is never inside an expression (a lambda is not one).
_BODIES = (ast.stmt, ast.excepthandler, ast.match_case)


def _statements(tree: ast.Module) -> Iterator[ast.AST]:
    """`ast.walk`'s nodes in its (breadth-first) order, less every expression and what is inside it: the same
    definitions in the same order, at a fraction of the nodes."""
    todo = deque([tree])
    while todo:
        node = todo.popleft()
        todo.extend(child for child in ast.iter_child_nodes(node) if isinstance(child, _BODIES))
        yield node
