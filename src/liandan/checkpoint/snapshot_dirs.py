"""Memory snapshot directories and headers: the files of `snapshots.py` that the supervisor reads (where
a run's snapshots are, which step every rank holds) without importing torch, so that starting a supervised run
stays quick. The tensors themselves are `snapshots.py`'s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path

from liandan.run.worker_env import WorkerEnv

FORMAT = "liandan-memory-snapshot"
VERSION = 1
ALIGN = 64
SLOTS = 2


def default_base() -> Path:
    """Host shared memory where there is one (Linux), else the temporary directory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _prefix(run_dir: Path) -> str:
    return f"liandan-{hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]}-"


def create_dir(run_dir: Path, base: str | Path = "") -> Path:
    """A new snapshot directory for a supervisor of `run_dir` under `base` (default: /dev/shm):
    `liandan-<hash of the run directory>-<random>`, mode 0700, made by mkdtemp, which never reuses an
    existing path and never follows a symlink."""
    where = Path(base or default_base())
    try:
        return Path(tempfile.mkdtemp(prefix=_prefix(run_dir), dir=where))
    except OSError as err:
        from liandan.config import ConfigError

        raise ConfigError(f"checkpoint.memory_dir = '{where}': cannot create a snapshot directory there "
                          f"({err.strerror or err})") from None  # fmt: skip


def handed_dir() -> Path | None:
    """The snapshot directory the supervisor handed to this worker ($LIANDAN_SNAPSHOT_DIR), if any."""
    return WorkerEnv.from_env().snapshot_dir


def check_dir(directory: Path) -> None:
    """Raise unless `directory` is a real directory (no symlink) of this user that no one else may enter."""
    info = os.lstat(directory)
    problem = None
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory but a symlink or a file" if stat.S_ISLNK(info.st_mode) else "is not a directory"
    elif info.st_uid != os.geteuid():
        problem = f"belongs to user {info.st_uid}, not to this one ({os.geteuid()})"
    elif info.st_mode & 0o077:
        problem = f"is open to other users (mode {stat.S_IMODE(info.st_mode):o}, not 700)"
    if problem:
        raise PermissionError(f"memory snapshot directory {directory} {problem}: refusing to write snapshots there")


def snapshot_dirs(run_dir: Path, base: str | Path = "") -> list[Path]:
    """The snapshot directories of supervisors of `run_dir` under `base` that are there now."""
    where = Path(base or default_base())
    prefix = _prefix(run_dir)
    try:
        return sorted(p for p in where.iterdir() if p.name.startswith(prefix) or p.name == prefix[:-1])
    except OSError:
        return []


def remove_dir(directory: Path | None) -> None:
    """Remove a snapshot directory this user owns (a symlink there is unlinked, never followed); raises
    OSError when it cannot."""
    if directory is None:
        return
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(info.st_mode):
        os.unlink(directory)  # what is at the path goes, never what it points to
        return
    check_dir(directory)
    shutil.rmtree(directory)  # removes links inside, never their targets


def remove_stale(run_dir: Path, base: str | Path = "") -> list[Path]:
    """Remove what earlier supervisors of `run_dir` left in memory (a supervisor killed outright cannot
    clean up): the directories of this user among `snapshot_dirs`. Others' entries, and symlinks, are left
    alone. Returns those that could not be removed."""
    left = []
    for directory in snapshot_dirs(run_dir, base):
        try:
            info = os.lstat(directory)
            if stat.S_ISDIR(info.st_mode) and info.st_uid == os.geteuid():
                shutil.rmtree(directory)
        except OSError:
            left.append(directory)
    return left


def _open_existing(path: Path):
    """`path` opened for reading, unless it is a symlink (OSError then)."""
    return os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")


def _slot_paths(directory: Path, rank: int, slot: int) -> tuple[Path, Path]:
    """A slot's data and header files."""
    stem = f"rank-{rank:05d}.slot-{slot}"
    return directory / f"{stem}.bin", directory / f"{stem}.json"


def _read_header(path: Path, owner: str | None, world_size: int | None, layout: str | None) -> dict | None:
    """A header if it belongs to this owner, world and layout (each unless None), else None."""
    try:
        with _open_existing(path) as f:
            header = json.loads(f.read())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    expected = {"format": FORMAT, "version": VERSION, "owner": owner, "world_size": world_size, "layout": layout}
    return header if all(header.get(k) == v for k, v in expected.items() if v is not None) else None


def _held(directory: Path, rank: int, owner: str, world_size: int, layout: str | None) -> dict[int, int]:
    out = {}
    for slot in range(SLOTS):
        header = _read_header(_slot_paths(Path(directory), rank, slot)[1], owner, world_size, layout)
        if header is not None:
            out[header["step"]] = slot
    return out


def newest_common_step(directory: Path, world_size: int, owner: str) -> int | None:
    """The newest step of which every rank's snapshot header is here: the supervisor's view of where a
    restart resumes (on several nodes only the local ranks' files are here, and this returns None)."""
    held = [set(_held(directory, rank, owner, world_size, None)) for rank in range(world_size)]
    common = held[0].intersection(*held[1:])
    return max(common) if common else None


def newest_held_step(directory: Path | None) -> int | None:
    """The newest step of any rank's snapshot header in `directory`, whichever owner and world wrote it: whether
    host memory holds anything to resume from, before the ranks agree on a step (None: nothing)."""
    headers = (
        _read_header(path, None, None, None) for path in (Path(directory).glob("rank-*.json") if directory else ())
    )
    return max((h["step"] for h in headers if h is not None and isinstance(h.get("step"), int)), default=None)
