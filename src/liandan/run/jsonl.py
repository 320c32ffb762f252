"""Reading a run's JSON-lines files while they may still be written: a half-written last line is left for
the next read, a malformed line is skipped and counted, never fatal."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from liandan.run.files import naming

# Deeper than this no record of liandan's goes; a parser, an encoder or any walk over a value recurses once per
# level, and a few thousand levels (a few kilobytes of brackets) end in RecursionError.
MAX_DEPTH = 64


def nested_too_deeply(text: str, value: Any) -> bool:
    """Whether a parsed value is nested more than MAX_DEPTH levels (counted only when its text could be)."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:
        return False
    level = [(value, 1)]
    while level:
        item, depth = level.pop()
        if depth > MAX_DEPTH:
            return True
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        level.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


def loads_bounded(text: str) -> Any:
    """`json.loads`, with ValueError (not RecursionError, nor a value no walk can take) for nesting deeper
    than MAX_DEPTH."""
    try:
        value = json.loads(text)
    except RecursionError:
        value, text = None, "[" * (MAX_DEPTH + 1)
    if text.count("[") + text.count("{") > MAX_DEPTH and (value is None or nested_too_deeply(text, value)):
        raise ValueError(f"nested more than {MAX_DEPTH} deep")
    return value


def read_json(path: Path, default: Any = None) -> Any:
    """A whole JSON file, or `default` when it is missing, unreadable, not JSON or nested absurdly deep."""
    try:
        return loads_bounded(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return default


def load_json_object(path: Path) -> dict[str, Any]:
    """A whole JSON file that must hold an object, for a reader that reports what is wrong with it:
    FileNotFoundError when it is missing, ValueError saying why in a few words when it is not UTF-8 text, not
    JSON or not an object."""
    try:
        value = loads_bounded(Path(path).read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"not valid JSON ({err.msg}, line {err.lineno})") from None
    except ValueError as err:
        raise ValueError(f"not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object")  # noqa: TRY004 - one error for every way the contents are wrong
    return value


def parse_line(line: str) -> dict[str, Any] | None:
    """One JSON-lines record, or None for a blank line, one that a crash or a full disk left half-written,
    or anything else that is not a JSON object."""
    try:
        record = loads_bounded(line) if line.strip() else None
    except ValueError:  # JSONDecodeError is one
        return None
    return record if isinstance(record, dict) else None


def _records(data: bytes) -> tuple[list[dict[str, Any]], int]:
    records, bad = [], 0
    for line in data.decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        record = parse_line(line)
        if record is None:
            bad += 1
        else:
            records.append(record)
    return records, bad


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file (none when it does not exist or cannot be read). A last line
    without its newline counts when it is a whole record, and is skipped when it was cut off."""
    return JsonlTail(path).read(final=True)


def keep_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool]) -> None:
    """Rewrite a JSON-lines file in place with the lines of the records `keep` accepts, byte for byte;
    malformed lines go. In place, not renamed over: a logger may hold the file open for appending."""
    path = Path(path)
    if not path.is_file():
        return
    with naming(path):
        lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()
        kept = [line for line in lines if (record := parse_line(line)) is not None and keep(record)]
        path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


class JsonlTail:
    """Follows a JSON-lines file: each `read()` returns the records completed since the last one. A file
    that shrank (rewritten from the start, as a resume truncates metrics) is read again from its beginning."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = 0
        self.skipped = 0  # malformed lines seen so far

    def read(self, final: bool = False) -> list[dict[str, Any]]:
        """The records completed since the last read. `final`: the writer is done, so a last line without
        its newline is read too when it is a whole record (and skipped, counted, when it was cut off)."""
        try:
            with self.path.open("rb") as handle:
                size = handle.seek(0, 2)
                if size < self.offset:
                    self.offset = 0
                handle.seek(self.offset)
                data = handle.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return []
        end = len(data) if final else data.rfind(b"\n") + 1
        self.offset += end
        records, bad = _records(data[:end])
        self.skipped += bad
        return records
