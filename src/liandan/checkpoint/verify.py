"""Manifests: what makes a checkpoint directory complete and trustworthy.

A checkpoint is complete only when `manifest.json` exists; it is written last, after every other file has
been written and fsync'd, and lists each file's size and xxh64 checksum. Verification re-reads every file
and names the first one that is missing, truncated or changed, and reads DCP's `.metadata` the way loading
will, with nothing admitted but DCP's metadata classes (the manifest is unsigned: it shows damage, not
tampering).
"""

from __future__ import annotations

import json
from pathlib import Path

import xxhash

from liandan.run import META
from liandan.run.files import atomic_write, fsync_path
from liandan.run.remote import RemotePath, locate
from liandan.run.steps import (  # noqa: F401 - re-exported for checkpoint callers
    MANIFEST,
    STEP_DIR,
    complete_step_dirs,
    parse_step_dir,
    step_dir_name,
    step_dirs,
)

FORMAT = "liandan-checkpoint"
VERSION = 1
_CHUNK = 8 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or used; the message names the checkpoint and the file."""


def step_of(directory: Path) -> int | None:
    """The step of a `step-XXXXXXXX` directory (None for any other name)."""
    return parse_step_dir(locate(directory).name)


# Every step directory under a root, complete or not, and those with a manifest (not yet verified), oldest
# first: the run room's listings, under the names the checkpoint modules use.
step_directories = step_dirs
complete_checkpoints = complete_step_dirs


def file_digest(path: Path) -> str:
    h = xxhash.xxh64()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(directory: Path) -> dict:
    """fsync every file in `directory`, then write the manifest atomically (temp file, fsync, rename). In a
    store, the checksums are of the objects as stored (read back), and the manifest is one put."""
    remote = isinstance(directory, RemotePath)
    files = {}
    paths = directory.rglob("*") if remote else (p for p in directory.rglob("*") if p.is_file())
    for path in sorted(p for p in paths if p.name != MANIFEST):
        if not remote:
            fsync_path(path)
        files[str(path.relative_to(directory))] = {"bytes": path.stat().st_size, "xxh64": file_digest(path)}
    manifest = {"format": FORMAT, "version": VERSION, "files": files}
    if remote:
        (directory / MANIFEST).write_text(json.dumps(manifest, indent=1))
    else:
        atomic_write(directory / MANIFEST, json.dumps(manifest, indent=1))  # durable: file and directory fsync'd
    return manifest


def verify(directory: Path, checksums: bool = True) -> None:
    """Raise CheckpointError unless every file of the manifest is present with its size and checksum, and
    `.metadata` holds nothing but DCP's metadata."""
    directory = locate(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{directory}: incomplete checkpoint ({MANIFEST} missing)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise CheckpointError(f"{path}: unreadable manifest") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{path}: not a version-{VERSION} {FORMAT} manifest")
    for name, expected in files.items():
        file = directory / name
        if not file.is_file():
            raise CheckpointError(f"{directory}: file {name} is missing")
        size = file.stat().st_size
        if size != expected["bytes"]:
            raise CheckpointError(f"{directory}: file {name} has {size} bytes, the manifest says {expected['bytes']}")
        if checksums and file_digest(file) != expected["xxh64"]:
            raise CheckpointError(f"{directory}: file {name} fails its checksum (contents changed)")
    if (directory / ".metadata").is_file():
        from liandan.checkpoint.restricted import read_metadata

        read_metadata(directory)
    if (directory / META).is_file():
        _check_meta(directory)


def read_meta(path: Path) -> dict:
    """A checkpoint's meta.json; CheckpointError, naming the checkpoint, when it is missing or not a JSON object."""
    try:
        meta = json.loads((locate(path) / META).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file {META} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: file {META} is not JSON: {err}") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path}: file {META} is not a JSON object")
    return meta


def _check_meta(directory: Path) -> None:
    """meta.json must say which step it is: a file changed together with its checksum passes the manifest,
    and resuming from it would otherwise fail outside the fallback to an older checkpoint."""
    step = read_meta(directory).get("step")
    if type(step) is not int or step < 0:
        raise CheckpointError(f"{directory}: file {META} does not give the step as a whole number (step: {step!r})")


def total_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.rglob("*") if p.is_file())
