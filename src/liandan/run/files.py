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
from typing import IO, Any

from liandan.config import ConfigError

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


def temporary(path: Path, unique: bool = False) -> Path:
    """The temporary name a whole file is written under (hidden, next to it): a writer killed midway leaves it
    behind, and whoever owns the directory may remove it. `unique`: one name per process, for a file that
    several processes may replace at once (each then renames a whole file of its own)."""
    path = Path(path)
    return path.with_name(f".{path.name}{f'.{os.getpid()}' if unique else ''}{TMP_SUFFIX}")


@contextlib.contextmanager
def replacing(path: Path | str, *, durable: bool = True, unique: bool = False) -> Iterator[Path]:
    """Yields the temporary path a writer fills (for writers that take a file name: a tokenizer's or
    safetensors' save); when the block ends it is flushed to disk and renamed over `path`. On any error the
    old file stays as it was, the temporary is removed, and the error propagates with the path in it. The one
    implementation of every whole-file write of liandan."""
    path = Path(path)
    tmp = temporary(path, unique)
    with naming(path):
        try:
            tmp.unlink(missing_ok=True)  # left by a writer killed midway; never written through (a link, say)
            yield tmp
            if durable:
                fsync_path(tmp)
            os.replace(tmp, path)  # a rename replaces what is at the path, it never follows a link
        except BaseException:
            with contextlib.suppress(OSError):  # the error that got here is the one to report
                tmp.unlink(missing_ok=True)
            raise
        if durable:
            fsync_path(path.parent)


def umask_mode(mode: int = 0o666) -> int:
    """`mode` as the process's umask leaves it: what a file created by `open` gets. For writers that create
    their files private whatever the umask (safetensors does: 0600), so that their files match the rest."""
    try:  # Linux says it without changing it
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return mode & ~int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: read by setting it, and put back at once
    os.umask(mask)
    return mode & ~mask


@contextlib.contextmanager
def atomic_file(
    path: Path | str, mode: str = "wb", *, durable: bool = True, private: bool = False, unique: bool = False
) -> Iterator[IO[Any]]:
    """An open file whose contents replace `path` all at once when the block ends (see `replacing`): for
    writers that stream. `private`: readable by this user only."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode {mode!r}: a replacing file is written from its start ('w' or 'wb')")
    with replacing(path, durable=durable, unique=unique) as tmp:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(tmp, flags, 0o600 if private else 0o666)
        with open(fd, mode, encoding=None if "b" in mode else "utf-8") as handle:
            yield handle


def atomic_write(path: Path, data: str | bytes, *, durable: bool = True, private: bool = False) -> None:
    """Replace `path` with `data` all at once. On any error (a full disk, say) the old file stays as it was,
    the temporary is removed, and the error propagates with the path in it."""
    with atomic_file(path, durable=durable, private=private) as handle:
        handle.write(data.encode("utf-8") if isinstance(data, str) else data)


def atomic_write_json(path: Path, obj: Any, *, durable: bool = True) -> None:
    atomic_write(path, dumps_json(obj, indent=2) + "\n", durable=durable)


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """Append one record as one line (opened, written and closed per call: for files written rarely, such
    as a supervisor's events; loggers that write every step keep their file open)."""
    with naming(path), open(path, "a", encoding="utf-8") as handle:
        handle.write(dumps_json(record) + "\n")


def check_output(path: Path | str, *, directory: bool = False, makes_parents: bool = False) -> Path:
    """`path`, once it is known that a file (or with `directory`, a directory) can be written there: checked
    before the work whose result goes there, so a mistyped output path costs no evaluation. ConfigError in one
    line when a directory stands where the file goes (or a file where the directory goes), a file stands where
    one of its parent directories goes, its directory does not exist (unless the writer `makes_parents`), or
    the nearest existing parent cannot be written in."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a file, not a directory")
    if not directory and path.is_dir():
        raise ConfigError(f"cannot write {path}: it is a directory; name a file in it")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"cannot write {path}: {parent} is not a directory")
    if parent != path.parent and not makes_parents:
        raise ConfigError(f"cannot write {path}: no such directory {path.parent}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write {path}: no permission to write in {parent}")
    return path
