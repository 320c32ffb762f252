"""Token stores and reports published from a local work directory to object storage or a shared file system.

An object store has no rename, so a store cannot be written under a temporary name and moved into
place. A directory is therefore published file by file with its completion marker (a store's manifest.json, a
report's report.json) put last, in one put: a reader that finds the marker finds every file it lists. Before the
first file goes up, a `.publishing` object naming the marker to come is written (and any older marker removed),
so a publisher that dies midway leaves a destination that no reader takes as complete and that the next publish
of the same content resumes, putting only the files still missing or of the wrong size.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from liandan.data.documents import storage
from liandan.data.documents.corpus import DataError
from liandan.data.documents.storage import read_if_present, storage_errors
from liandan.data.tokens.store import MANIFEST
from liandan.faults import maybe_inject
from liandan.run import atomic_file, atomic_write
from liandan.run.remote import RemotePath, is_url, locate

PENDING = ".publishing"
REPORT_MARKER = "report.json"


def _sizes(dest: Path | RemotePath) -> dict[str, int]:
    """Size of every file under `dest`, by its path relative to it."""
    if isinstance(dest, RemotePath):
        with storage_errors(dest, "list"):
            dest.fs.invalidate_cache(dest.path)
            if not dest.fs.isdir(dest.path):
                return {}
            found = dest.fs.find(dest.path, detail=True)
        return {p[len(dest.path) + 1 :]: int(info["size"]) for p, info in found.items()}
    return {str(p.relative_to(dest)): p.stat().st_size for p in dest.rglob("*") if p.is_file()}


def _put(source: Path, target: Path | RemotePath) -> None:
    if isinstance(target, RemotePath):
        with storage_errors(target, "write"):
            target.fs.put_file(str(source), target.path)  # a multipart upload appears only once complete
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as inp, atomic_file(target, "wb", durable=False) as out:
        while block := inp.read(storage.CHUNK_BYTES):
            out.write(block)


def _write(target: Path | RemotePath, data: bytes) -> None:
    if isinstance(target, RemotePath):
        with storage_errors(target, "write"):
            target.write_bytes(data)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, data, durable=False)


def _remove(target: Path | RemotePath) -> None:
    with storage_errors(target, "write"):
        target.unlink(missing_ok=True)


def publish(local: Path, url: str, marker: str) -> int:
    """Copy the finished directory `local` to `url`, its `marker` file last; returns the files put (0 when `url`
    already holds the same marker and files of the same sizes)."""
    dest = locate(url)
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*")
                   if p.is_file() and not p.name.startswith("."))  # fmt: skip
    if marker not in files:
        raise DataError(f"{local} has no {marker}: it is not finished, so it is not published")
    files.remove(marker)
    ours = (local / marker).read_bytes()
    token = xxhash.xxh3_64_hexdigest(ours)
    there = _sizes(dest)
    wanted = [f for f in files if there.get(f) != (local / f).stat().st_size]
    complete = there.get(marker) == len(ours) and read_if_present(dest / marker) == ours
    if complete and not wanted:
        if PENDING in there:  # a publisher stopped between its marker and this note's removal
            _remove(dest / PENDING)
        return 0
    if not (PENDING in there and read_if_present(dest / PENDING) == token.encode()):
        _remove(dest / marker)  # first: from here on the destination is incomplete, never half-replaced
        _write(dest / PENDING, token.encode())
        wanted = files  # what is there was put by another publish: same sizes do not make the same files
    elif complete:
        _remove(dest / marker)
    for done, name in enumerate(wanted):
        _put(local / name, dest / name)
        maybe_inject("publish", done)
    _write(dest / marker, ours)
    _remove(dest / PENDING)
    return len(wanted) + 1


def publish_outputs(
    url: str, stores: dict[str, Path], report: Path | None, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Publish each finished store (by source name) to `<url>/stores/<name>` and the report to `<url>/report`;
    returns where they went, as the pipeline's summary records it."""
    published: dict[str, Any] = {"stores": {}}
    for name, local in stores.items():
        target = join(url, "stores", name)
        put = publish(local, target, MANIFEST)
        published["stores"][name] = target
        if say is not None:
            say(f"store {name} -> {target}" + (f" ({put} file(s) put)" if put else " (already there)"))
    if report is not None:
        published["report"] = join(url, "report")
        publish(report, published["report"], REPORT_MARKER)
    return published


def join(url: str, *names: str) -> str:
    """`url` with path components added, for URLs and local paths alike."""
    return "/".join([url.rstrip("/"), *names]) if is_url(url) else str(Path(url, *names))
