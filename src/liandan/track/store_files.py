"""Reading a run directory's files for the run store: the complete JSON-lines records written since the last
read, found by byte offset and checked by a hash of the bytes before it, and the few numbers the store takes
from the config and the summary."""

from __future__ import annotations

import contextlib
import math
import sqlite3
from pathlib import Path
from typing import Any

import xxhash

from liandan.config import ConfigError, read_toml
from liandan.run import RunDir, parse_line

TAIL = 256  # bytes before the offset whose hash tells a grown file from a rewritten one


def read_new(db: sqlite3.Connection, name: str, path: Path, table: str) -> list[tuple[dict, int]]:
    """The records of the complete lines of `path` written since the last ingest, each with its byte offset;
    the file's offset row moves past them. A file that no longer holds the bytes read before (rewritten,
    truncated, removed) drops the run's rows of `table` and is read from its start. One read of the file
    gives both the check and the new lines, so a writer that rewrites it meanwhile cannot mix the two."""
    row = db.execute("SELECT offset, tail FROM files WHERE run = ? AND file = ?", (name, path.name)).fetchone()
    offset, tail = (row[0], row[1]) if row else (0, "")
    begin = max(0, offset - TAIL)
    try:
        with path.open("rb") as handle:
            handle.seek(begin)
            data = handle.read()
            if offset and (len(data) < offset - begin or hash(data[: offset - begin]) != tail):
                db.execute(f"DELETE FROM {table} WHERE run = ?", (name,))
                offset = begin = 0
                handle.seek(0)
                data = handle.read()
    except FileNotFoundError:
        if row:
            db.execute(f"DELETE FROM {table} WHERE run = ?", (name,))
            db.execute("DELETE FROM files WHERE run = ? AND file = ?", (name, path.name))
        return []
    known = offset - begin  # bytes of `data` already read
    end = data.rfind(b"\n") + 1
    if end <= known:
        return []
    records, position = [], offset
    for line in data[known:end].split(b"\n")[:-1]:
        record = parse_line(line.decode("utf-8", errors="replace"))
        if record is not None:
            records.append((record, position))
        position += len(line) + 1
    db.execute("INSERT OR REPLACE INTO files VALUES (?, ?, ?, ?)",
               (name, path.name, begin + end, hash(data[max(0, end - TAIL) : end])))  # fmt: skip
    return records


SKIP = object()


NON_FINITE = ("nan", "inf", "-inf", "NaN", "Infinity", "-Infinity")  # as files written before null said it


def number(value: Any) -> Any:
    """A metric value as SQLite keeps it: numbers as they are (non-finite ones, written as null, as NULL);
    anything else is not a metric."""
    if value is None or value in NON_FINITE:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return SKIP
    return value if math.isfinite(value) else None


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def real(value: Any) -> float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def positive(value: Any) -> Any:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def hash(data: bytes) -> str:
    return xxhash.xxh64_hexdigest(data)


def tokens_per_step(config: Path) -> int | None:
    try:
        train = read_toml(config).get("train", {})
        return int(train["global_batch"]) * int(train["seq_len"])
    except (ConfigError, KeyError, TypeError, ValueError, AttributeError):
        return None


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def newest_change(room: RunDir) -> float:
    times = []
    for path in (room.metrics, room.events, room.summary):
        with contextlib.suppress(OSError):
            times.append(path.stat().st_mtime)
    return max(times, default=0.0)
