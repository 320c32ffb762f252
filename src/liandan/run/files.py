"""Writing a run's files so that a reader never sees half of one: whole files go to a temporary name in the
same directory, are flushed to disk and renamed over the old one; JSON-lines records are appended one whole
line at a time. JSON is written strictly: a non-finite number becomes null, never the invalid `NaN`."""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps_json(obj: Any, indent: int | None = None) -> str:
    """Valid JSON for any record a run writes: NaN and infinities become null; other objects their str()."""
    return json.dumps(_finite(obj), indent=indent, allow_nan=False, default=str)


@contextlib.contextmanager
def naming(path: Path | str) -> Iterator[Path]:
    """Give OS errors raised inside the name of `path` (a write to an open file, on a full disk say, carries
    no file name of its own), so the error says which file failed. Yields `path`."""
    try:
        yield Path(path)
    except OSError as err:
        if err.filename:
            raise
        raise OSError(err.errno, err.strerror or str(err) or type(err).__name__, str(path)) from err


def fsync_path(path: Path) -> None:
    """Flush a file to disk, or make the renames in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: str | bytes, *, durable: bool = True) -> None:
    """Replace `path` with `data` all at once. On any error (a full disk, say) the old file stays as it was,
    the temporary is removed, and the error propagates with the path in it."""
    path = Path(path)
    tmp = temporary(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    with naming(path):
        try:
            with open(tmp, "wb") as handle:
                handle.write(payload)
                handle.flush()
                if durable:
                    os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            fsync_path(path.parent)


def temporary(path: Path) -> Path:
    """The temporary name `atomic_write` writes `path` under (hidden, next to it): a writer killed midway
    leaves it behind, and whoever owns the directory may remove it."""
    path = Path(path)
    return path.with_name(f".{path.name}{TMP_SUFFIX}")


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    atomic_write(path, dumps_json(obj, indent=2) + "\n", durable=durable)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line (opened, written and closed per call: for files written rarely, such
    as a supervisor's events; loggers that write every step keep their file open)."""
    with naming(path), open(path, "a", encoding="utf-8") as handle:
        handle.write(dumps_json(record) + "\n")
