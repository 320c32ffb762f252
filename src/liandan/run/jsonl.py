"""Reading a run's JSON-lines files while they may still be written: a half-written last line is left for
the next read, a malformed line is skipped and counted, never fatal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path, default: Any = None) -> Any:
    """A whole JSON file, or `default` when it is missing, unreadable or not JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return default


def _records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    records, bad = [], 0
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            bad += 1
            continue
        if isinstance(record, dict):
            records.append(record)
        else:
            bad += 1
    return records, bad


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete record of a JSON-lines file (none when it does not exist)."""
    return JsonlTail(path).read()


class JsonlTail:
    """Follows a JSON-lines file: each `read()` returns the records completed since the last one. A file
    that shrank (rewritten from the start, as a resume truncates metrics) is read again from its beginning."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.skipped = 0  # malformed lines seen so far

    def read(self) -> list[dict[str, Any]]:
        try:
            with self.path.open("rb") as handle:
                size = handle.seek(0, 2)
                if size < self.offset:
                    self.offset = 0
                handle.seek(self.offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.offset += end
        records, bad = _records(data[:end])
        self.skipped += bad
        return records
