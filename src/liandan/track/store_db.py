"""The SQLite side of the run store: its schema, transactions, and the locks that keep writers (several
processes, and several threads of one) out of each other's way."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path

SCHEMA_VERSION = 1
TABLES = ("runs", "metrics", "events", "files")

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    name TEXT PRIMARY KEY,
    path TEXT NOT NULL,
    config TEXT,
    summary TEXT,
    status TEXT NOT NULL DEFAULT 'unknown',
    started REAL,
    updated REAL,
    last_step INTEGER,
    tokens_per_step INTEGER,
    flops_per_token REAL
);
CREATE TABLE IF NOT EXISTS metrics (
    run TEXT NOT NULL, key TEXT NOT NULL, step INTEGER NOT NULL, value REAL,
    PRIMARY KEY (run, key, step)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS events (
    run TEXT NOT NULL, seq INTEGER NOT NULL, time REAL, kind TEXT NOT NULL, step INTEGER, body TEXT NOT NULL,
    PRIMARY KEY (run, seq)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS events_by_kind ON events (run, kind);
CREATE TABLE IF NOT EXISTS files (
    run TEXT NOT NULL, file TEXT NOT NULL, offset INTEGER NOT NULL, tail TEXT NOT NULL,
    PRIMARY KEY (run, file)
) WITHOUT ROWID;
"""


def one_at_a_time(method):
    """One call at a time on the store's connection: a server answers requests from several threads, and two
    of them must not interleave inside one transaction."""

    @functools.wraps(method)
    def serialised(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return serialised


def schema_version(db: sqlite3.Connection) -> int | None:
    if db.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'meta'").fetchone() is None:
        return None
    row = db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
    return int(row[0]) if row else None


def readable(path: Path) -> bool:
    """Whether the file is an SQLite database whose pages hold together."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True)) as db:
            return db.execute("PRAGMA quick_check").fetchone()[0] == "ok"
    except sqlite3.DatabaseError:
        return False


def marks(items: tuple) -> str:
    return ", ".join("?" * len(items))


def statements() -> list[str]:
    return [s.strip() for s in SCHEMA.split(";") if s.strip()]


@contextlib.contextmanager
def transaction(db: sqlite3.Connection, immediate: bool = False) -> Iterator[None]:
    db.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


@contextlib.contextmanager
def nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on the project directory itself (no file of its own to leave behind)."""
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
